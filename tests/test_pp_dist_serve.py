"""`memra serve --pp-size N`: the OpenAI server over a process-per-stage pipeline, for real.

Real processes (gloo on loopback), real HTTP (uvicorn on a free port), the bundled demo model (a
hybrid: Gated DeltaNet + attention, with an MTP block). The in-process tests make this test process
rank 0 — the engine takes the DistPipeline in the model's place — and spawn rank 1 as a child; the
command-line tests run `python -m memra serve` itself, spawning (--pp-size 2) or torchrun-style (one
process per rank, the launcher's environment variables set by hand). Answers must equal offline
`generate_tokens` on the single-process model token for token, a killed rank must end requests with a
clear error naming it instead of hanging them, and an orderly stop must leave every worker exited 0.

One thread everywhere (conftest; OMP_NUM_THREADS=1 for the subprocesses): CPU kernels may pick their
reductions by thread count, and the reference is computed in this process. Only one process group
can live in a process, so each in-process server is stopped before the next starts (file order).
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch.distributed as dist

import memra
from conftest import process_doors
from memra.errors import MemraError
from memra.generate import generate_tokens
from memra.pp.dist import PipelineError, launch_local
from memra.sampling import SamplingParams
from memra.server.api import build_app
from memra.server.http import ServerThread
from memra.engine.engine import Engine, EngineConfig
from memra.server.metrics import Metrics
from memra.engine.scheduler import Scheduler, SchedulerConfig
from memra.spec import SpecConfig

PROMPTS = ["ROMEO:", "JULIET:\nO Romeo, Romeo,", "First Citizen:\nBefore we proceed any further, hear me speak.",
           "KING LEAR:\nBlow, winds,"]
CHILD_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
ROOT = str(Path(__file__).resolve().parents[1])
_LIVE: list[ServerThread] = []  # the in-process server running now (its pipeline is this process's group)


@pytest.fixture(scope="module")
def demo():
    return memra.load("demo", device="cpu")  # the single-process reference (launch_local loads its own copy)


def offline(model, prompt: str, **params) -> str:
    ids = model.tokenizer.encode(prompt, add_special=True)
    tokens = generate_tokens(model, ids, SamplingParams(**{"temperature": 0.0, **params}),  # greedy unless told
                             eos_ids=model.tokenizer.eos_ids)
    return model.tokenizer.decode(list(tokens), skip_special=True)


def _serve_pipeline(**doors) -> tuple[ServerThread, Engine]:
    """This process as rank 0 of a 2-rank demo pipeline, serving HTTP on a free port."""
    while _LIVE:
        _LIVE.pop().stop()
    with process_doors(**doors):
        pipe = launch_local("demo", 2, device="cpu")
    try:
        engine = Engine(pipe, EngineConfig(max_batch=4, max_ctx=256), Metrics("demo"))
        srv = ServerThread(build_app(engine, "demo")).start()
    except BaseException:
        pipe.shutdown()
        raise
    _LIVE.append(srv)
    return srv, engine


@pytest.fixture(scope="module")
def served():
    srv, engine = _serve_pipeline()
    yield srv, engine
    srv.stop()


def _complete(url: str, **body) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": "demo", **body}, timeout=120)


def _stream_events(url: str, on_event=None, **body) -> list[dict]:
    """The SSE events of a streamed completion, in order, until [DONE]; on_event(i, event) after each."""
    events = []
    with httpx.stream("POST", url + "/v1/completions", json={"model": "demo", "stream": True, **body},
                      timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            events.append(json.loads(line.removeprefix("data: ")))
            if on_event is not None:
                on_event(len(events), events[-1])
    return events


def _text(events: list[dict]) -> str:
    return "".join(e["choices"][0]["text"] for e in events if e.get("choices"))


# --- no processes: the scheduler sizing the pipeline engine relies on ------------------------------------


def _drive(sched: Scheduler, requests: list[tuple[str, int, int]]) -> int:
    """Run (rid, prompt_len, max_tokens) requests to the end as the engine would (no model, every token
    sampled on time). -> steps taken."""
    want = {rid: (plen, most) for rid, plen, most in requests}
    made = dict.fromkeys(want, 0)
    for r in requests:
        sched.add(*r)
    for step in range(10_000):
        plan = sched.schedule()
        if plan.empty:
            assert all(made[rid] == want[rid][1] for rid in want), made
            return step
        assert not plan.swap_out and not plan.swap_in
        sampled = [rid for rid, start, n in plan.prefill if start + n == want[rid][0]] + plan.decode
        for rid in sampled:
            made[rid] += 1
        sched.step_done({rid: n for rid, _, n in plan.prefill}, sampled,
                        [rid for rid in sampled if made[rid] == want[rid][1]])
    raise AssertionError("the scheduler did not finish")


def test_preemption_off_never_swaps_when_sized_for_the_worst_case_and_refuses_otherwise():
    """The pipeline engine's scheduler: blocks for max_batch whole contexts, preemption off. Requests
    that fill their contexts all finish without a swap; a smaller pool makes schedule() refuse loudly
    where it would have had to swap (fail closed), never plan a swap the engine cannot carry out."""
    max_batch, max_ctx, bs = 3, 100, 16
    requests = [(f"r{i}", 10 + 9 * i, max_ctx - 10 - 9 * i) for i in range(8)]  # prompt + max_tokens == max_ctx
    sized = SchedulerConfig(max_running=max_batch, token_budget=64, prefill_align=16, block_size=bs,
                            total_blocks=max_batch * -(-max_ctx // bs), preemption=False)
    assert _drive(Scheduler(sized), requests) > 0
    short = Scheduler(dataclasses.replace(sized, total_blocks=10))
    with pytest.raises(RuntimeError, match="preemption is off"):
        _drive(short, requests)


# --- one healthy pipeline server ------------------------------------------------------------------------


def test_greedy_seeded_and_streamed_answers_equal_single_process(demo, served):
    srv, engine = served
    assert engine.rt is None and engine.scheduler.cfg.preemption is False
    r = _complete(srv.url, prompt=PROMPTS[1], max_tokens=24, temperature=0)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == offline(demo, PROMPTS[1], max_tokens=24)
    assert r.json()["usage"]["completion_tokens"] == 24
    sampled = _complete(srv.url, prompt=PROMPTS[2], max_tokens=20, temperature=0.9, top_p=0.95, seed=11)
    assert sampled.json()["choices"][0]["text"] == offline(demo, PROMPTS[2], max_tokens=20, temperature=0.9,
                                                           top_p=0.95, seed=11)
    events = _stream_events(srv.url, prompt=PROMPTS[0], max_tokens=30, temperature=0)
    assert _text(events) == offline(demo, PROMPTS[0], max_tokens=30)
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert httpx.get(srv.url + "/health").status_code == 200


def test_concurrent_requests_equal_their_isolated_answers(demo, served):
    """Continuous batching across the process boundary: 8 requests on a 4-wide engine (some queue),
    greedy and seeded sampled, each equal to its offline answer."""
    srv, _ = served
    asks = [dict(prompt=p, max_tokens=12 + 6 * i, temperature=0 if i % 2 else 0.8, seed=i)
            for i, p in enumerate(PROMPTS * 2)]
    with cf.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda a: _complete(srv.url, **a), asks))
    for a, r in zip(asks, answers):
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == offline(demo, a["prompt"], max_tokens=a["max_tokens"],
                                                         temperature=a["temperature"], seed=a["seed"]), a


def test_pipeline_refuses_what_it_cannot_do(served):
    """A smaller KV pool (it relies on swapping) and the MTP drafter are refused with messages that say
    why; the pipeline carries on serving."""
    srv, engine = served
    pipe = engine.model
    with pytest.raises(MemraError, match="kv_blocks=14 .* never swaps"):
        Engine(pipe, EngineConfig(max_batch=4, max_ctx=256, kv_blocks=14))
    with pytest.raises(PipelineError, match="MTP drafter is not wired across processes"):
        list(generate_tokens(pipe, [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=4), speculative=SpecConfig("mtp")))
    assert _complete(srv.url, prompt=PROMPTS[0], max_tokens=3, temperature=0).status_code == 200


def test_orderly_shutdown_workers_exit_zero(served):
    srv, engine = served
    pids = engine.model.workers.pids
    srv.stop()  # what SIGTERM does: drain, stop the engine, shut the pipeline down
    assert engine.model.exit_codes == {1: 0}
    assert not dist.is_initialized()
    assert all(not os.path.exists(f"/proc/{pid}") for pid in pids.values())  # exited and reaped


# --- failures: a rank killed while idle, and under a request in flight -----------------------------------


def test_killed_idle_rank_refuses_the_next_request_at_once():
    srv, engine = _serve_pipeline(MEMRA_PP_DIST_TIMEOUT_S="5")
    pid = engine.model.workers.pids[1]
    assert _complete(srv.url, prompt=PROMPTS[0], max_tokens=4, temperature=0).status_code == 200
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    while engine.health() is None and time.monotonic() - t0 < 5:
        time.sleep(0.02)
    r = _complete(srv.url, prompt=PROMPTS[0], max_tokens=4, temperature=0)
    assert time.monotonic() - t0 < 10
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert "rank 1 killed by SIGKILL" in err["message"] and "restart the server" in err["message"], err
    assert httpx.get(srv.url + "/health").status_code == 503
    srv.stop()
    assert engine.model.exit_codes == {1: -signal.SIGKILL} and not dist.is_initialized()


def test_rank_killed_under_a_streaming_request_ends_it_with_the_error():
    """The engine meets the dead rank mid-request: the stream gets an error event naming it (within the
    timeout door, no hang), later requests get 503, and stopping the server still reaps the worker."""
    srv, engine = _serve_pipeline(MEMRA_PP_DIST_TIMEOUT_S="5")
    pid = engine.model.workers.pids[1]
    killed_at: list[float] = []

    def kill_after_three(i, ev):
        if i == 3:
            os.kill(pid, signal.SIGKILL)
            killed_at.append(time.monotonic())

    events = _stream_events(srv.url, on_event=kill_after_three, prompt=PROMPTS[3], max_tokens=200, temperature=0)
    assert time.monotonic() - killed_at[0] < 10
    errors = [e["error"] for e in events if "error" in e]
    assert len(errors) == 1, events[-3:]
    assert "pipeline failed" in errors[0]["message"] and "rank 1" in errors[0]["message"], errors
    assert len([e for e in events if e.get("choices")]) < 200
    r = _complete(srv.url, prompt=PROMPTS[0], max_tokens=4, temperature=0)
    assert r.status_code == 503 and "stopped after an error" in r.json()["error"]["message"]
    srv.stop()
    assert engine.model.exit_codes == {1: -signal.SIGKILL} and not dist.is_initialized()


# --- the command line: spawned workers, and torchrun's environment ----------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, procs: list[subprocess.Popen], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        for p in procs:
            assert p.poll() is None, p.communicate()[1]
        assert time.monotonic() < deadline, "the server did not come up"
        time.sleep(0.1)


def _children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(entry))
    return kids


def _serve_cmd(port: int) -> list[str]:
    return [sys.executable, "-m", "memra", "serve", "demo", "--port", str(port), "--max-batch", "2", "--max-ctx", "256",
            "--pp-size", "2"]


def test_memra_serve_pp_size_2_answers_and_stops_in_order(demo):
    while _LIVE:
        _LIVE.pop().stop()
    port = _free_port()
    proc = subprocess.Popen(_serve_cmd(port), stderr=subprocess.PIPE, text=True, env=CHILD_ENV, cwd=ROOT)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url, [proc])
        workers = _children(proc.pid)
        assert len(workers) == 1
        r = _complete(url, prompt=PROMPTS[1], max_tokens=16, temperature=0)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == offline(demo, PROMPTS[1], max_tokens=16)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = proc.stderr.read()
    assert "2 pipeline stages (gloo)" in err and "rank 1: stage 1" in err, err
    assert "pipeline workers exited {1: 0}" in err and "Traceback" not in err, err
    assert not os.path.exists(f"/proc/{workers[0]}")


def test_torchrun_style_ranks_serve_on_rank_0_and_exit_zero(demo):
    """Each rank a `memra serve` process with the variables torchrun sets: rank 1 serves its stage inside
    the command and exits 0 when rank 0 (the HTTP server) stops."""
    port, master = _free_port(), _free_port()
    procs = []
    for rank in (0, 1):
        rank_env = dict(CHILD_ENV, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master), RANK=str(rank), WORLD_SIZE="2",
                        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
        procs.append(subprocess.Popen(_serve_cmd(port), stderr=subprocess.PIPE, text=True, env=rank_env, cwd=ROOT))
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url, procs)
        r = _complete(url, prompt=PROMPTS[2], max_tokens=12, temperature=0.7, seed=5)
        assert r.status_code == 200
        assert r.json()["choices"][0]["text"] == offline(demo, PROMPTS[2], max_tokens=12, temperature=0.7, seed=5)
        procs[0].send_signal(signal.SIGTERM)
        assert procs[0].wait(timeout=60) == 0  # an orderly stop under torchrun is no failure of the job
        assert procs[1].wait(timeout=30) == 0, procs[1].communicate()[1]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    err = procs[0].stderr.read()
    assert "drained and stopped" in err and "Traceback" not in err, err
