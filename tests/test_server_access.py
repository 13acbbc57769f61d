"""CORS and the request log, on a real server on loopback: with --allowed-origins a browser's preflight
is answered (before the API key is asked for) and responses carry the origin; without it no CORS header
is sent; with the log on, every request leaves one line naming it and its status once it is complete."""

from __future__ import annotations

import httpx
import pytest

import memra
from memra.engine.engine import Engine, EngineConfig
from memra.server.api import build_app
from memra.server.http import ServerThread
from memra.server.options import ServerOptions

KEY = "sk-access"
ORIGIN = "http://app.example"


@pytest.fixture(scope="module")
def demo():
    return memra.load("demo")


def _serve(model, **options):
    engine = Engine(model, EngineConfig(max_batch=2, max_ctx=256))
    return ServerThread(build_app(engine, "demo", ServerOptions(api_key=KEY, **options))).start()


def test_cors_is_opt_in_and_preflights_pass_the_key_check(demo):
    srv = _serve(demo, allowed_origins=(ORIGIN,))
    try:
        pre = httpx.options(srv.url + "/v1/completions", headers={
            "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type"})
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == ORIGIN
        r = httpx.post(srv.url + "/v1/completions", headers={"Origin": ORIGIN, "Authorization": f"Bearer {KEY}"},
                       json={"model": "demo", "prompt": "ROMEO:", "max_tokens": 2})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
        other = httpx.options(srv.url + "/v1/completions", headers={
            "Origin": "http://elsewhere", "Access-Control-Request-Method": "POST"})
        assert "access-control-allow-origin" not in other.headers
    finally:
        srv.stop()
    srv = _serve(demo)
    try:
        r = httpx.get(srv.url + "/v1/models", headers={"Origin": ORIGIN})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
        assert httpx.options(srv.url + "/v1/completions", headers={"Origin": ORIGIN}).status_code in (401, 405)
    finally:
        srv.stop()


def test_every_request_leaves_one_log_line(demo, capsys):
    srv = _serve(demo, log_requests=True)
    try:
        httpx.get(srv.url + "/health")
        httpx.post(srv.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                   json={"model": "demo", "prompt": "ROMEO:", "max_tokens": 2, "stream": True}).read()
        httpx.post(srv.url + "/v1/completions", json={"model": "demo", "prompt": "x"})  # no key: 401
    finally:
        srv.stop()
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("memra serve: 127.0.0.1")]
    assert len(lines) == 3
    assert '"GET /health" 200' in lines[0] and '"POST /v1/completions" 200' in lines[1]
    assert '"POST /v1/completions" 401' in lines[2] and all(ln.endswith(" ms") for ln in lines)
