"""`memra bench serve --launch MODEL`: `memra serve MODEL` started as a child process on a free loopback
port, as users run it, and stopped (SIGINT: the server's orderly drain) when the load test is done.

Not a server thread in the benchmark's own process: there the client's Python (one SSE chunk to parse
per stream per token) shares the interpreter lock with the engine's step loop. On an H200 with the
Llama-3-8B shape at concurrency 64 that stretched the engine's decode steps from 6.05 to 10.55 ms and
cut the measured rate from 6,867 to 4,261 tok/s; the number measured the benchmark, not the server.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import IO

from memra.errors import MemraError
from memra.settings import process_env

POLL_S = 0.25
STOP_GRACE_S = 60.0  # after SIGINT: the drain of an idle server takes well under this


def free_port() -> int:
    """A loopback port free now (the OS's pick; the child binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LaunchedServer:
    proc: subprocess.Popen
    url: str
    log: IO[bytes]  # the child's stdout + stderr (a temporary file)

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read().decode("utf-8", "replace")

    def stop(self) -> None:
        """SIGINT (the server drains and exits), then a kill if it has not exited within STOP_GRACE_S."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def _answers(url: str, api_key: str | None) -> bool:
    req = urllib.request.Request(f"{url}/v1/models", headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(req, timeout=2):
            return True
    except (urllib.error.URLError, OSError):
        return False


def launch_server(model: str, *, max_batch: int, max_ctx: int, device: str | None, dtype: str | None,
                  api_key: str | None, ready_timeout_s: float = 1800.0, extra_args: tuple[str, ...] = ()) -> LaunchedServer:
    """Start `memra serve MODEL` and wait until /v1/models answers. A child that exits first, or never
    answers within ready_timeout_s, is a MemraError carrying the last line it printed."""
    port = free_port()
    cmd = [sys.executable, "-m", "memra", "serve", model, "--host", "127.0.0.1", "--port", str(port),
           "--max-batch", str(max_batch), "--max-ctx", str(max_ctx)]
    cmd += ["--device", device] if device else []
    cmd += ["--dtype", dtype] if dtype else []
    cmd += list(extra_args)
    log = tempfile.TemporaryFile()
    env = {**process_env(), **({"MEMRA_API_KEY": api_key} if api_key else {})}  # not on the command line
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    server = LaunchedServer(proc, f"http://127.0.0.1:{port}", log)
    print(f"bench serve: started `memra serve {model}` (pid {proc.pid}) on {server.url}; waiting for it to load",
          file=sys.stderr, flush=True)
    deadline = time.monotonic() + ready_timeout_s
    while not _answers(server.url, api_key):
        if proc.poll() is not None or time.monotonic() > deadline:
            lines = server.output().strip().splitlines()
            server.stop()
            why = f"exited with status {proc.returncode}" if proc.returncode is not None else \
                f"did not answer within {ready_timeout_s:.0f} s"
            raise MemraError(f"--launch {model}: the server {why}: {lines[-1] if lines else 'no output'}")
        time.sleep(POLL_S)
    for line in server.output().splitlines():
        if line.startswith("memra serve:"):
            print(line, file=sys.stderr)
    return server
