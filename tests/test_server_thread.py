"""An in-process server whose engine cannot start says why, in its one line (uvicorn alone logs the error
and exits its thread, which left `the HTTP server did not start` and nothing else)."""

from __future__ import annotations

import pytest

import memra
from memra.engine.engine import Engine, EngineConfig
from memra.errors import MemraError
from memra.server.api import build_app
from memra.server.http import ServerThread


def test_a_failed_engine_start_is_named_in_the_servers_error(monkeypatch):
    engine = Engine(memra.load("demo"), EngineConfig(max_batch=2, max_ctx=128))

    def fail() -> None:
        raise MemraError("the warm-up ran out of device memory")

    monkeypatch.setattr(engine, "start", fail)
    with pytest.raises(MemraError) as err:
        ServerThread(build_app(engine, "demo")).start(timeout=30)
    assert str(err.value) == ("the HTTP server did not start (MemraError: the warm-up ran out of device memory)")
