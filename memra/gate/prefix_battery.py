"""The prefix-cache battery (`memra gate MODEL --mode prefix`, promise E8): a request served from the
prefix cache returns the tokens and logprobs of a cold server, bit for bit.

    cold    an engine with the prefix cache off runs each batch of requests.
    warm    an engine with it on first primes prompts of several prefix lengths (its cache fills, with
            snapshots at their last aligned cuts on hybrids), then runs the same batches: every request
            shares a prefix with a cached prompt and resumes at a 64-aligned cut (several cuts), B=1..N
            requests at once, greedy and seeded sampling, two top logprobs each.
    prefix  every request's tokens, logprobs and top logprobs == cold (float equality, not closeness).
    liveness  prefix_cached_tokens advanced, and the hits resumed at two or more distinct cuts.

MEMRA_GATE_CANARY=1 plants a page the cache must never hold: positions 64..127 of a prompt fed through
decode steps (the decode arithmetic: GDN's recurrent form, one-row linears), with the state after them
as the snapshot at 128. A request that resumes from it must then differ from cold, and the arm FAILs.
"""

from __future__ import annotations

from typing import Callable

from memra import counters
from memra.engine.engine import Engine
from memra.engine.types import EngineConfig
from memra.gate.battery import Ledger
from memra.prefix.tree import PAGE
from memra.sampling import SamplingParams

ARM = "prefix"
PREFIXES = (70, 140, 260)  # cached prompts: their last aligned cuts are 64, 128 and 256


def _tokens(n: int, seed: int, vocab: int) -> list[int]:
    """n pseudo-random token ids (an LCG: the same on every machine)."""
    x, out = 12345 + 977 * seed, []
    for _ in range(n):
        x = (x * 1103515245 + 12345) % (1 << 31)
        out.append(x % vocab)
    return out


def workload(batches: tuple[int, ...], seed: int, vocab: int, steps: int):
    """-> (primers, [batch of (prompt, params)] per B): each request a cached prefix plus its own tail."""
    base = _tokens(max(PREFIXES) + 40, seed, vocab)
    primers = [base[:n] for n in PREFIXES]
    runs = []
    for b in batches:
        reqs = []
        for j in range(b):
            tail = _tokens(5 + 3 * j, seed * 31 + b * 7 + j + 1, vocab)
            params = (SamplingParams(temperature=0.0, max_tokens=steps, logprobs=2) if j % 2 == 0 else
                      SamplingParams(max_tokens=steps, temperature=0.8, top_p=0.95, seed=seed + j, logprobs=2))
            reqs.append((base[: PREFIXES[j % len(PREFIXES)] + (j // len(PREFIXES)) * 9] + tail, params))
        runs.append(reqs)
    return primers, runs


def run_requests(engine: Engine, reqs) -> list[tuple]:
    """Submit all at once, run to the end. -> per request (tokens, logprobs, tops, cached tokens)."""
    got = [([], [], [], [0]) for _ in reqs]
    for (prompt, params), g in zip(reqs, got):
        def sink(ev, g=g):
            if ev.error:
                raise RuntimeError(ev.error)
            if ev.token_id is not None:
                g[0].append(ev.token_id)
                g[1].append(ev.logprob)
                g[2].append(ev.top_logprobs)
                g[3][0] = ev.cached_tokens
        engine.submit(prompt, params, sink, logprobs=params.logprobs)
    engine.run_until_idle()
    return [(t, lp, top, c[0]) for t, lp, top, c in got]


def plant_decoded(engine: Engine, prompt: list[int]) -> None:
    """The canary: pages 0..1 of `prompt` into the cache with positions 64..127 written by decode steps."""
    model, store = engine.model, engine.backend.prefix.store
    cache = engine.backend.new_cache(engine.cache_ctx)
    model.prime(prompt[:PAGE], cache)
    for t in prompt[PAGE : 2 * PAGE]:
        model.decode_step(t, cache)
    node = store.tree.root
    for d in range(2):
        node = store.add_page(node, tuple(prompt[d * PAGE : (d + 1) * PAGE]), cache.blocks[4 * d : 4 * d + 4])
    store.take_snapshot(node, cache)
    cache.shared = 8
    cache.free()


def run_prefix_battery(model, batches: tuple[int, ...] = (1, 2, 4), steps: int = 8, out: Callable = print,
                       kv_blocks: int | None = None, canary: bool | None = None) -> bool:
    seed = model.settings.gate_seed
    canary = model.settings.gate_canary if canary is None else canary
    led = Ledger(out)
    vocab = model.cfg.vocab_size
    out(f"prefix mode: B={list(batches)} steps={steps} prefixes={list(PREFIXES)} seed={seed}"
        f"{' CANARY (must FAIL)' if canary else ''}")
    primers, runs = workload(batches, seed, vocab, steps)
    ctx = min(model.cfg.max_position, 512)

    def engine(on: bool) -> Engine:
        return Engine(model, EngineConfig(max_batch=max(batches), max_ctx=ctx, token_budget=512, kv_blocks=kv_blocks,
                                          prefix_caching=on))

    cold = engine(False)
    want = [run_requests(cold, reqs) for reqs in runs]
    warm = engine(True)
    if canary:  # the shared prefix's second page decoded, not primed: requests resuming past it must differ
        plant_decoded(warm, primers[-1])
    run_requests(warm, [(p, SamplingParams(temperature=0.0, max_tokens=1)) for p in primers])
    before = counters.snapshot()
    cuts = set()
    for b, reqs, ref in zip(batches, runs, want):
        got = run_requests(warm, reqs)
        for j, ((toks, lps, tops, cached), (rt, rlp, rtop, _)) in enumerate(zip(got, ref)):
            cuts.add(cached)
            if toks != rt:
                first = next((i for i, (x, y) in enumerate(zip(toks, rt)) if x != y), min(len(toks), len(rt)))
                led.fail(ARM, f"B={b} request {j} (cached {cached}): tokens DIVERGED from cold at step {first}")
            elif lps != rlp or tops != rtop:
                led.fail(ARM, f"B={b} request {j} (cached {cached}): logprobs BIT-DIFF vs cold")
    live = counters.delta(before)
    cuts.discard(0)
    led.verdict(ARM, f"{sum(batches)} requests in batches of {list(batches)}, greedy and seeded, resumed at cuts "
                     f"{sorted(cuts)} == cold server, tokens and logprobs bit-checked")
    if live["prefix_cached_tokens"] <= 0 or len(cuts) < 2:
        led.fail("liveness", f"prefix_cached_tokens +{live['prefix_cached_tokens']}, distinct cuts {sorted(cuts)}")
    led.verdict("liveness", f"prefix_cached_tokens +{live['prefix_cached_tokens']}, prefix_snapshots "
                            f"+{live['prefix_snapshots']}, prefix_evicted_blocks +{live['prefix_evicted_blocks']}")
    ok = not led.failed
    out("ALL GREEN: prefix-cache battery" if ok else f"FAILED: {', '.join(sorted(led.failed))}")
    return ok
