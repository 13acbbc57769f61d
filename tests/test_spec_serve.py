"""Speculative decoding in the server (promise E4 under load): a real server on loopback started with
speculation (MTP, n-gram) answers every request — greedy, seeded sampled, with penalties, with logprobs —
with the very JSON the plain server gives it, tokens and logprob floats alike, at concurrency 1, 8 and 32.
Also: a stream, the per-request opt-out, its refusal on a plain server, /metrics, memra.LLM(speculative=), the
scheduler's accounting for the extra positions, preemption while speculating, and the canary (a
verify that forgets its rollback) that the comparison must catch."""

from __future__ import annotations

import concurrent.futures as cf
import json

import httpx
import pytest

import memra
from conftest import hf_dir
from memra.engine.engine import Engine, EngineConfig
from memra.engine.scheduler import Scheduler, SchedulerConfig
from memra.errors import MemraError
from memra.sampling import SamplingParams
from memra.server.api import build_app
from memra.server.http import ServerThread
from memra.server.metrics import Metrics
from memra.spec import SpecConfig

ROMEO = ("ROMEO:\nBut soft, what light through yonder window breaks? It is the east, and Juliet is the sun.\n"
         "ROMEO:\nBut soft, what light")
PROMPTS = [ROMEO, "JULIET:\nO Romeo, Romeo, wherefore art thou Romeo?", "KING LEAR:\nBlow, winds, and crack your cheeks!",
           "First Citizen:\nBefore we proceed any further, hear me speak.\nAll:\nSpeak, speak.\nFirst Citizen:\n",
           "HAMLET:\nTo be, or not to be", "MENENIUS:\nWhat work's, my countrymen, in hand?"]


def _body(i: int) -> tuple[str, dict]:
    """The i-th request of the mix: greedy / seeded sampled / penalized / chat, most with logprobs."""
    p, n = PROMPTS[i % len(PROMPTS)], 6 + i % 5
    kind = i % 4
    if kind == 0:
        return "/v1/completions", {"prompt": p, "max_tokens": n, "temperature": 0, "logprobs": 2}
    if kind == 1:
        return "/v1/completions", {"prompt": p, "max_tokens": n, "temperature": 0.8, "top_p": 0.9, "seed": i,
                                   "logprobs": 1}
    if kind == 2:
        return "/v1/completions", {"prompt": p, "max_tokens": n, "temperature": 0, "repetition_penalty": 1.2,
                                   "presence_penalty": 0.3, "n": 2}
    return "/v1/chat/completions", {"messages": [{"role": "user", "content": p}], "max_tokens": n, "temperature": 1.0,
                                    "top_k": 40, "seed": i, "logprobs": True, "top_logprobs": 2}


BODIES = [_body(i) for i in range(32)]


@pytest.fixture(scope="module")
def demo():
    return memra.load("demo")


def _server(model, spec: SpecConfig | None, **cfg):
    metrics = Metrics("demo")
    engine = Engine(model, EngineConfig(**{"max_batch": 32, "max_ctx": 256, "speculative": spec, **cfg}), metrics)
    return ServerThread(build_app(engine, "demo", metrics=metrics)).start()


def _answers(url: str, bodies, concurrency: int, **extra) -> list[dict]:
    """Each body's answer as JSON (its choices and usage: the fields that must not change)."""
    def ask(item):
        route, body = item
        r = httpx.post(url + route, json={**body, **extra}, timeout=300)
        assert r.status_code == 200, r.text
        j = r.json()  # cached_tokens says what the prefix cache held when it came, not what the answer is
        return {"choices": j["choices"], "usage": {k: v for k, v in j["usage"].items() if k != "prompt_tokens_details"}}

    with cf.ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(ask, bodies))


def _scrape(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in fam.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


@pytest.fixture(scope="module")
def reference(demo):
    """The plain server's answers (E1 makes them independent of the load they meet)."""
    srv = _server(demo, None)
    try:
        yield _answers(srv.url, BODIES, 8)
    finally:
        srv.stop()


def _mismatches(want: list[dict], got: list[dict]) -> list[int]:
    return [i for i, (a, b) in enumerate(zip(want, got)) if a != b]


@pytest.mark.parametrize("spec", [SpecConfig("mtp", k=3), SpecConfig("ngram", k=4, dynamic_k=True)],
                         ids=["mtp-k3", "ngram-k4-dynamic"])
def test_speculating_server_answers_bit_for_bit_at_concurrency_1_8_32(demo, reference, spec):
    srv = _server(demo, spec)
    try:
        before = _scrape(srv.url)
        levels = [(1, 8), (8, 32), (32, 32)] if spec.method == "mtp" else [(8, 32)]
        for concurrency, count in levels:
            got = _answers(srv.url, BODIES[:count], concurrency)
            assert not _mismatches(reference[:count], got), f"concurrency {concurrency}: answers differ"
        after = _scrape(srv.url)
    finally:
        srv.stop()
    moved = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    # liveness: the answers came through verifies that carried drafts, some of them accepted
    assert moved["memra:spec_decode_num_drafts_total"] > 0
    assert moved["memra:spec_decode_num_draft_tokens_total"] >= moved["memra:spec_decode_num_drafts_total"]
    assert moved["memra:spec_decode_num_accepted_tokens_total"] > 0
    assert moved["memra:spec_decode_num_verifies_total"] > 0
    if spec.method == "mtp":  # every MTP row verifies each step: at concurrency 8 and 32 they share forwards
        assert moved["memra:spec_verify_batch_rows_total"] > 0
        assert moved["memra:spec_verify_forwards_total"] < moved["memra:spec_decode_num_verifies_total"]


def test_a_request_opts_out_and_a_plain_server_refuses_the_opt_in(demo, reference):
    srv = _server(demo, SpecConfig("mtp", k=2))
    try:
        before = _scrape(srv.url)
        assert _answers(srv.url, BODIES[:4], 4, speculative=False) == reference[:4]
        after = _scrape(srv.url)
        assert after["memra:spec_decode_num_verifies_total"] == before["memra:spec_decode_num_verifies_total"]
        assert after["memra:generation_tokens_total"] > before["memra:generation_tokens_total"]
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2, "speculative": "no"})
        assert r.status_code == 400 and "speculative" in r.json()["error"]["message"]
    finally:
        srv.stop()
    plain = _server(demo, None)
    try:
        r = httpx.post(plain.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2, "speculative": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "speculative"
        assert "--speculative" in r.json()["error"]["message"]
        ok = httpx.post(plain.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2, "speculative": False})
        assert ok.status_code == 200
    finally:
        plain.stop()


def _outputs(llm, prompts, params):
    return [[(c.token_ids, c.logprobs, c.top_logprobs, c.finish_reason, c.text) for c in r.outputs]
            for r in llm.generate(prompts, params)]


PARAMS = [SamplingParams(temperature=0.0, max_tokens=14, logprobs=2, stop=("\n\n",)),
          SamplingParams(max_tokens=12, temperature=0.9, seed=5, n=2, frequency_penalty=0.5, logprobs=0),
          SamplingParams(max_tokens=10, temperature=0.7, top_k=30, seed=9, logit_bias={13: 3.0})]


def test_llm_speculative_equals_plain_and_preemption_keeps_it(demo):
    prompts = PROMPTS[:3]
    plain = _outputs(memra.LLM(demo, max_batch=4, max_ctx=128, warm_up=False), prompts, PARAMS)
    for spec in ("mtp", SpecConfig("ngram", k=2, rollback="replay")):
        assert _outputs(memra.LLM(demo, max_batch=4, max_ctx=128, warm_up=False, speculative=spec), prompts,
                        PARAMS) == plain, spec
    # a pool too small for every sequence at once: speculating sequences are swapped out and back
    long = [SamplingParams(temperature=0.0, max_tokens=40), SamplingParams(max_tokens=40, temperature=0.8, seed=2)] * 2
    plain = _outputs(memra.LLM(demo, max_batch=4, max_ctx=128, warm_up=False), PROMPTS[:4], long)
    llm = memra.LLM(demo, max_batch=4, max_ctx=128, warm_up=False)
    llm.engine = Engine(demo, EngineConfig(max_batch=4, max_ctx=128, kv_blocks=8, max_waiting=64,
                                           speculative=SpecConfig("mtp", k=4)), Metrics("demo"))
    assert _outputs(llm, PROMPTS[:4], long) == plain
    assert llm.engine.metrics.preemptions._value.get() > 0  # liveness: the swaps happened


def test_canary_a_verify_that_forgets_its_rollback_is_caught(demo, monkeypatch):
    """The comparison above must be able to fail: with the rejected suffix left in the cache, the answers
    change (and the same comparison reports it)."""
    prompts = PROMPTS[:3]
    plain = _outputs(memra.LLM(demo, max_batch=4, max_ctx=128, warm_up=False), prompts, PARAMS)
    import memra.engine.speculation as speculation

    monkeypatch.setattr(speculation, "drop_rejected", lambda *a: None)
    monkeypatch.setattr(speculation, "_trim", lambda c: None)
    broken = _outputs(memra.LLM(demo, max_batch=4, max_ctx=128, warm_up=False, speculative="mtp"), prompts, PARAMS)
    assert broken != plain


def test_scheduler_grants_extra_positions_within_the_free_blocks():
    s = Scheduler(SchedulerConfig(max_running=2, token_budget=64, prefill_align=16, block_size=4, total_blocks=6))
    s.add("a", 4, 10)
    plan = s.schedule()
    s.step_done({"a": 4}, ["a"], [])  # prefilled (1 block), first token sampled
    plan = s.schedule()
    assert plan.decode == ["a"] and s.free_blocks() == 4  # the decode's position opened block 2
    assert s.reserve_extra("a", 20) == 8  # max_tokens 10: 1 sampled, this step's 1, then at most 8 more
    assert s.free_blocks() == 2
    with pytest.raises(ValueError, match="extra"):
        s.step_done({}, ["a"], [], {"a": 9})  # more than granted: refused before anything changes
    assert s.step_done({}, ["a"], [], {"a": 2}) == []  # kept 3 tokens: in_cache 4 + 3 = 7 -> 2 blocks
    assert s.get("a").generated == 4 and s.get("a").blocks == 2 and s.free_blocks() == 4
    with pytest.raises(ValueError, match="plan in flight"):
        s.reserve_extra("a", 1)


def test_a_speculating_stream_equals_the_plain_answer(demo, reference):
    srv = _server(demo, SpecConfig("mtp", k=3))
    try:
        for i in (0, 1):  # greedy and seeded, with logprobs
            route, body = BODIES[i]
            with httpx.stream("POST", srv.url + route, json={**body, "stream": True}, timeout=300) as r:
                chunks = [line[6:] for line in r.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
            parts = [json.loads(c)["choices"][0] for c in chunks]
            assert "".join(p["text"] for p in parts) == reference[i]["choices"][0]["text"]
            got = [x for p in parts for x in p["logprobs"]["token_logprobs"]]
            assert got == reference[i]["choices"][0]["logprobs"]["token_logprobs"]
    finally:
        srv.stop()


def test_an_engine_refuses_speculation_it_cannot_run(demo, load_model):
    with pytest.raises(MemraError, match="no MTP block; use --speculative ngram"):
        Engine(load_model(hf_dir("llama")), EngineConfig(max_batch=2, max_ctx=64, speculative=SpecConfig("mtp")))
    with pytest.raises(MemraError, match="no verify body"):
        Engine(demo.with_doors(MEMRA_DECODE_PLAN="bucket"),
               EngineConfig(max_batch=2, max_ctx=64, speculative=SpecConfig("ngram")))
