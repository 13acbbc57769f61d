"""What a batch's seeded sampling costs on the GPU: one Triton launch (MEMRA_SAMPLE_KERNEL, the default)
against device_sample row by row (MEMRA_SAMPLE_KERNEL=0), both through the kernel table a model loaded
with those doors runs (run through the device tool):

    python tools/gpu_profile_sampler.py [--batch 128] [--vocab 248320] [--reps 5]

and the one launch against its split form (MEMRA_SAMPLE_SPLIT=1: a row's vocabulary in parts, then a
combine) and the split form pruned (MEMRA_SAMPLE_PRUNE=1: blocks that cannot hold a row's best skip the exact
scores), plain seeded rows at each batch size, CUDA-event timed:

    python tools/gpu_profile_sampler.py --split --batches 1,16,64,128,256,512 --vocabs 128256,248320

A profiler, not a check: that the launch picks device_sample's token in every row is
tests/test_cuda_kernels.py (and tests/test_sample_kernel.py).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from memra.kernels.table import KernelTable  # noqa: E402
from memra.sampling import DevSamp  # noqa: E402
from memra.settings import Settings  # noqa: E402


def timed_ms(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e3


def split_table(batches: list[int], vocabs: list[int], reps: int) -> None:
    """Plain seeded rows (the throughput run's): the one launch against the split one and the split one pruned,
    ms a call, on logits of a real model's spread (N(0, 4)) and on flat ones (N(0, 0.01): a random-weight model's,
    where the noise decides and fewer blocks skip)."""
    whole = KernelTable.build("cuda", Settings(sample_split=False))
    split = KernelTable.build("cuda", Settings(sample_split=True))
    pruned = KernelTable.build("cuda", Settings(sample_split=True, sample_prune=True))
    print(f"| vocabulary | logits | rows | one launch, ms | split, ms | split + pruned, ms | same tokens |  "
          f"({torch.cuda.get_device_name()})")
    print("|---|---|---|---|---|---|---|")
    for v in vocabs:
        for b, scale in ((b, s) for b in batches for s in (4.0, 0.01)):
            logits = torch.randn(b, v, device="cuda", generator=torch.Generator(device="cuda").manual_seed(b)) * scale
            specs = [DevSamp(1.0, 1000 + i, 7 * i) for i in range(b)]
            ms = []
            for table in (whole, split, pruned):
                table.sample_batch(logits, specs)  # compile and warm
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(reps):
                    table.sample_batch(logits, specs)
                end.record()
                torch.cuda.synchronize()
                ms.append(start.elapsed_time(end) / reps)
            tokens = [t.sample_batch(logits, specs) for t in (whole, split, pruned)]
            same = torch.equal(tokens[0], tokens[1]) and torch.equal(tokens[0], tokens[2])
            print(f"| {v:,} | N(0, {scale:g}) | {b} | {ms[0]:.3f} | {ms[1]:.3f} | {ms[2]:.3f} | {same} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=248320)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--split", action="store_true", help="the one launch against MEMRA_SAMPLE_SPLIT's, per batch")
    ap.add_argument("--batches", default="1,16,64,128,256,512")
    ap.add_argument("--vocabs", default="128256,248320")
    a = ap.parse_args()
    if a.split:
        split_table([int(b) for b in a.batches.split(",")], [int(v) for v in a.vocabs.split(",")], max(a.reps, 20))
        return
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(a.batch, a.vocab, device="cuda", generator=g) * 4
    filters = [dict(), dict(top_k=40), dict(top_p=0.9), dict(min_p=0.05)]
    plain = [DevSamp(0.6 + (i % 5) / 5, 1000 + i, 7 * i) for i in range(a.batch)]  # the kernel's own path
    filtered = [DevSamp(s.temperature, s.seed, s.ctr, **filters[i % 4]) for i, s in enumerate(plain)]
    launch = KernelTable.build("cuda", Settings())
    rows = KernelTable.build("cuda", Settings(sample_kernel=False))
    print(f"batch sampler, B={a.batch}, vocabulary {a.vocab}, {torch.cuda.get_device_name()}")
    for name, specs in (("no filters", plain), ("top-k / top-p / min-p mixed", filtered)):
        one = timed_ms(lambda: launch.sample_batch(logits, specs).tolist(), a.reps)
        each = timed_ms(lambda: rows.sample_batch(logits, specs).tolist(), a.reps)
        print(f"  {name:28s} row by row {each:8.2f} ms   one launch {one:8.2f} ms   ({each / one:.1f}x)")


if __name__ == "__main__":
    main()
