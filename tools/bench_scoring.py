"""Scoring throughput against prefill (issue 34): tokens/s of memra.LLM.score-style scoring jobs (a
whole text scored as a prompt, and prompt + continuation with continuation_start: the continuation
stepped with the decode arithmetic) against a plain prime of the same tokens.

    python tools/bench_scoring.py [MODEL] [--tokens 2048] [--continuation 256] [--reps 3]
"""

from __future__ import annotations

import argparse
import time

import memra
from memra.engine.scoring import ScoreJob, score


def best(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="demo")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--continuation", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    model = memra.load(args.model)
    vocab = model.cfg.vocab_size
    ids = [(55 + 31 * j) % vocab for j in range(args.tokens)]

    def run(fn):
        def once():
            cache = model.new_cache(len(ids))
            try:
                fn(cache)
            finally:
                cache.free()
        return once

    n = len(ids)
    rows = [
        ("prefill (prime, last logits)", n, run(lambda c: model.prime(ids, c))),
        ("score as prompt (echo, no continuation_start)", n, run(lambda c: score(model, ScoreJob(tuple(ids), None, 0), c))),
        (f"score, last {args.continuation} as continuation", n,
         run(lambda c: score(model, ScoreJob(tuple(ids), n - args.continuation, 0), c))),
        (f"decode: {args.continuation} steps after a prime of {n - args.continuation}", n,
         run(lambda c: [model.prime(ids[: n - args.continuation], c)]
             + [model.decode_step(t, c) for t in ids[n - args.continuation:]])),
    ]
    print(f"{args.model}: {n} tokens, device {model.device}, dtype {model.dtype}, best of {args.reps}")
    for name, tokens, fn in rows:
        fn()  # warm
        s = best(fn, args.reps)
        print(f"  {name:58s} {s:7.3f} s  {tokens / s:9.0f} tok/s")


if __name__ == "__main__":
    main()
