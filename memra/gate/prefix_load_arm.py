"""The prefix arm under load (part of `memra gate MODEL --mode prefix`, promise E8 as a server meets it):
requests that share prefixes arrive while others decode, and each must still get a cold run's bits.

    cold      an engine with the prefix cache off runs every request at once.
    load      an engine with it on, and a KV pool a few requests deep (cached pages are evicted while
              others hit), admits two requests a step, so hits are taken in steps where other rows
              decode; every fifth request is cancelled after its third token (a stream whose reader
              left, holding shared pages while the rest go on).
    prompts   a shared text cut at page ends and one token either side (63, 64, 65, 127, 128, 129, ...)
              with 0-2 tokens of their own, so hits resume at every cut, some with a single token left
              to prime; and served-like prompts of random lengths that share nothing (the prefix cache
              then only cuts their chunks at its snapshot stops, as a served workload of distinct
              prompts meets it). Greedy and seeded sampling, two top logprobs.
    check     every finished request's tokens, logprobs and top logprobs == cold (float equality);
              a cancelled one's tokens == cold's first tokens.
    liveness  hits at two or more cuts, a hit that primed a single token, a hit taken while other rows
              decoded, evicted blocks, cancelled requests.

What this arm adds to the batch arm: a prompt of 64k + 1 tokens resumed (or cut by a snapshot stop) at
64k primes its last token alone. Where a prime is one forward per chunk (CUDA), that token once attended
through the decode kernel, not the prefill kernel its cold prime used, and the served answers drifted
from offline ones (issue 44); the batch arm, whose tails were longer, never met it.
"""

from __future__ import annotations

import random

from memra import counters
from memra.engine.engine import Engine
from memra.engine.types import EngineConfig
from memra.gate.battery import Ledger
from memra.prefix.tree import PAGE
from memra.sampling import SamplingParams

ARM = "prefix-load"
CUTS = (1, 2, 3)  # pages at whose end (and one token either side) the shared prompts are cut
SERVED = 10  # served-like prompts that share nothing
CANCEL_EVERY, CANCEL_AFTER = 5, 3


def load_workload(seed: int, vocab: int, steps: int) -> tuple[list[int], list[tuple[list[int], SamplingParams]]]:
    """-> (the shared text, [(prompt, params)] in arrival order)."""
    rng = random.Random(1000 + seed)
    base = [rng.randrange(vocab) for _ in range(max(CUTS) * PAGE + 8)]
    reqs = []
    for j, (pages, delta) in enumerate((p, d) for p in CUTS for d in (-1, 0, 1)):
        own = [rng.randrange(vocab) for _ in range(j % 3)]
        reqs.append(base[: pages * PAGE + delta] + own)
    reqs += [[rng.randrange(vocab) for _ in range(rng.randint(4, max(CUTS) * PAGE + 2))] for _ in range(SERVED)]
    rng.shuffle(reqs)
    out = []
    for j, prompt in enumerate(reqs):
        params = (SamplingParams(max_tokens=steps, temperature=0.0, logprobs=2) if j % 2 == 0 else
                  SamplingParams(max_tokens=steps, temperature=0.8, top_p=0.95, seed=seed + j, logprobs=2))
        out.append((prompt, params))
    return base, out


class _Record:
    def __init__(self) -> None:
        self.tokens, self.logprobs, self.tops, self.cached, self.error = [], [], [], 0, None
        self.under_load = False  # submitted while another request was decoding

    def __call__(self, ev) -> None:
        if ev.error:
            self.error = ev.error
        if ev.token_id is not None:
            self.tokens.append(ev.token_id)
            self.logprobs.append(ev.logprob)
            self.tops.append(ev.top_logprobs)
            self.cached = ev.cached_tokens


def run_cold(engine: Engine, reqs) -> list[_Record]:
    got = [_Record() for _ in reqs]
    for (prompt, params), rec in zip(reqs, got):
        engine.submit(prompt, params, rec, logprobs=params.logprobs)
    engine.run_until_idle()
    return got


def run_load(engine: Engine, reqs, per_step: int = 2) -> tuple[list[_Record], set[int], int]:
    """Admit `per_step` requests a step, cancel every CANCEL_EVERY-th after CANCEL_AFTER tokens.
    -> (records, indices cancelled, hits taken while another request was decoding)."""
    got = [_Record() for _ in reqs]
    rids: list[list[str] | None] = [None] * len(reqs)
    cancelled: set[int] = set()
    nxt = 0
    while nxt < len(reqs) or engine.busy():
        decoding = any(r.tokens for i, r in enumerate(got) if rids[i] is not None and i not in cancelled
                       and len(r.tokens) < reqs[i][1].max_tokens)
        for _ in range(per_step):
            if nxt < len(reqs):
                prompt, params = reqs[nxt]
                rids[nxt] = engine.submit(prompt, params, got[nxt], logprobs=params.logprobs)
                got[nxt].under_load = decoding
                nxt += 1
        for i, r in enumerate(got):
            if (i % CANCEL_EVERY == CANCEL_EVERY - 1 and i not in cancelled
                    and CANCEL_AFTER <= len(r.tokens) < reqs[i][1].max_tokens):
                engine.cancel(rids[i])
                cancelled.add(i)
        engine.step()
    under_load = sum(1 for r in got if r.under_load and r.cached)
    return got, cancelled, under_load


def run_prefix_load_arm(model, led: Ledger, steps: int, out=print, kv_blocks: int | None = None,
                        plant=None) -> None:
    """The arm's runs and checks into `led`. plant(engine, prompt): the battery's canary, planted in the load
    engine as the shared text's first pages (the first requests that share them resume from it and must differ)."""
    seed = model.settings.gate_seed
    base, reqs = load_workload(seed, model.cfg.vocab_size, steps)
    ctx = min(model.cfg.max_position, 512)
    longest = max(len(p) for p, _ in reqs) + steps
    per_seq = -(-longest // 16) + 1
    small = kv_blocks or 4 * per_seq  # a few requests deep: the cache's pages are evicted as others arrive

    def engine(on: bool, blocks: int | None, batch: int) -> Engine:
        return Engine(model, EngineConfig(max_batch=batch, max_ctx=ctx, token_budget=256, kv_blocks=blocks,
                                          prefix_caching=on, prefill_wait_steps=0))

    cold = run_cold(engine(False, kv_blocks, len(reqs)), reqs)
    warm = engine(True, small, 4)
    if plant is not None:
        plant(warm, base)
    before = counters.snapshot()
    got, cancelled, under_load = run_load(warm, reqs)
    live = counters.delta(before)
    cuts, single = set(), 0
    for i, ((prompt, _), g, want) in enumerate(zip(reqs, got, cold)):
        if g.error or want.error:
            led.fail(ARM, f"request {i}: error {g.error or want.error}")
            continue
        if g.cached:
            cuts.add(g.cached)
            single += g.cached == len(prompt) - 1
        n = len(g.tokens) if i in cancelled else len(want.tokens)
        if g.tokens[:n] != want.tokens[:n] or len(g.tokens) < n:
            first = next((k for k, (x, y) in enumerate(zip(g.tokens, want.tokens)) if x != y), n)
            led.fail(ARM, f"request {i} ({len(prompt)} tokens, cached {g.cached}): tokens DIVERGED from cold at "
                          f"step {first}")
        elif g.logprobs[:n] != want.logprobs[:n] or g.tops[:n] != want.tops[:n]:
            led.fail(ARM, f"request {i} ({len(prompt)} tokens, cached {g.cached}): logprobs BIT-DIFF vs cold")
    led.verdict(ARM, f"{len(reqs)} requests admitted 2 a step into a {small}-block pool, {len(cancelled)} "
                     f"cancelled mid-stream, hits at cuts {sorted(cuts)} == cold, tokens and logprobs bit-checked")
    problems = []
    if len(cuts) < 2 or not single or not under_load:
        problems.append(f"cuts {sorted(cuts)}, {single} hits priming one token, {under_load} hits among decoding rows")
    if live["prefix_evicted_blocks"] <= 0 or not cancelled:
        problems.append(f"prefix_evicted_blocks +{live['prefix_evicted_blocks']}, {len(cancelled)} cancelled")
    for p in problems:
        led.fail("liveness", f"{ARM}: {p}")
    out(f"{ARM} liveness: {single} hits primed a single token, {under_load} taken among decoding rows, "
        f"prefix_evicted_blocks +{live['prefix_evicted_blocks']}, {len(cancelled)} cancelled")
