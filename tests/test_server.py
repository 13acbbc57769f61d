"""The OpenAI-compatible server, for real: uvicorn on loopback with the demo model, the official
`openai` client for the happy paths, raw HTTP for the error cases. Greedy answers must equal offline
`generate_tokens`, seeded sampled answers must not depend on what else runs, and preemption (swap
to host and back) must not change a single token."""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time

import httpx
import pytest

openai = pytest.importorskip("openai")

import memra  # noqa: E402
from memra.generate import generate_tokens  # noqa: E402
from memra.sampling import SamplingParams  # noqa: E402
from memra.server.api import INLINE_ENCODE_CHARS, build_app  # noqa: E402
from memra.server.http import ServerThread  # noqa: E402
from memra.server.options import ServerOptions  # noqa: E402
from memra.engine.engine import Engine, EngineConfig  # noqa: E402
from memra.server.metrics import Metrics  # noqa: E402

KEY = "sk-memra-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPTS = ["ROMEO:", "JULIET:\nO Romeo, Romeo,", "First Citizen:\nBefore we proceed any further, hear me speak.",
           "KING LEAR:\nBlow, winds,"]


@pytest.fixture(scope="module")
def demo():
    return memra.load("demo")


def _server(model, api_key=KEY, **cfg):
    metrics = Metrics("demo")
    engine = Engine(model, EngineConfig(**{"max_batch": 4, "max_ctx": 512, **cfg}), metrics)
    return ServerThread(build_app(engine, "demo", ServerOptions(api_key=api_key), metrics=metrics)).start(), engine


@pytest.fixture(scope="module")
def server(demo):
    srv, engine = _server(demo)
    yield srv, engine
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0].url + "/v1", api_key=KEY, max_retries=0)


def _text(model, events) -> str:
    """The text of one sequence's engine events (the engine sends token ids; readers make the text)."""
    return model.tokenizer.decode([e.token_id for e in events if e.token_id is not None], skip_special=True)


def offline(model, prompt: str, **params) -> str:
    ids = model.tokenizer.encode(prompt, add_special=True)
    p = SamplingParams(**{"temperature": 0.0, **params})  # greedy unless told
    return model.tokenizer.decode(list(generate_tokens(model, ids, p, eos_ids=model.tokenizer.eos_ids)), skip_special=True)


def test_concurrent_greedy_completions_equal_offline(demo, client):
    with cf.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(client.completions.create, model="demo", prompt=p, max_tokens=24 + 8 * i, temperature=0)
                   for i, p in enumerate(PROMPTS * 2)]
        answers = [f.result() for f in futures]
    for i, (p, r) in enumerate(zip(PROMPTS * 2, answers)):
        assert r.choices[0].text == offline(demo, p, max_tokens=24 + 8 * i), p
        assert r.choices[0].finish_reason == "length"
        assert r.usage.completion_tokens == 24 + 8 * i
        assert r.usage.prompt_tokens == len(demo.tokenizer.encode(p, add_special=True))


def test_streaming_equals_non_streaming_and_reports_usage(client):
    whole = client.completions.create(model="demo", prompt=PROMPTS[1], max_tokens=30, temperature=0)
    stream = client.completions.create(model="demo", prompt=PROMPTS[1], max_tokens=30, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    parts, finishes, usage = [], [], None
    for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].text)
            finishes.append(chunk.choices[0].finish_reason)
        else:
            usage = chunk.usage
    assert "".join(parts) == whole.choices[0].text
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert usage.completion_tokens == 30 and usage.total_tokens == usage.prompt_tokens + 30


def test_chat_stream_and_stop_strings(demo, client):
    msgs = [{"role": "user", "content": "Speak, fair lady."}]
    whole = client.chat.completions.create(model="demo", messages=msgs, max_tokens=40, temperature=0)
    text = whole.choices[0].message.content
    assert whole.choices[0].message.role == "assistant" and text
    stream = client.chat.completions.create(model="demo", messages=msgs, max_tokens=40, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    stop = text.strip()[3:6]
    stopped = client.chat.completions.create(model="demo", messages=msgs, max_tokens=40, temperature=0, stop=[stop])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].message.content == text[: text.index(stop)]


def test_seeded_choices_are_reproducible_and_independent_of_load(demo, client):
    def ask():
        return client.completions.create(model="demo", prompt=PROMPTS[2], max_tokens=20, temperature=0.9, top_p=0.95,
                                         seed=11, n=2)

    alone = ask()
    with cf.ThreadPoolExecutor(6) as pool:  # the same request again, among other traffic
        noise = [pool.submit(client.completions.create, model="demo", prompt=p, max_tokens=30, temperature=0.7, seed=i)
                 for i, p in enumerate(PROMPTS)]
        busy = pool.submit(ask).result()
        [f.result() for f in noise]
    for i in range(2):
        assert busy.choices[i].text == alone.choices[i].text
        assert alone.choices[i].text == offline(demo, PROMPTS[2], max_tokens=20, temperature=0.9, top_p=0.95, seed=11 + i)
    assert alone.choices[0].text != alone.choices[1].text


def test_logprobs(client):
    r = client.completions.create(model="demo", prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == len(lp.tokens) == 6
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and len(top) <= 3 and max(top.values()) == pytest.approx(chosen)  # greedy: the best one
    c = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Hail"}], max_tokens=4,
                                       temperature=0, logprobs=True, top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 2 for t in content)


def test_models_tokenize_detokenize_health(demo, server):
    srv, _ = server
    auth = {"Authorization": f"Bearer {KEY}"}
    models = httpx.get(srv.url + "/v1/models", headers=auth).json()
    assert models["data"][0]["id"] == "demo" and models["data"][0]["max_model_len"] == 512
    tok = httpx.post(srv.url + "/tokenize", json={"prompt": "ROMEO:"}, headers=auth).json()
    assert tok["tokens"] == demo.tokenizer.encode("ROMEO:", add_special=True) and tok["count"] == len(tok["tokens"])
    text = httpx.post(srv.url + "/detokenize", json={"tokens": tok["tokens"]}, headers=auth).json()["prompt"]
    assert "ROMEO:" in text
    assert httpx.get(srv.url + "/health").status_code == 200  # no key needed for probes


BAD = [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "JSON object"),
    ({"prompt": "x", "max_tokens": "5"}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": -3}, "max_tokens"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "stop": ["a"] * 17}, "stop"),
    ({"prompt": "x", "stop": [1, 2]}, "stop"),
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"5": 500}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"999999": 1}}, "logit_bias"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "echo": True, "stream": True}, "echo"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, 99999999]}, "vocabulary"),
    ({"prompt": "word " * 600, "max_tokens": 8}, "maximum context length"),
    ({"prompt": "x", "max_tokens": 600}, "maximum context length"),
    ({"max_tokens": 5}, "prompt"),
]


@pytest.mark.parametrize("body,needle", BAD)
def test_bad_requests_get_400_with_an_openai_error(server, body, needle):
    srv, engine = server
    before = engine.steps
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(srv.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}",
                                                          "Content-Type": "application/json"}, **kw)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and needle in err["message"] + str(err["param"]), err
    assert "Traceback" not in r.text
    assert engine.steps == before  # refused before anything ran


def test_bad_chat_bodies(server):
    srv, _ = server
    h = {"Authorization": f"Bearer {KEY}"}
    for body in ({"messages": []}, {"messages": [{"role": "wizard", "content": "x"}]}, {"messages": "hi"},
                 {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}):
        r = httpx.post(srv.url + "/v1/chat/completions", json=body, headers=h)
        assert r.status_code == 400 and "error" in r.json(), body


def test_api_key(server):
    srv, _ = server
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def test_client_disconnect_cancels_the_request(server):
    srv, engine = server
    with httpx.stream("POST", srv.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"prompt": PROMPTS[3], "max_tokens": 400, "temperature": 0, "stream": True}) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
    assert any(line.startswith("data: ") for line in got)
    deadline = time.monotonic() + 20
    while (engine.seqs or engine.scheduler.num_running()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not engine.seqs and engine.scheduler.num_running() == 0 and engine.scheduler.kv_usage == 0.0


def test_metrics_match_the_traffic(server):
    srv, engine = server
    assert httpx.get(srv.url + "/metrics").status_code == 401  # the counters describe the traffic: key needed
    text = httpx.get(srv.url + "/metrics", headers=AUTH).text
    for name in ("memra:num_requests_running", "memra:num_requests_waiting", "memra:prompt_tokens_total",
                 "memra:generation_tokens_total", "memra:time_to_first_token_seconds_bucket",
                 "memra:http_time_to_first_chunk_seconds_bucket",
                 "memra:inter_token_latency_seconds_bucket", "memra:kv_cache_usage_perc", "memra:decode_batch_size_bucket",
                 "memra:request_success_total", "memra:pp_split_walks_total", "memra:pp_peer_probes_total",
                 "memra:pp_peer_runtime_probes_total", "memra:spec_verify_forwards_total"):
        assert name in text, name
    before = _scrape(srv.url)
    r = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY).completions.create(
        model="demo", prompt=PROMPTS[0], max_tokens=9, temperature=0)
    after = _scrape(srv.url)
    assert after["memra:generation_tokens_total"] - before["memra:generation_tokens_total"] == 9
    assert after["memra:prompt_tokens_total"] - before["memra:prompt_tokens_total"] == r.usage.prompt_tokens
    assert after["memra:time_to_first_token_seconds_count"] - before["memra:time_to_first_token_seconds_count"] == 1
    # the engine's steps, timed: one prefill of the prompt, then the 8 decode steps that produce tokens 2..9
    steps = after["memra:engine_step_seconds_count"] - before.get("memra:engine_step_seconds_count", 0.0)
    assert steps == 9 and after["memra:engine_step_seconds_sum"] > before.get("memra:engine_step_seconds_sum", 0.0)
    # the HTTP side's first-token wait counts streams only, once each, and holds the engine's inside it
    http = "memra:http_time_to_first_chunk_seconds_"
    assert after.get(http + "count", 0.0) == before.get(http + "count", 0.0)
    engine_wait = after["memra:time_to_first_token_seconds_sum"]
    stream = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY).completions.create(
        model="demo", prompt=PROMPTS[1], max_tokens=5, temperature=0, stream=True)
    assert len([c for c in stream if c.choices and c.choices[0].text]) >= 1
    last = _scrape(srv.url)
    assert last[http + "count"] - after.get(http + "count", 0.0) == 1
    assert last[http + "sum"] - after.get(http + "sum", 0.0) >= last["memra:time_to_first_token_seconds_sum"] - engine_wait


def _scrape(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", headers=AUTH).text):
        for s in fam.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def test_overload_gets_429_not_an_unbounded_queue(demo):
    srv, engine = _server(demo, api_key=None, max_batch=1, max_waiting=1)
    try:
        def ask(i):
            return httpx.post(srv.url + "/v1/completions", json={"prompt": PROMPTS[i % 4], "max_tokens": 48,
                                                                 "temperature": 0}, timeout=120)
        with cf.ThreadPoolExecutor(6) as pool:
            codes = [r.status_code for r in pool.map(ask, range(6))]
        assert 429 in codes and 200 in codes and set(codes) <= {200, 429}, codes
    finally:
        srv.stop()


def test_preemption_swaps_state_out_and_back_without_changing_a_token(demo):
    """A KV pool too small for the running set forces swaps; every answer still equals offline."""
    engine = Engine(demo, EngineConfig(max_batch=4, max_ctx=128, kv_blocks=14, token_budget=128), Metrics("demo")).start()
    try:
        done, results = threading.Event(), {}
        lock = threading.Lock()

        def sink_for(i):
            def sink(ev):
                with lock:
                    results.setdefault(i, []).append(ev)
                    if sum(1 for evs in results.values() for e in evs if e.finish_reason) == len(PROMPTS):
                        done.set()
            return sink

        for i, p in enumerate(PROMPTS):
            engine.submit(demo.tokenizer.encode(p, add_special=True), SamplingParams(temperature=0.0, max_tokens=60), sink_for(i),
                          eos_ids=demo.tokenizer.eos_ids)
        assert done.wait(300)
        assert engine.metrics.preemptions._value.get() > 0  # the pool really was too small
        for i, p in enumerate(PROMPTS):
            assert _text(demo, results[i]) == offline(demo, p, max_tokens=60), p
            assert results[i][-1].finish_reason in ("length", "stop") and results[i][-1].error is None
    finally:
        engine.shutdown()


def test_graceful_shutdown_drains_in_flight_requests(demo):
    srv, engine = _server(demo, api_key=None)
    url = srv.url
    with cf.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(httpx.post, url + "/v1/completions",
                          json={"prompt": PROMPTS[1], "max_tokens": 80, "temperature": 0}, timeout=120)
        deadline = time.monotonic() + 30
        while not engine.seqs and time.monotonic() < deadline:
            time.sleep(0.01)
        srv.stop()  # what SIGTERM does: stop accepting, finish what is in flight
        r = fut.result()
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    assert r.json()["choices"][0]["text"] == offline(demo, PROMPTS[1], max_tokens=80)
    with pytest.raises(httpx.HTTPError):
        httpx.post(url + "/v1/completions", json={"prompt": "x"}, timeout=5)


def test_memra_serve_command_answers_and_exits_cleanly_on_sigterm():
    """The CLI entry point end to end: `memra serve` on a free port, one request, SIGTERM -> exit 0."""
    import os
    import signal
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "memra", "serve", "demo", "--port", str(port), "--max-batch", "2",
                             "--max-ctx", "256", "--api-key", KEY], stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() is not None else "no start"
            time.sleep(0.2)
        r = httpx.post(url + "/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 5, "temperature": 0},
                       headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal after a clean shutdown
    finally:
        if proc.poll() is None:
            proc.kill()
    err = proc.stderr.read()
    assert "Traceback" not in err and "drained and stopped" in err, err
    bad = subprocess.run([sys.executable, "-m", "memra", "serve", "demo", "--port", "0"], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "--port must be" in bad.stderr


def test_engine_serves_through_the_pipeline_split(demo):
    """With the PP door open the engine's pools are stage-owned and every step walks the split;
    answers still equal offline generation with the door shut."""
    from memra import counters

    want = [offline(demo, p, max_tokens=12) for p in PROMPTS[:2]]
    engine = Engine(demo.with_doors(MEMRA_PP_STAGES="2"), EngineConfig(max_batch=2, max_ctx=128), Metrics("demo"))
    assert engine.rt is not None
    before = counters.snapshot()
    engine.start()
    try:
        done, got = threading.Event(), {0: [], 1: []}

        def sink_for(i):
            def sink(ev):
                got[i].append(ev)
                if all(evs and evs[-1].finish_reason for evs in got.values()):
                    done.set()
            return sink

        for i, p in enumerate(PROMPTS[:2]):
            engine.submit(demo.tokenizer.encode(p, add_special=True), SamplingParams(temperature=0.0, max_tokens=12), sink_for(i),
                          eos_ids=demo.tokenizer.eos_ids)
        assert done.wait(120)
    finally:
        engine.shutdown()
    assert [_text(demo, got[i]) for i in range(2)] == want
    assert counters.delta(before)["pp_split_walks"] > 0


def test_a_short_prompt_is_encoded_on_the_loop_and_a_long_one_on_the_pool(demo, server):
    """A prompt of at most INLINE_ENCODE_CHARS characters is encoded on the event loop's thread (faster than
    the hand-off to the pool), a longer one on the tokenizer pool; the ids are the tokenizer's either way."""
    srv = server[0]
    tok, threads = demo.tokenizer, []
    encode = tok.encode

    def watched(text, *args, **kwargs):  # the real encode, noting the thread it ran on
        threads.append(threading.current_thread().name)
        return encode(text, *args, **kwargs)

    short, long = "ROMEO: " * 10, "ROMEO: " * (INLINE_ENCODE_CHARS // 7 + 1)
    tok.encode = watched
    try:
        answers = [httpx.post(srv.url + "/tokenize", json={"prompt": p}, headers=AUTH).json() for p in (short, long)]
    finally:
        del tok.encode
    assert [a["tokens"] for a in answers] == [encode(short, True), encode(long, True)]
    assert threads == [srv.thread.name, threads[1]] and threads[1].startswith("memra-tokenize")
