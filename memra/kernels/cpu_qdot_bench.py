"""One packed weight through the CPU integer-dot kernel at each instruction level (memra.kernels.cpu_qdot):
the weight bytes it streams a second of process CPU time, B=1 (one activation row), one thread.

    python -m memra.kernels.cpu_qdot_bench                       # Q4_K, Q6_K, Q8_0 at [3072, 1024], [1024, 3072]
    python -m memra.kernels.cpu_qdot_bench --formats q4_k --shapes 3072x1024 --reps 9

Random bytes (every quant and scale pattern, small finite d) stand in for a file's weights: the kernel's
speed does not depend on their values. Each level's calls alternate with the others' within a rep and
the best rep of each is reported, since the machine may be shared. A timing tool, not a test: speed
claims live here and in docs/PERFORMANCE.md, never in tests.
"""

from __future__ import annotations

import argparse
import time

import torch

from memra.kernels import cpu_qdot, quant, split
from memra.kernels.quant import QType, QuantWeight

LEVELS = {1: "avx2", 2: "vnni"}
TYPES = {"q4_k": QType.Q4_K, "q5_k": QType.Q5_K, "q6_k": QType.Q6_K, "q8_0": QType.Q8_0}


def random_weight(qtype: QType, n: int, k: int, seed: int = 0):
    """A split layout [n, k] of random bytes with small finite fp16 scales where the format keeps them."""
    g = torch.Generator().manual_seed(seed)
    block, nbytes = quant.PACKABLE[qtype]
    data = torch.randint(0, 256, (n * (k // block), nbytes), dtype=torch.uint8, generator=g)
    for at in {QType.Q4_K: (0, 2), QType.Q5_K: (0, 2), QType.Q6_K: (208,), QType.Q8_0: (0,)}[qtype]:
        d = (torch.rand(data.shape[0], generator=g) * 0.01 + 1e-3).half()
        data[:, at : at + 2] = d[:, None].view(torch.uint8)
    return split.split_layout(QuantWeight(qtype, data.reshape(n, -1), (n, k), torch.float32))


def timer(ws: list, level: int, calls: int):
    """A function timing `calls` B=1 calls of the kernel at `level`, one thread, cycling through the copies
    ws of one weight -> seconds a call."""
    lib = cpu_qdot.library()
    n, k = ws[0].shape
    plans = [cpu_qdot._plan(lib, w) for w in ws]
    block, sums = plans[0][1], plans[0][3]
    q, d, xs = cpu_qdot.quantize_rows(torch.randn(1, k), block)
    acts = (q.data_ptr(), d.data_ptr(), xs.data_ptr()) if sums else (q.data_ptr(), d.data_ptr())
    y = torch.empty(1, n)

    def run() -> float:
        t0 = time.process_time()
        for c in range(calls):
            fn, _, weight_args, _ = plans[c % len(plans)]
            fn(*weight_args, *acts, 1, y.data_ptr(), n, 1, level)
        return (time.process_time() - t0) / calls

    return run


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="q4_k,q6_k,q8_0")
    ap.add_argument("--shapes", default="3072x1024,1024x3072", help="N x K, comma-separated")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--mb", type=float, default=256.0, help="weight megabytes streamed per timed rep")
    ap.add_argument("--set-mb", type=float, default=96.0,
                    help="megabytes of distinct copies cycled through (past the 32 MiB L3: from memory; 0: one copy, from cache)")
    args = ap.parse_args(argv)
    lib = cpu_qdot.library()
    levels = [lv for lv in LEVELS if lv <= lib.avx2]
    print(f"levels on this CPU: {', '.join(LEVELS[lv] for lv in levels)}")
    print("| format | N x K | MB | " + " | ".join(f"{LEVELS[lv]} GB/s" for lv in levels) + " |")
    print("|---|---|---|" + "---|" * len(levels))
    for fmt in args.formats.split(","):
        for shape in args.shapes.split(","):
            n, k = map(int, shape.split("x"))
            w = random_weight(TYPES[fmt], n, k)
            ws = [w] + [random_weight(TYPES[fmt], n, k, seed) for seed in range(1, int(args.set_mb * 1e6 / w.nbytes))]
            calls = max(1, int(args.mb * 1e6 / w.nbytes))
            runs = {lv: timer(ws, lv, calls) for lv in levels}
            best = {lv: float("inf") for lv in levels}
            for _ in range(args.reps):
                for lv in levels:
                    best[lv] = min(best[lv], runs[lv]())
            cells = " | ".join(f"{w.nbytes / best[lv] / 1e9:.1f}" for lv in levels)
            print(f"| {fmt} | {n} x {k} | {w.nbytes / 1e6:.2f} | {cells} |", flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
