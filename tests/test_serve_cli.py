"""`memra serve` and `memra convert` as a user runs them: real processes, real signals, real files.

- SIGTERM with long answers in flight: each gets `--shutdown-timeout` seconds, then every open stream
  ends with an error event and `data: [DONE]`, every waiting non-streaming request with a 503 body —
  never a body cut off without a word (uvicorn's own limit used to cut them at 30 s);
- a port in use is a one-line error before the model loads;
- the API key from a file or from MEMRA_API_KEY (not only from a flag the process list shows);
- `convert` refuses a directory or an unwritable destination at once, in one line, and a conversion
  that fails midway leaves no file behind.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest


ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
KEY = "sk-cli-test"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(*args: str, env=None) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "memra", "serve", "demo", "--port", str(port), *args],
                            stderr=subprocess.PIPE, text=True, env=env or ENV)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"memra serve did not start: {proc.stderr.read()}")
        time.sleep(0.1)


def _stream_lines(url: str, out: list, started: threading.Event) -> None:
    body = {"prompt": "KING LEAR:", "max_tokens": 3000, "temperature": 0, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=120) as r:
        for line in r.iter_lines():
            if line:
                out.append(line)
            if len(out) >= 3:
                started.set()


def test_sigterm_ends_every_answer_properly_after_the_shutdown_timeout():
    proc, url = _serve("--max-ctx", "4096", "--max-batch", "4", "--shutdown-timeout", "2",
                       env={**ENV, "MEMRA_API_KEY": KEY})
    try:
        streams = [([], threading.Event()) for _ in range(2)]
        threads = [threading.Thread(target=_stream_lines, args=(url, lines, ev), daemon=True) for lines, ev in streams]
        whole: dict = {}

        def ask_whole():
            whole["r"] = httpx.post(url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=120,
                                    json={"prompt": "ROMEO:", "max_tokens": 3000, "temperature": 0})

        threads.append(threading.Thread(target=ask_whole, daemon=True))
        for t in threads:
            t.start()
        assert all(ev.wait(60) for _, ev in streams)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(60)
        ended = time.monotonic() - sent
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = proc.stderr.read()
    assert "Traceback" not in err and "drained and stopped" in err, err
    assert 2 <= ended < 12, ended  # the drain deadline, then the aborts reach the clients at once
    for lines, _ in streams:
        assert lines[-1] == "data: [DONE]", lines[-3:]
        error = json.loads(lines[-2][len("data: "):])["error"]
        assert error["code"] == 503 and "shut down" in error["message"], error
        assert all("error" not in json.loads(x[6:]) for x in lines[:-2])  # tokens until then, as usual
    r = whole["r"]
    assert r.status_code == 503 and "shut down" in r.json()["error"]["message"], r.text


def test_api_key_from_a_file():
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".key", delete=False) as f:
        f.write(KEY + "\n")
    proc, url = _serve("--api-key-file", f.name)
    try:
        body = {"prompt": "x", "max_tokens": 1}
        assert httpx.post(url + "/v1/completions", json=body).status_code == 401
        lower = {"Authorization": f"bearer {KEY}"}  # the scheme in any case
        assert httpx.post(url + "/v1/completions", json=body, headers=lower).status_code == 200
        assert KEY not in " ".join(proc.args)  # the key never was on the command line
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        os.unlink(f.name)


def test_a_port_in_use_is_one_line_before_the_model_loads():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "memra", "serve", "demo", "--port", str(port)], capture_output=True,
                           text=True, timeout=120, env=ENV)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot listen on 127.0.0.1" in lines[0] and "--port" in lines[0], r.stderr
    assert "http://" not in r.stderr  # it never got as far as loading and announcing itself


def test_convert_refuses_a_bad_destination_at_once(tmp_path):
    a_file = tmp_path / "plain.txt"
    a_file.write_text("x")
    for out, needle in ((str(tmp_path), "is a directory"), (str(tmp_path / "no" / "x.gguf"), "does not exist"),
                        (str(a_file / "x.gguf"), "does not exist")):
        r = subprocess.run([sys.executable, "-m", "memra", "convert", "demo", out], capture_output=True, text=True,
                           timeout=120, env=ENV)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and needle in r.stderr, r.stderr


def test_a_conversion_that_fails_midway_leaves_nothing(tmp_path, monkeypatch):
    """The disk fills up while the tensors are written (the header is already out): neither the GGUF nor
    the temporary file is left behind, and a later conversion to the same name works."""
    import gguf

    from memra.convert import convert
    from memra.loading.checkpoint import DEMO_DIR

    def disk_full(self, *args, **kwargs):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(gguf.GGUFWriter, "write_tensors_to_file", disk_full)
        with pytest.raises(OSError, match="No space"):
            convert(DEMO_DIR, tmp_path / "demo.gguf", "f16")
    assert list(tmp_path.iterdir()) == []  # no demo.gguf, no temporary file
    out = convert(DEMO_DIR, tmp_path / "demo.gguf", "f16")
    assert [p.name for p in tmp_path.iterdir()] == ["demo.gguf"] and Path(out).stat().st_size > 1 << 20
