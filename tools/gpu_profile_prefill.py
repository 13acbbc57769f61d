"""Where one prefill chunk's time goes on the GPU (run through the device tool):

    python tools/gpu_profile_prefill.py [--model qwen3.5-35b-a3b] [--layers 8] [--tokens 4096]

Builds a random-weight model of the shape with its first --layers layers (the layer mix of a hybrid repeats
every four layers, so eight show it), primes one --tokens-token prompt three times (two to compile and
warm, the third timed), then profiles a fourth: its wall time, the sum of its GPU kernels and the kernels that take
the most time.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from memra.random_model import random_model  # noqa: E402


def prime(model, ids: list[int]) -> None:
    cache = model.new_cache(len(ids) + 64)
    model.prime(ids, cache)
    torch.cuda.synchronize()
    cache.free()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3.5-35b-a3b")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=4096)
    a = ap.parse_args()
    model = random_model(a.model, n_layers=a.layers)
    ids = torch.randint(0, 1000, (a.tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    for _ in range(2):
        prime(model, ids)
    t0 = time.perf_counter()
    prime(model, ids)
    print(f"{a.model}, {a.layers} layers: prime {a.tokens} tokens {(time.perf_counter() - t0) * 1e3:.1f} ms wall")
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        prime(model, ids)
    # kernels only: a CPU op (aten::cat) also carries the device time of the kernel it launched
    rows = sorted((e for e in prof.key_averages() if e.device_type.name == "CUDA"),
                  key=lambda e: -getattr(e, "self_device_time_total", 0))
    print(f"GPU kernels {sum(getattr(e, 'self_device_time_total', 0) for e in rows) / 1e3:.1f} ms")
    for e in rows[:18]:
        print(f"{getattr(e, 'self_device_time_total', 0) / 1e3:8.2f} ms  x{e.count:4d}  {e.key[:80]}")


if __name__ == "__main__":
    main()
