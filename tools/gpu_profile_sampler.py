"""What a batch's seeded sampling costs on the GPU: one Triton launch (MEMRA_SAMPLE_KERNEL, the default)
against device_sample row by row (MEMRA_SAMPLE_KERNEL=0), both through the kernel table a model loaded
with those doors runs (run through the device tool):

    python tools/gpu_profile_sampler.py [--batch 128] [--vocab 248320] [--reps 5]

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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=248320)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
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
