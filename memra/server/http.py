"""Running the app under uvicorn: the port taken before the model loads, and a shutdown that ends
every answer properly.

Shutdown (SIGTERM, SIGINT, or `ServerThread.stop`): uvicorn stops accepting connections and waits for
the open ones. Before it waits, `HttpServer` starts the engine's drain: new requests get 503, in-flight
ones have `shutdown_timeout` seconds to finish, and at that deadline the engine aborts what is left, so
every open stream gets an error event and `data: [DONE]` and every waiting non-streaming request a 503
body. uvicorn's own deadline (which cuts connections mid-body) is set GRACE_S later, so it never fires
first. Then the app's lifespan stops the engine thread.
"""

from __future__ import annotations

import math
import socket
import sys
import threading
import time

import uvicorn
from fastapi import FastAPI

from memra.errors import MemraError

GRACE_S = 10  # after the drain deadline: time for the aborted answers to reach their clients
SWITCH_INTERVAL_S = 0.0002  # how soon the GIL goes to a waiting thread (the process's setting; see HttpServer)


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, taken now: a port in use is a one-line error before anything slow happens."""
    if not 0 <= port < 65536:
        raise MemraError(f"--port must be in 1..65535, got {port}")
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as e:
        raise MemraError(f"--host {host!r} is not an address this machine can listen on ({e.strerror})") from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: a restart reuses TIME_WAIT ports
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise MemraError(f"cannot listen on {host}:{port} ({e.strerror}); is another server using it? "
                         "pick another port with --port") from None
    return sock


class HttpServer(uvicorn.Server):
    """uvicorn for an app made by memra.server.api.build_app (its engine and options are on app.state)."""

    def __init__(self, app: FastAPI, log_level: str = "warning"):
        # Python hands the GIL to a waiting thread only every switch interval (5 ms by default): the engine
        # thread, back from the GPU, would wait that long behind the event loop's formatting of the
        # previous step's tokens, several times a step. A short interval keeps the engine fed.
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        drain = app.state.options.shutdown_timeout
        super().__init__(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=math.ceil(drain) + GRACE_S))
        self.engine, self.drain_s = app.state.engine, drain

    async def shutdown(self, sockets=None) -> None:
        self.engine.begin_drain(self.drain_s)
        await super().shutdown(sockets)


class ServerThread:
    """An HttpServer on a background thread (tests, `memra bench serve`), on a free port by default."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0):
        self.app = app
        self.server = HttpServer(app)
        self.sock = bind(host, port)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, name="memra-http",
                                       daemon=True)
        self.host = host
        self.port = self.sock.getsockname()[1]

    def start(self, timeout: float = 60.0) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                why = getattr(self.app.state, "startup_error", None) or "no startup error was recorded"
                raise MemraError(f"the HTTP server did not start ({why})")
            time.sleep(0.02)
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=self.server.drain_s + GRACE_S + 60)
