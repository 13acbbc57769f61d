"""The GDN prefill and batch-sampler kernels' GPU check, in one device call (run through the device tool):

    python tools/gpu_kernel_check.py [--budget 420]

1. the exactness tests that need the GPU's own kernels: `MEMRA_TEST_DEVICE=cuda pytest` over the kernel,
   step, exactness and graph files (the whole-chunk exact prefill included), in a child with a wall limit;
2. GDN's two-launch chunked prefill (MEMRA_GDN_KERNEL) against the reference's chunk loop: largest
   relative difference, bits across 64-aligned pieces, ms per layer (tools/gpu_gdn_prefill.py);
3. the one-launch batch sampler (MEMRA_SAMPLE_KERNEL) against device_sample row by row on a 248k
   vocabulary: the same token in every row (greedy, plain, top-k/top-p/min-p), and ms per batch of 128.
Prints a short table last: what keeping each kernel on by default rests on.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from memra.sampling import DevSamp, device_sample  # noqa: E402

TEST_FILES = ["tests/test_triton_kernels.py", "tests/test_moe_kernel.py", "tests/test_sample_kernel.py",
              "tests/test_graphs.py", "tests/test_steps.py", "tests/test_exact.py"]


def run_tests(limit_s: float) -> str:
    env = {**os.environ, "MEMRA_TEST_DEVICE": "cuda"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", *TEST_FILES]
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit_s)
    except subprocess.TimeoutExpired:
        return f"TIMEOUT after {limit_s:.0f}s"
    lines = [ln for ln in done.stdout.splitlines() if ln.strip()]
    failed = [ln for ln in lines if ln.startswith("FAILED")]
    print("\n".join(failed[:10] + lines[-1:]))
    return lines[-1] if lines else f"exit {done.returncode}"


def check_gdn() -> str:
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_gdn_prefill.py")], capture_output=True,
                          text=True, timeout=240)
    print(done.stdout + done.stderr[-2000:])
    return " | ".join(ln.strip() for ln in done.stdout.splitlines()[1:]) or f"exit {done.returncode}"


def check_sampler() -> str:
    from memra.kernels import sample_triton

    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(128, 248320, device="cuda", generator=g) * 4
    filters = [dict(), dict(top_k=40), dict(top_p=0.9), dict(min_p=0.05)]
    specs = [DevSamp(0.0 if i % 8 == 0 else 0.6 + (i % 5) / 5, 1000 + i, 7 * i, **filters[i % 4]) for i in range(128)]
    plain = [DevSamp(s.temperature, s.seed, s.ctr) for s in specs]  # the no-filter case: the kernel's own path
    want = [int(device_sample(row, s)) for row, s in zip(logits, specs)]
    got = sample_triton.sample_batch(logits, specs).tolist()
    same = sum(a == b for a, b in zip(got, want))

    def timed(fn) -> float:
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / 5 * 1e3

    rows = timed(lambda: torch.stack([device_sample(r, s) for r, s in zip(logits, plain)]).tolist())
    kernel = timed(lambda: sample_triton.sample_batch(logits, plain).tolist())
    return f"{same}/128 rows equal device_sample; no filters: {rows:.1f} ms row by row, {kernel:.2f} ms one launch"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=float, default=420)
    a = ap.parse_args()
    t0 = time.perf_counter()
    table = [("GPU exactness tests", run_tests(max(60.0, a.budget - 150)))]
    table.append(("GDN prefill kernel", check_gdn() if time.perf_counter() - t0 < a.budget - 60 else "skipped: budget"))
    table.append(("batch sampler", check_sampler() if time.perf_counter() - t0 < a.budget - 20 else "skipped: budget"))
    print(f"\n{torch.cuda.get_device_name()}, {time.perf_counter() - t0:.0f}s")
    for name, result in table:
        print(f"{name:22s} {result}")


if __name__ == "__main__":
    main()
