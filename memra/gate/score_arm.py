"""The scoring battery (`memra gate MODEL --mode score`): scoring equals sampling (promise E9).

    sample   prompts of several lengths (around the 64-grid's edges and past one scoring chunk) decoded
             by the engine together, greedy and seeded, each generated token with its logprob and top 2.
    score    every prompt + its completion scored with continuation_start = the prompt's length: each
             completion token's logprob and top 2 must equal the sampled ones bit for bit (Python floats
             from the same fp32 values: `==`).
    prompt   the same texts scored without continuation_start: every row must equal the log_softmax of
             a one-shot prime's all-positions logits (the prompt arithmetic, whatever the scoring chunks).
    liveness scored_decode_tokens advanced by exactly the completion tokens scored with the decode
             arithmetic (a pass with nothing scored that way is a FAIL).

MEMRA_GATE_CANARY=1 scores the completions with the prompt arithmetic instead: from the second completion
token on, the continuation is primed as if it were prompt text. The battery must then FAIL the score arm.
"""

from __future__ import annotations

from typing import Callable


from memra import counters
from memra.engine.engine import Engine
from memra.engine.scoring import SCORE_CHUNK, ScoreJob, row_score
from memra.engine.types import EngineConfig
from memra.gate.battery import Ledger
from memra.kernels.cuts import TILE
from memra.sampling import SamplingParams

TOP = 2


def score_prompts(plen: int, vocab: int) -> list[list[int]]:
    """Prompt lengths that put the last prompt position on each side of a 64-cut, and one past a scoring
    chunk (so the scorer's chunked prime meets its own cuts)."""
    lengths = sorted({plen, TILE, TILE + 1, TILE + 2, SCORE_CHUNK + 37})
    return [[(55 + 13 * n + 31 * j) % vocab for j in range(n)] for n in lengths]


def _sample(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> list[list]:
    """Each prompt's generated token events (token, logprob, top), all prompts decoding together."""
    events: list[list] = [[] for _ in prompts]
    for i, p in enumerate(prompts):
        engine.submit(p, params, lambda ev, i=i: events[i].append(ev) if ev.token_id is not None else None,
                      logprobs=TOP)
    engine.run_until_idle()
    return events


def run_score_battery(model, steps: int = 24, plen: int = 20, out: Callable[[str], None] = print) -> bool:
    led = Ledger(out)
    canary = model.settings.gate_canary
    vocab = model.cfg.vocab_size
    prompts = score_prompts(plen, vocab)
    ctx = max(len(p) for p in prompts) + steps + 1
    engine = Engine(model, EngineConfig(max_batch=len(prompts), max_ctx=ctx, max_waiting=64))
    before = counters.snapshot()
    expected_decode = 0
    draws = {"greedy": SamplingParams(temperature=0.0, max_tokens=steps), "seeded": SamplingParams(max_tokens=steps, temperature=0.9,
                                                                                  top_p=0.95, seed=7)}
    for name, params in draws.items():
        for prompt, evs in zip(prompts, _sample(engine, prompts, params)):
            gen = [e.token_id for e in evs]
            fut = engine.score_jobs.submit(ScoreJob(tuple(prompt + gen), len(prompt), TOP, prefill_continuation=canary))
            engine.run_until_idle()
            got = fut.result()[len(prompt):]
            expected_decode += 0 if canary else len(gen) - 1
            for j, (e, t) in enumerate(zip(evs, got)):
                if t.logprob != e.logprob or t.top != e.top_logprobs:
                    led.fail("score", f"{name} prompt {len(prompt)} token {j}: scored {t.logprob!r} "
                                      f"sampled {e.logprob!r}")
                    break
    led.verdict("score", "a completion's scored logprobs == its sampled ones, greedy and seeded, bit for bit")
    for prompt in prompts:
        fut = engine.score_jobs.submit(ScoreJob(tuple(prompt), None, TOP))
        engine.run_until_idle()
        cache = model.new_cache(len(prompt))
        rows = model.prime(prompt, cache, all_logits=True)
        cache.free()
        ref = [row_score(rows[i - 1], prompt[i], TOP) for i in range(1, len(prompt))]
        if fut.result()[1:] != ref:
            led.fail("prompt", f"prompt {len(prompt)}: chunked scoring != one-shot prime rows")
    led.verdict("prompt", "scores without continuation_start == a one-shot prime's rows (the prompt arithmetic)")
    moved = counters.delta(before)["scored_decode_tokens"]
    if moved != expected_decode or (not canary and moved == 0):
        led.fail("liveness", f"scored_decode_tokens moved {moved}, expected {expected_decode}")
    led.verdict("liveness", f"{moved} tokens scored with the decode arithmetic")
    engine.shutdown(0)
    ok = not led.failed
    out(f"{'ALL GREEN' if ok else 'FAILED'}: score ({', '.join(sorted(led.failed)) or 'every arm passed'})"
        f"{' [canary]' if canary else ''}")
    return ok
