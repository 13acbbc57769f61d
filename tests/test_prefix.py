"""Prefix caching (memra.prefix, promise E8): a request served from the cache returns the tokens and
logprobs of a cold engine, bit for bit — on attention-only models and on GDN hybrids, at several cuts,
B=1..N, greedy and seeded, under load with evictions; n > 1 and shared prompts prime once; the server
reports cached tokens and a hit rate."""

from __future__ import annotations

import httpx
import openai
import pytest

import memra
from conftest import DEVICE, HF_ARCHS, gguf_file, hf_dir
from memra import counters
from memra.engine.engine import Engine
from memra.engine.scheduler import Scheduler, SchedulerConfig
from memra.engine.types import EngineConfig
from memra.gate.prefix_battery import _tokens, run_prefix_battery, run_requests
from memra.prefix.serving import snapshot_stops
from memra.prefix.tree import PAGE, PrefixTree
from memra.sampling import SamplingParams
from memra.server.api import build_app
from memra.server.http import ServerThread
from memra.server.metrics import Metrics
from memra.server.options import ServerOptions


@pytest.fixture(scope="module")
def demo():
    return memra.load("demo", device=DEVICE)


# --- the parts, without a model ---
def test_tree_matches_whole_pages_and_evicts_the_least_recently_used_leaf():
    t = PrefixTree()
    a = t.insert(t.root, (1,) * PAGE, (0, 1, 2, 3))
    b = t.insert(a, (2,) * PAGE, (4, 5, 6, 7))
    c = t.insert(t.root, (3,) * PAGE, (8, 9, 10, 11))
    assert t.match([(1,) * PAGE, (2,) * PAGE, (9,) * PAGE]) == [a, b]
    assert t.match([(1,) * PAGE, (3,) * PAGE]) == [a]
    t.touch(b)  # a and b are now newer than c; b is older than its parent a
    dropped = []
    assert t.evict(8, lambda n: len(n.blocks), dropped.append) == 8
    assert dropped == [c, b] and not c.alive and t.match([(1,) * PAGE, (2,) * PAGE]) == [a]


def test_snapshot_policy():
    assert snapshot_stops(300, 0, 0, 192) == {192, 256}  # spacing and the last aligned cut
    assert snapshot_stops(300, 64, 128, 192) == {128, 192, 256}  # the branch too, all after the cut
    assert snapshot_stops(50, 0, 0, 192) == set()


def test_scheduler_starts_a_cached_request_at_its_cut_and_stops_chunks_at_stops():
    s = Scheduler(SchedulerConfig(max_running=4, token_budget=512, total_blocks=100, total_slots=4))
    s.add("a", 300, 4)
    s.add("b", 300, 4)
    assert s.waiting_head() == ["a", "b"]
    s.set_cached("a", 128, (192, 256), held=False)
    s.set_cached("b", 0, (), held=True)  # held: it and everyone behind it wait
    plan = s.schedule()
    assert plan.prefill == [("a", 128, 64)]
    with pytest.raises(ValueError):
        s.set_cached("a", 64, (), held=False)  # running now
    with pytest.raises(ValueError):
        s.set_cached("b", 100, (), held=False)  # not an aligned cut


def test_copy_on_write_and_refcounts(demo):
    engine = Engine(demo, EngineConfig(max_batch=2, max_ctx=256))
    kv = engine.backend.kv
    c = engine.backend.new_cache(256)
    c.reserve(64)
    c.pos = 64
    kv.share(c.blocks)  # as the prefix cache holds a page
    c.shared = len(c.blocks)
    held = list(c.blocks)
    before = kv.k[kv.layers[0]][held[2]].clone()
    c.writable_from(40)  # block 2 (positions 32..47) on are written again: they become private copies
    assert c.blocks[:2] == held[:2] and c.blocks[2:] != held[2:] and c.shared == 2
    assert all(kv.holders(b) == 1 for b in held[2:])  # the cache's hold is what is left of them
    assert kv.k[kv.layers[0]][c.blocks[2]].equal(before)
    c.free()
    assert all(b not in kv.free for b in held) and all(kv.holders(b) == 1 for b in held)


# --- the battery: every fixture architecture and the demo ---
LOAD_ARCHS = ("demo", "llama", "qwen3_5_moe", "step3p5")
@pytest.mark.parametrize("arch", ["demo"] + HF_ARCHS + ["gguf:qwen3_5-q8_0"])
def test_prefix_gate_is_green(arch, demo):
    path = gguf_file(arch[5:]) if arch.startswith("gguf:") else hf_dir(arch)
    model = demo if arch == "demo" else memra.load(path, device=DEVICE, tokenizer=False)
    lines = []
    load = arch in LOAD_ARCHS  # the load arm (memra.gate.prefix_load_arm) on one model of each kind: seconds each
    assert run_prefix_battery(model, batches=(1, 2, 4), steps=6, out=lines.append, load=load), "\n".join(lines)
    assert load == any(line.startswith("prefix-load") for line in lines)


@pytest.mark.parametrize("arch", ["demo", "llama"])
def test_prefix_gate_canary_fails(arch, demo):
    model = demo if arch == "demo" else memra.load(hf_dir(arch), device=DEVICE, tokenizer=False)
    lines = []
    assert not run_prefix_battery(model, batches=(1, 2), steps=6, out=lines.append, canary=True)
    assert any("BIT-DIFF" in line or "DIVERGED" in line for line in lines), "\n".join(lines)


def test_under_load_with_evictions_every_answer_equals_cold(demo):
    """More distinct prefixes than the pool holds, four requests at a time: pages are evicted (and
    sequences preempted) while requests resume from the ones left, and every answer is the cold engine's."""
    vocab, reqs = demo.cfg.vocab_size, []
    bases = [_tokens(200, 50 + k, vocab) for k in range(8)]
    for r in range(3):
        for k, base in (reversed if r % 2 else list)(list(enumerate(bases))):  # LRU's worst case is a cycle
            tail = _tokens(3 + r, 100 * r + k, vocab)
            p = SamplingParams(temperature=0.0, max_tokens=5, logprobs=1) if k % 2 else \
                SamplingParams(max_tokens=5, temperature=0.9, seed=k + r, logprobs=1)
            reqs.append((base[: 130 + 20 * r] + tail, p))
    cfg = dict(max_batch=4, max_ctx=256, token_budget=256, kv_blocks=48)
    cold = Engine(demo, EngineConfig(prefix_caching=False, **cfg))
    want = [g[:3] for i in range(0, len(reqs), 4) for g in run_requests(cold, reqs[i : i + 4])]
    warm = Engine(demo, EngineConfig(**cfg))
    before = counters.snapshot()
    got = [g for i in range(0, len(reqs), 4) for g in run_requests(warm, reqs[i : i + 4])]
    live = counters.delta(before)
    assert [g[:3] for g in got] == want
    assert sum(g[3] for g in got) > 0 and live["prefix_evicted_blocks"] > 0


# --- n > 1 and shared prompts prime the shared prefix once ---
def test_choices_and_shared_prompts_prime_once_with_unchanged_tokens(demo):
    vocab = demo.cfg.vocab_size
    prompt, fresh = _tokens(300, 3, vocab), _tokens(100, 4, vocab)
    runs = {}
    for on in (False, True):
        llm = memra.LLM(demo, max_batch=8, max_ctx=512, warm_up=False, enable_prefix_caching=on)
        got, live = [], []
        for prompts, params in [([prompt], SamplingParams(max_tokens=6, temperature=0.9, seed=3, n=4, logprobs=1)),
                                ([prompt[:200] + [i] for i in range(4)], SamplingParams(temperature=0.0, max_tokens=6, logprobs=1)),
                                ([fresh] * 4, SamplingParams(max_tokens=6, temperature=0.7, seed=9, logprobs=1)),
                                ([prompt[:5]], SamplingParams(max_tokens=6, temperature=0.9, seed=1, n=3, logprobs=1))]:
            before = counters.snapshot()
            outs = llm.generate(prompts, params)
            live.append(counters.delta(before))
            got.append([(c.token_ids, c.logprobs) for o in outs for c in o.outputs])
        runs[on] = got, live
    assert runs[True][0] == runs[False][0]  # every choice's tokens and logprobs, bit for bit
    off, on = runs[False][1], runs[True][1]
    # n = 4 choices of a 300-token prompt: one prime (5 pieces), then 3 forks
    assert (off[0]["prime_pieces"], on[0]["prime_pieces"], on[0]["prefix_forks"]) == (20, 5, 3)
    assert on[0]["prefix_cached_tokens"] == 3 * 300
    # four prompts sharing 200 tokens: each resumes at 192 (pages and a snapshot the first call left)
    assert (off[1]["prime_pieces"], on[1]["prime_pieces"], on[1]["prefix_cached_tokens"]) == (16, 4, 4 * 192)
    # the same new prompt four times (GRPO-style): primed once, forked three times
    assert (off[2]["prime_pieces"], on[2]["prime_pieces"], on[2]["prefix_forks"]) == (8, 2, 3)
    # n = 3 on a 5-token prompt: one prime of less than a page
    assert (off[3]["prime_pieces"], on[3]["prime_pieces"], on[3]["prefix_forks"]) == (3, 1, 2)


# --- the server: cached tokens in the usage, a hit rate in /metrics, --no-prefix-caching ---
def test_server_reports_cached_tokens_and_a_hit_rate(demo):
    prompt = _tokens(300, 9, demo.cfg.vocab_size)
    answers = {}
    for on in (False, True):
        metrics = Metrics("demo")
        engine = Engine(demo, EngineConfig(max_batch=4, max_ctx=512, prefix_caching=on), metrics)
        srv = ServerThread(build_app(engine, "demo", ServerOptions(), metrics=metrics)).start()
        try:
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
            ask = lambda: client.completions.create(model="demo", prompt=prompt, max_tokens=8, temperature=0.8,
                                                    seed=5, n=3, logprobs=2)
            first, again = ask(), ask()
            text = httpx.get(srv.url + "/metrics").text
        finally:
            srv.stop()
        answers[on] = [[(c.text, c.logprobs.token_logprobs) for c in r.choices] for r in (first, again)]
        assert first.usage.prompt_tokens == again.usage.prompt_tokens == 300  # counted once for n = 3
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        assert again.usage.prompt_tokens_details.cached_tokens == (256 if on else 0)
        rate = next(float(line.split()[-1]) for line in text.splitlines()
                    if line.startswith("memra:prefix_cache_hit_rate"))
        # on: choices 2 and 3 of the first request are forks of choice 1's prime (300 cached tokens each), then
        # the second request's choice 1 resumes at 256 and its choices 2 and 3 are forks of it
        assert rate == (pytest.approx((2 * 300 + 256 + 2 * 300) / 1800) if on else 0.0)
    assert answers[True] == answers[False]


def test_the_flags():
    from memra.cli import build_parser

    assert build_parser().parse_args(["serve", "demo"]).prefix_caching is True
    assert build_parser().parse_args(["serve", "demo", "--no-prefix-caching"]).prefix_caching is False


# --- memra chat: the cache across turns, Ctrl-C stops the reply and not the chat ---
def _chat(*extra):
    import subprocess
    import sys

    return subprocess.Popen([sys.executable, "-m", "memra", "chat", "--system", SYSTEM, *extra],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


SYSTEM = ("You are a player in a company of actors. Answer every question in the voice of the stage, with the "
          "manners of the court, and never break the scene. ") * 3


def test_chat_turns_resume_from_the_cache_and_ctrl_c_stops_only_the_reply():
    import signal

    p = _chat("--max-tokens", "40")
    p.stdin.write("Good morrow.\n")
    p.stdin.flush()
    assert p.stdout.read(1)  # the reply streams
    p.send_signal(signal.SIGINT)  # stops that reply, between two engine steps
    p.stdin.write("What news?\n/exit\n")
    p.stdin.flush()
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    assert "[stopped]" in err
    lines = [line for line in err.splitlines() if "prompt tokens" in line]
    assert len(lines) == 2, err
    cached = [int(line.split(", ")[1].split()[0]) for line in lines]
    # the second turn resumes from the first turn's prompt pages (the system prompt and more)
    assert cached[0] == 0 and cached[1] >= 128, err


@pytest.mark.parametrize("method", ["ngram", "mtp"])
def test_speculating_requests_with_the_cache_keep_their_tokens(demo, method):
    """n-gram rows resume from the cache; MTP rows prime their whole prompt (the drafter needs every hidden
    state) while others resume from the pages they add. Either way: the tokens of plain, uncached decoding."""
    base = _tokens(260, 21, demo.cfg.vocab_size)
    prompts = [base[:200] + [k] for k in range(3)] + [base + [1, 2]]
    p = SamplingParams(temperature=0.0, max_tokens=8, logprobs=1)
    plain = memra.LLM(demo, max_batch=4, max_ctx=512, warm_up=False, enable_prefix_caching=False)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, p)]
    llm = memra.LLM(demo, max_batch=4, max_ctx=512, warm_up=False, speculative=method)
    before = counters.snapshot()
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, p)] == want
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, p)] == want
    live = counters.delta(before)
    assert live["spec_verify_forwards"] > 0
    assert (live["prefix_cached_tokens"] > 0) == (method == "ngram")


def test_waiting_lookups_compare_only_primes_that_share_a_first_page(demo, monkeypatch):
    """Issue 45: with many requests waiting and primes in flight, every step's lookups compared each waiting
    request with every prime ahead of it (O(waiting x primes) a step: 30-50 ms before a mixed step at 512
    rows). Only a prime with the same first page can hold a request, so only those are compared; the shared
    prompt is still held for the prime in flight and served from it, and every answer is the cold engine's."""
    import memra.prefix.serving as serving

    vocab, calls = demo.cfg.vocab_size, []
    shared = _tokens(128, 7, vocab)
    reqs = [(_tokens(100, 100 + k, vocab), SamplingParams(temperature=0.0, max_tokens=2)) for k in range(24)]
    reqs[3:3] = [(shared + _tokens(8, 1, vocab), SamplingParams(temperature=0.0, max_tokens=2)),
                 (shared + _tokens(8, 2, vocab), SamplingParams(temperature=0.0, max_tokens=2))]
    cfg = dict(max_batch=32, max_ctx=256, prefill_budget=64)
    cold = run_requests(Engine(demo, EngineConfig(prefix_caching=False, **cfg)), reqs)
    common = serving._common_pages
    monkeypatch.setattr(serving, "_common_pages", lambda a, b: calls.append(1) or common(a, b))
    warm = run_requests(Engine(demo, EngineConfig(**cfg)), reqs)
    assert [g[0] for g in warm] == [g[0] for g in cold]
    assert warm[4][3] == 128  # the second sharer waited for the first's prime and resumed from its pages
    assert 0 < len(calls) <= 10  # the sharers' group only (every waiting x every prime: hundreds)
