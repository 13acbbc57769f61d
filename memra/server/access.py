"""Who may call the server from a browser (CORS) and the one line a request leaves in the log.

CORS: with `memra serve --allowed-origins A,B` (vLLM's flag; `*` for any) a browser page from those
origins may call the API: Starlette's CORSMiddleware answers the OPTIONS preflight and adds the
Access-Control headers. It is installed outermost, so a preflight is answered before the API-key check
(a browser sends no Authorization header on a preflight). Without the flag no CORS header is sent and a
preflight is a 405, as before: cross-origin access is opt-in.

The request log: one line per request when its response has been sent, as vLLM's and llama-server's
access logs print it: client, method, path, status, and the time from the request's arrival to the
last byte of its body (a stream's whole length). `--disable-log-requests` turns it off.
"""

from __future__ import annotations

import sys
import time

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware


def install_cors(app: FastAPI, origins: tuple[str, ...]) -> None:
    if origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(origins), allow_methods=["*"], allow_headers=["*"])


class RequestLog:
    """An ASGI middleware writing one line per HTTP request to `out` once its response is complete."""

    def __init__(self, app, out=None):
        self.app, self.out = app, out

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start, status = time.perf_counter(), [0]

        async def sending(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            client = scope.get("client") or ("-", 0)
            line = (f"memra serve: {client[0]}:{client[1]} \"{scope['method']} {scope['path']}\" {status[0] or '-'} "
                    f"{1e3 * (time.perf_counter() - start):.1f} ms\n")
            (self.out or sys.stderr).write(line)


def install_request_log(app: FastAPI, on: bool, out=None) -> None:
    if on:
        app.add_middleware(RequestLog, out=out)
