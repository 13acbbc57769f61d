"""The row-invariant fp32 linear on CPU (MEMRA_CPU_FLIN, memra.kernels.cpu_flin) against torch's (MKL's), and
decoding with the door on and off. Process CPU time, --threads 1 by default (other processes' load barely moves it).

    python tools/bench_cpu_flin.py kernel                        # us a call, N x K weights, M rows
    python tools/bench_cpu_flin.py decode [MODEL] [--rounds 3]   # decode_step_batch tok/s at B=1 and B=8
"""

from __future__ import annotations

import argparse
import time

import torch

SHAPES = [(1280, 256), (256, 512), (1024, 256), (3072, 1024), (1024, 3072), (1024, 64), (256, 64)]


def clock(fn, reps: int) -> float:
    fn()
    t0 = time.process_time()
    for _ in range(reps):
        fn()
    return (time.process_time() - t0) / reps


def kernel() -> None:
    from memra.kernels import cpu_flin

    for n, k in SHAPES:
        w = torch.randn(n, k)
        for m in (1, 8, 48, 160):
            x = torch.randn(m, k)
            reps = max(3, int(2e8 / (m * n * k)))
            mkl, flin = clock(lambda: torch.nn.functional.linear(x, w), reps), clock(lambda: cpu_flin.linear(x, w), reps)
            print(f"N={n:5d} K={k:5d} M={m:3d}: torch {mkl * 1e6:8.1f} us  cpu_flin {flin * 1e6:8.1f} us  "
                  f"ratio {flin / mkl:.2f}")


def decode(model_name: str, rounds: int) -> None:
    import memra
    from memra import step
    from memra.decode_plan import decode_plan

    base = memra.LLM(model_name, warm_up=False, seed=1).model
    models = {"MEMRA_CPU_FLIN=1": base.with_doors(MEMRA_CPU_FLIN="1"), "MEMRA_CPU_FLIN=0": base.with_doors(MEMRA_CPU_FLIN="0")}

    def rate(m, b: int, steps: int = 24) -> float:
        caches = [m.new_cache(64) for _ in range(b)]
        for i, c in enumerate(caches):
            step.prime(m, [1 + i, 2, 3, 4, 5], c)
        toks = torch.arange(b) + 7
        seconds = clock(lambda: step.decode_step_batch(m, toks, caches), steps)
        for c in caches:
            c.free()
        return b / seconds

    best: dict[tuple[str, int], float] = {}
    for _ in range(rounds):  # alternating, so both doors see the same load
        for name, m in models.items():
            for b in (1, 8):
                best[name, b] = max(best.get((name, b), 0.0), rate(m, b))
    for name, m in models.items():
        print(f"{model_name} {name} (plan {decode_plan(m)}): B=1 {best[name, 1]:8.1f} tok/s  B=8 {best[name, 8]:8.1f} tok/s")


def main() -> None:
    ap = argparse.ArgumentParser(description="the row-invariant fp32 linear against torch's (MEMRA_CPU_FLIN)")
    ap.add_argument("what", choices=("kernel", "decode"))
    ap.add_argument("model", nargs="?", default="demo")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kernel() if args.what == "kernel" else decode(args.model, args.rounds)


if __name__ == "__main__":
    main()
