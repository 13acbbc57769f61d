"""Out of device memory during an engine's warm-up (memra.engine.warmup.warm_engine): the captured steps of
a wide max_batch did not fit beside pools that took the whole KV budget (a Qwen3.5-9B engine at max_batch 512
on an H100 stopped with torch's OutOfMemoryError and its traceback). Now: one line naming the fix, and the
engine's pools given back, before any request is taken."""

from __future__ import annotations

import pytest
import torch

import memra
from memra.engine import warmup
from memra.engine.engine import Engine, EngineConfig
from memra.errors import MemraError


def test_out_of_memory_in_the_warm_up_is_one_line_and_gives_the_pools_back(monkeypatch):
    # CPU has no device allocator to exhaust: the warm-up's own step raises what CUDA's allocator raises
    def exhausted(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 380.00 MiB")

    engine = Engine(memra.load("demo"), EngineConfig(max_batch=4, max_ctx=64))
    monkeypatch.setattr(warmup, "warm_up", exhausted)
    with pytest.raises(MemraError) as refused:
        engine.warm_up()
    line = str(refused.value)
    assert "\n" not in line and line.startswith("max_batch 4:") and "--kv-fraction" in line
    assert engine.backend.pools is None  # closed: the pools and captured steps are the garbage collector's

