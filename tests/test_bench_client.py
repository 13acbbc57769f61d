"""`memra bench serve` against a real (tiny, fake) OpenAI-compatible server on loopback.

The fake server answers each prompt with its words reversed, cut to max_tokens words (one word = one
token), streamed or not, and exports memra's Prometheus counters. Its faults — duplicate finishes,
wrong text, dropped streams, HTTP 500s, miscounted metrics — must each be caught by the client:
a checker that cannot fail checks nothing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import threading
import time
import zlib

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, generate_latest

from memra.errors import MemraError
from memra.bench.serve_checks import check_against_offline, check_metrics, engine_time, list_models, scrape_metrics
from memra.bench.serve_client import _plan, auto_client_processes, make_prompts, run_serve_bench
from memra.bench.serve_report import RequestResult, ServeBenchConfig, ServeBenchReport
from memra.cli import main

MODEL = "fake-echo"


def echo_words(prompt: str, max_tokens: int) -> list[str]:
    return prompt.split()[::-1][:max_tokens]


def echo(prompt: str, max_tokens: int) -> str:
    """What the fake server answers (and so the 'offline' reference)."""
    return "".join(" " + w for w in echo_words(prompt, max_tokens))


# Each fault strikes its own eighth of the prompts (by a hash of the prompt, so the same requests
# whatever the arrival order), and several faults can run at once without touching the same request.
FAULT_CLASS = {"dup_finish": 0, "text_after_finish": 1, "wrong_text": 2, "http_500": 3, "drop": 4, "malformed": 5,
               "undercount": 6, "overcount_success": 7}


def fault_class(prompt: str) -> int:
    return zlib.crc32(prompt.encode()) % 8


def fake_app(faults: frozenset[str], chunk_delay: float) -> FastAPI:
    app = FastAPI()
    reg = CollectorRegistry()
    prompt_tokens = Counter("memra:prompt_tokens", "prompt tokens", registry=reg)
    gen_tokens = Counter("memra:generation_tokens", "generated tokens", registry=reg)
    success = Counter("memra:request_success", "finished requests", ["finish_reason"], registry=reg)

    @app.get("/metrics")
    def metrics():
        return PlainTextResponse(generate_latest(reg).decode())

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": MODEL, "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        prompt, max_tokens = body["prompt"], body["max_tokens"]
        on = {f for f in faults if FAULT_CLASS.get(f, fault_class(prompt)) == fault_class(prompt)}
        if "http_500" in on:
            return JSONResponse({"error": {"message": "boom", "type": "server_error"}}, status_code=500)
        words = echo_words(prompt, max_tokens)
        if "wrong_text" in on:
            words = ["WRONG", *words[1:]]
        finish = "length" if len(words) == max_tokens else "stop"
        usage = {"prompt_tokens": len(prompt.split()), "completion_tokens": len(words),
                 "total_tokens": len(prompt.split()) + len(words)}
        prompt_tokens.inc(usage["prompt_tokens"])
        count_gen = "undercount" not in on
        count_success = 2 if "overcount_success" in on else 1
        base = {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": MODEL}

        if not body.get("stream"):
            if count_gen:
                gen_tokens.inc(len(words))
            success.labels(finish_reason=finish).inc(count_success)
            choice = {"index": 0, "text": "".join(" " + w for w in words), "finish_reason": finish, "logprobs": None}
            if "drop" in on:
                choice["finish_reason"] = None
            choices = [choice, {**choice, "index": 1}] if "dup_finish" in on else [choice]
            return {**base, "choices": choices, "usage": usage}

        def event(choices, **extra) -> str:
            return "data: " + json.dumps({**base, "choices": choices, **extra}) + "\n\n"

        async def stream():
            yield ": keep-alive comment, to be ignored\n\n"
            if "slow" in on:  # not in FAULT_CLASS: strikes every request
                await asyncio.sleep(30)
            if "malformed" in on:
                yield "data: {not json\n\n"
                return
            for i, w in enumerate(words):
                await asyncio.sleep(chunk_delay)
                if count_gen:
                    gen_tokens.inc()
                last = i == len(words) - 1
                if "drop" in on and i == len(words) // 2:
                    yield "data: [DONE]\n\n"  # the stream ends, no finish_reason ever came
                    return
                if last:
                    success.labels(finish_reason=finish).inc(count_success)
                # the first chunk spells the field without the optional space, as SSE allows
                prefix = "data:" if i == 0 else "data: "
                yield prefix + json.dumps({**base, "choices": [
                    {"index": 0, "text": " " + w, "finish_reason": finish if last else None}]}) + "\n\n"
            if not words:
                success.labels(finish_reason=finish).inc(count_success)
                yield event([{"index": 0, "text": "", "finish_reason": finish}])
            if "dup_finish" in on:
                yield event([{"index": 0, "text": "", "finish_reason": finish}])
            if "text_after_finish" in on:
                yield event([{"index": 0, "text": " extra", "finish_reason": None}])
            if (body.get("stream_options") or {}).get("include_usage"):
                yield event([], usage=usage)
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


class FakeServer:
    """uvicorn on a free loopback port, in a background thread."""

    def __init__(self, *faults: str, chunk_delay: float = 0.0005):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.sock = sock
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        config = uvicorn.Config(fake_app(frozenset(faults), chunk_delay), log_level="error", lifespan="off",
                                timeout_graceful_shutdown=1)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)

    def __enter__(self) -> "FakeServer":
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "the fake server did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


CFG = ServeBenchConfig(requests=40, concurrency=8, cancel_fraction=0.25, min_prompt_words=4, max_prompt_words=40,
                       min_tokens=8, max_tokens=24, stream_fraction=0.75, seed=1, timeout_s=20.0)


def bench(server: FakeServer, cfg: ServeBenchConfig = CFG):
    before = scrape_metrics(server.url)
    report = asyncio.run(run_serve_bench(server.url, MODEL, cfg))
    return report, before, scrape_metrics(server.url)


def test_prompts_are_seeded_and_mixed():
    words = ["alpha", "beta", "gamma", "delta"]
    a, b = make_prompts(CFG, words), make_prompts(CFG, words)
    assert a == b and len(a) == CFG.requests
    assert make_prompts(ServeBenchConfig(**{**CFG.__dict__, "seed": 4}), words) != a
    lengths, budgets = [len(p.split()) for p, _ in a], [m for _, m in a]
    assert all(CFG.min_prompt_words <= n <= CFG.max_prompt_words for n in lengths) and len(set(lengths)) > 5
    assert all(CFG.min_tokens <= m <= CFG.max_tokens for m in budgets) and len(set(budgets)) > 5
    plan = _plan(CFG, a)
    assert sum(r.stream for r in plan) == 30
    cancels = [r for r in plan if r.cancel_after is not None]
    assert len(cancels) == 10 and all(r.stream and 1 <= r.cancel_after <= 5 for r in cancels)


@pytest.mark.parametrize("kwargs", [dict(requests=0), dict(concurrency=0), dict(cancel_fraction=1.5),
                                    dict(cancel_fraction=0.9, stream_fraction=0.5), dict(min_tokens=9, max_tokens=8),
                                    dict(min_prompt_words=0), dict(timeout_s=0)])
def test_config_is_validated(kwargs):
    with pytest.raises(MemraError):
        ServeBenchConfig(**kwargs)


def test_clean_server_every_request_accounted_for():
    with FakeServer() as server:
        report, before, after = bench(server)
        assert list_models(server.url + "/v1/") == [MODEL]
    assert report.lost == 0 and report.duplicated == 0 and report.errors == 0, report.table()
    assert report.completed + report.cancelled == CFG.requests
    assert report.cancelled > 0  # some planned cancellations see their finish first and complete instead
    assert {r.finish_reason for r in report.results if r.state == "completed"} == {"length", "stop"}
    assert all(1 <= r.chunks <= r.cancel_after and r.text for r in report.results if r.cancelled)
    assert check_against_offline(report, echo) == []
    assert check_metrics(before, after, report) == []
    assert report.client_completion_tokens == sum(len(echo_words(r.prompt, r.max_tokens))
                                                  for r in report.results if r.state == "completed")
    assert report.output_tokens_per_s > 0 and report.ttft_p50 is not None and report.latency_p99 is not None
    assert report.ttft_p50 <= report.ttft_p99 and report.latency_p50 <= report.latency_p99
    start, end = report.steady_window()  # the closed loop keeps every slot busy until its last requests
    assert start < end and report.steady_output_tokens_per_s > 0 and "steady" in report.table()
    summary = json.loads(json.dumps(report.to_json(per_request=True)))
    assert summary["lost"] == 0 and len(summary["results"]) == CFG.requests
    assert "lost 0" in report.table()
    # request_success is exported under two label sets (finish_reason="length" / "stop"): one sum
    assert after["memra:request_success_total"] - before.get("memra:request_success_total", 0) >= report.completed
    assert after["memra:request_success_total"] <= CFG.requests


def test_the_steady_rate_counts_only_the_span_with_every_slot_busy():
    """Concurrency 2: requests 0 and 1 start together, 2 takes 0's slot when it ends, 1 ends last. Every slot
    is busy from 0.0 to 1.0 (0's end), again from 1.0 (2's start) to 3.0 (1's end: no request follows):
    the window is 0.0 to 3.0 and only chunks inside it count, weighted by tokens per chunk."""
    def done(i, sent, ended, text_at, tokens):
        return RequestResult(index=i, prompt="p", max_tokens=8, stream=True, finish_reason="length", sent_at=sent,
                             ended_at=ended, text_at=text_at, usage={"completion_tokens": tokens, "prompt_tokens": 1})

    results = [done(0, 0.0, 1.0, [0.5, 1.0], 4), done(1, 0.0, 3.0, [1.5, 2.5], 2), done(2, 1.0, 4.0, [2.0, 3.5], 2)]
    report = ServeBenchReport(results, 4.0, ServeBenchConfig(requests=3, concurrency=2))
    assert report.steady_window() == (0.0, 3.0) and report.steady_window_s == 3.0
    assert report.steady_output_tokens_per_s == pytest.approx((4 + 2 + 1) / 3.0)  # request 2: one chunk of two in
    assert report.output_tokens_per_s == 8 / 4.0
    lonely = ServeBenchReport(results[:1], 1.0, ServeBenchConfig(requests=1, concurrency=2))  # never two in flight
    assert lonely.steady_window() is None and lonely.steady_output_tokens_per_s is None
    assert "steady" not in lonely.table() and lonely.to_json()["steady_output_tokens_per_s"] is None


def test_client_processes_share_the_load_and_every_request_comes_back_in_plan_order():
    """Three spawned client processes against one server: the same requests, in the plan's order, with
    the answers one process gets, and the server's counters moved by what the three saw together."""
    cfg = dataclasses.replace(CFG, client_processes=3)
    with FakeServer() as server:
        report, before, after = bench(server, cfg)
    assert report.lost == 0 and report.duplicated == 0 and report.errors == 0, report.table()
    assert [r.index for r in report.results] == list(range(CFG.requests))
    assert check_against_offline(report, echo) == [] and check_metrics(before, after, report) == []
    assert report.completed + report.cancelled == CFG.requests and report.wall_s > 0
    assert "(3 client processes)" in report.table()
    assert auto_client_processes(64) >= 1 and auto_client_processes(1) == 1
    with pytest.raises(MemraError, match="client_processes"):
        dataclasses.replace(CFG, client_processes=CFG.concurrency + 1)


PROTOCOL_FAULTS = ("dup_finish", "text_after_finish", "wrong_text", "http_500", "drop", "malformed")


def test_each_server_fault_is_caught_on_exactly_its_requests():
    """One run with six faults, each on its own eighth of the prompts: every faulty request is flagged
    as what it is, and no other request is flagged at all."""
    with FakeServer(*PROTOCOL_FAULTS) as server:
        report, before, after = bench(server)
    by_class: dict[int, list] = {}
    for r in report.results:
        by_class.setdefault(fault_class(r.prompt), []).append(r)
    assert all(by_class.get(c) for c in range(8)), "the seeded mix must reach every fault class"
    streamed_to_end = lambda r: r.stream and not r.cancelled

    for r in by_class[FAULT_CLASS["dup_finish"]]:  # a second finish chunk; two choices in a body
        assert bool(r.anomalies) == (not r.cancelled) and r.state in ("completed", "cancelled")
    for r in by_class[FAULT_CLASS["text_after_finish"]]:  # only streams can talk after their finish
        assert bool(r.anomalies) == streamed_to_end(r)
    for r in by_class[FAULT_CLASS["http_500"]]:
        assert r.state == "error" and r.status == 500 and "HTTP 500" in r.error
    for r in by_class[FAULT_CLASS["drop"]]:  # no finish_reason: lost, unless cancelled before the drop
        assert r.state in ("lost", "cancelled") and not r.error
    for r in by_class[FAULT_CLASS["malformed"]]:
        assert (r.state == "error" and "malformed JSON" in r.error) if r.stream else r.state == "completed"
    assert any(r.state == "lost" for r in by_class[FAULT_CLASS["drop"]])
    assert any(streamed_to_end(r) for r in by_class[FAULT_CLASS["text_after_finish"]])

    faulty = lambda *names: {r.index for n in names for r in by_class[FAULT_CLASS[n]]}
    assert {r.index for r in report.results if r.anomalies} <= faulty("dup_finish", "text_after_finish")
    assert {r.index for r in report.results if r.state == "error"} <= faulty("http_500", "malformed")
    assert {r.index for r in report.results if r.state == "lost"} <= faulty("drop")
    assert report.duplicated > 0 and report.errors > 0 and report.lost > 0

    mismatched = check_against_offline(report, echo)
    wrong = [r for r in by_class[FAULT_CLASS["wrong_text"]] if r.state in ("completed", "cancelled")]
    extra = [r for r in by_class[FAULT_CLASS["text_after_finish"]] if streamed_to_end(r)]
    assert len(mismatched) == len(wrong) + len(extra)
    assert {int(m.split("#")[1].split()[0]) for m in mismatched} == {r.index for r in wrong + extra}
    assert any(m.startswith("cancelled request") and "WRONG" in m for m in mismatched)  # a prefix is checked too
    # none of these faults touches the counters, and the bounds hold through 500s, drops and cancels
    assert check_metrics(before, after, report) == []
    assert report.completed + report.cancelled + report.errors + report.lost == CFG.requests


@pytest.mark.parametrize("fault, metric", [("undercount", "generation_tokens"),
                                           ("overcount_success", "request_success")])
def test_miscounted_metrics_are_detected(fault, metric):
    # without cancellations the bounds are exact: an over-count of one request shows
    with FakeServer(fault) as server:
        report, before, after = bench(server, ServeBenchConfig(**{**CFG.__dict__, "cancel_fraction": 0.0}))
    assert report.lost == report.errors == report.duplicated == 0 and check_against_offline(report, echo) == []
    problems = check_metrics(before, after, report)
    assert len(problems) == 1 and metric in problems[0], problems
    assert check_metrics(before, after, report, prefix="vllm:")  # a counter that is not there is a failure too


def test_timeout_is_an_error():
    cfg = ServeBenchConfig(requests=4, concurrency=4, cancel_fraction=0, stream_fraction=1.0, timeout_s=0.3)
    with FakeServer("slow") as server:
        t0 = time.perf_counter()
        report = asyncio.run(run_serve_bench(server.url, MODEL, cfg))
    assert time.perf_counter() - t0 < 5
    assert report.errors == 4 and all("timed out" in r.error for r in report.results)


def test_unreachable_server_is_errors_not_a_crash():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    report = asyncio.run(run_serve_bench(url, MODEL, ServeBenchConfig(requests=5, concurrency=2)))
    assert report.errors == 5 and report.lost == 0
    with pytest.raises(MemraError, match="cannot reach"):
        scrape_metrics(url)


def test_command_line(tmp_path, capsys):
    out = tmp_path / "report.json"
    args = ["--requests", "16", "--concurrency", "4", "--max-prompt-words", "20", "--max-tokens", "16",
            "--cancel-fraction", "0.25", "--json", str(out)]
    with FakeServer() as server:
        assert main(["bench", "serve", server.url, *args]) == 0  # model name taken from /v1/models
    saved = json.loads(out.read_text())
    assert saved["model"] == MODEL and saved["lost"] == 0 and saved["check_failures"] == []
    assert "TTFT" in capsys.readouterr().out
    with FakeServer("undercount", "http_500") as server:
        assert main(["bench", "serve", server.url, *args, "--cancel-fraction", "0"]) == 1
    printed = capsys.readouterr().out
    assert "check failed: memra:generation_tokens_total" in printed and "error       #" in printed
    assert main(["bench", "serve", server.url, "--requests", "0"]) == 2


def test_engine_time_splits_the_wall_by_step_kind():
    before = {"memra:engine_step_seconds_count{kind=decode}": 10.0, "memra:engine_step_seconds_sum{kind=decode}": 0.5}
    after = {"memra:engine_step_seconds_count{kind=decode}": 110.0, "memra:engine_step_seconds_sum{kind=decode}": 1.5,
             "memra:engine_step_seconds_count{kind=prefill}": 4.0, "memra:engine_step_seconds_sum{kind=prefill}": 0.2}
    lines = engine_time(before, after, wall_s=2.0)
    assert "100 steps" in lines[0] and "10.00 ms each" in lines[0] and "50% of wall" in lines[0]
    assert "prefill" in lines[1] and "50.00 ms each" in lines[1]
    assert "idle" in lines[-1] and "0.80 s" in lines[-1]
    assert engine_time({}, {}, 2.0) == []  # a server that does not export it: nothing to say
    after.update({"memra:kernel_compiles_total": 3.0, "memra:graph_captures_total": 9.0})
    tail = engine_time({"memra:kernel_compiles_total": 1.0, "memra:graph_captures_total": 9.0}, after, 2.0)[-2:]
    assert tail[0].endswith("kernel compiles during the run: 2") and tail[1].endswith("graph captures during the run: 0")
    after.update({"memra:decode_batch_size_count": 110.0, "memra:decode_batch_size_sum": 6060.0,
                  "memra:time_to_first_token_seconds_count": 40.0, "memra:time_to_first_token_seconds_sum": 1.0})
    before.update({"memra:decode_batch_size_count": 10.0, "memra:decode_batch_size_sum": 400.0,
                   "memra:time_to_first_token_seconds_count": 20.0, "memra:time_to_first_token_seconds_sum": 0.6})
    after.update({"memra:http_time_to_first_chunk_seconds_count": 20.0, "memra:http_time_to_first_chunk_seconds_sum": 0.5})
    rows, ttft, http = engine_time(before, after, 2.0)[-5:-2]
    assert "56.6 live rows" in rows and "20.0 ms mean" in ttft and "25.0 ms mean" in http


def test_a_launched_server_that_cannot_start_is_one_line_naming_why(tmp_path):
    """--launch runs `memra serve` as a child process; one that exits before it answers is a MemraError
    carrying the child's own one-line error, and leaves no process behind."""
    from memra.bench.serve_launch import launch_server

    with pytest.raises(MemraError, match=r"the server exited with status \d+: .*no-such-model") as err:
        launch_server(str(tmp_path / "no-such-model"), max_batch=2, max_ctx=64, device="cpu", dtype=None, api_key=None)
    assert "\n" not in str(err.value)


def test_memra_offline_batched_gives_each_answer_alone_and_refuses_where_one_differs(monkeypatch):
    """The bench's batched offline reference (memra.LLM over every request at once) equals generating each
    request alone (promise E1, what the one-at-a-time reference did), and refuses in one line when its
    cross-checked rows differ alone (the canary: an 'alone' answer made to differ)."""
    import memra
    from memra.bench.serve_checks import ALONE_CHECKS, MemraOffline

    model = memra.load("demo")
    requests = [(f"the {w} sat on a mat and", n) for w, n in (("cat", 6), ("dog", 9), ("owl", 4), ("bee", 7), ("elk", 5))]
    batched = MemraOffline(model, batched=True, max_batch=4)
    batched.prepare(requests)
    assert set(batched.answers) == set(requests)  # liveness: the batch ran and answered every request
    alone = MemraOffline(model)
    assert [batched(*r) for r in requests] == [alone(*r) for r in requests]
    canary = MemraOffline(model, batched=True)
    monkeypatch.setattr(canary, "alone", lambda prompt, max_tokens: "never this")
    with pytest.raises(MemraError, match="not batch-invariant"):
        canary.prepare(requests[:ALONE_CHECKS])
