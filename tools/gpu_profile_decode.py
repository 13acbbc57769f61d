"""Where a decode step's time goes on the GPU (run through the device tool):

    python tools/gpu_profile_decode.py [--model llama-3-8b] [--layers N]

1. the frozen batch-invariant linear kernel against torch's F.linear (cuBLAS) at M = 1, 8, 32, 128
   on the shapes of one Llama-3-8B layer and its lm_head: microseconds and GB/s of weight read;
2. other tile configurations of the same kernel: time, and whether their bits equal the frozen
   config's at every M (the K order is what fixes the bits; the tiles may or may not keep it);
3. one B=1 decode step of the model, eager: wall time vs the sum of its GPU kernels (torch.profiler),
   and the kernels that take the most time. Wall >> kernels means launch-bound.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import triton  # noqa: E402

from memra.kernels.triton import linear as T  # noqa: E402
from memra.random_model import random_model  # noqa: E402


def bench(fn, reps=50) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


def run_linear(x, w, bm, bn, bk, warps, stages):
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    T._linear_kernel[grid](x, w, w, y, y, m, n, k, x.stride(0), w.stride(0), y.stride(0), y.stride(0), HAS_BIAS=False,
                           HAS_RESIDUAL=False, IEEE=False, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps,
                           num_stages=stages)
    return y


def linear_table() -> None:
    shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
              "lm_head": (128256, 4096)}
    configs = [(64, 32, 64, 4, 4), (16, 32, 64, 4, 4), (16, 64, 64, 4, 4), (16, 64, 128, 4, 4), (64, 64, 64, 4, 4),
               (64, 128, 64, 4, 3), (16, 128, 64, 4, 4), (32, 64, 64, 4, 4), (16, 32, 128, 2, 4), (64, 32, 128, 4, 4)]
    torch.manual_seed(0)
    print("\n== linear: us per call (GB/s of weight read) ==")
    print("shape     M   F.linear        " + "  ".join(f"{c[0]}x{c[1]}x{c[2]}w{c[3]}s{c[4]}".ljust(20) for c in configs))
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        for m in (1, 8, 32, 128):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = run_linear(x, w, *configs[0])
            t_f = bench(lambda: F.linear(x, w))
            cells = []
            for c in configs:
                try:
                    same = torch.equal(run_linear(x, w, *c), ref)
                    t = bench(lambda: run_linear(x, w, *c))
                    cells.append(f"{t*1e6:7.1f}({w.numel()*2/t/1e9:5.0f}){'=' if same else '!'}")
                except Exception as e:  # a config the compiler refuses
                    cells.append(f"err {type(e).__name__}"[:18])
            print(f"{name:8s} {m:4d}  {t_f*1e6:7.1f}({w.numel()*2/t_f/1e9:5.0f})  " + "  ".join(c.ljust(20) for c in cells))
        del w
    x = torch.empty(8 << 30 >> 1, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    t = bench(lambda: y.copy_(x), reps=10)
    print(f"copy bandwidth (read): {x.numel()*2/t/1e12:.2f} TB/s")
    del x, y


def profile_decode(name: str, layers: int | None) -> None:
    model = random_model(name, "cuda", torch.bfloat16, n_layers=layers)
    cache = model.new_cache(256)
    tok = int(model.prime(list(range(1, 33)), cache).argmax())
    for _ in range(3):
        tok = int(model.decode_step(tok, cache).argmax())
    torch.cuda.synchronize()
    n = 20
    t0 = time.perf_counter()
    for _ in range(n):
        tok = int(model.decode_step(tok, cache).argmax())
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / n
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            tok = int(model.decode_step(tok, cache).argmax())
        torch.cuda.synchronize()
    # kernels and copies only: a CPU op (aten::copy_) also carries the device time of what it launched
    rows = sorted((e for e in prof.key_averages() if e.device_type.name == "CUDA"),
                  key=lambda e: -getattr(e, "self_device_time_total", 0))
    gpu_total = sum(getattr(e, "self_device_time_total", 0) for e in rows) / 5 / 1e6
    launches = sum(e.count for e in rows if getattr(e, "self_device_time_total", 0) > 0) / 5
    wbytes = sum(t.numel() * t.element_size() for t in _weights(model))
    print(f"\n== {name} ({model.cfg.n_layers} layers) B=1 decode ==")
    print(f"wall {wall*1e3:.2f} ms/step; GPU kernels {gpu_total*1e3:.2f} ms/step; ~{launches:.0f} kernels/step; "
          f"weights {wbytes/1e9:.2f} GB -> kernel-time bandwidth {wbytes/gpu_total/1e12:.2f} TB/s")
    for e in rows[:12]:
        print(f"  {getattr(e, 'self_device_time_total', 0)/5/1e3:8.3f} ms  x{e.count/5:5.0f}  {e.key[:90]}")


def _weights(model):
    seen = {}
    for obj in [model] + model.blocks:
        stack = [obj]
        while stack:
            o = stack.pop()
            for v in vars(o).values():
                if isinstance(v, torch.Tensor) and v.is_cuda and v.numel() > 1024:
                    seen[v.data_ptr()] = v
                elif hasattr(v, "__dict__") and not isinstance(v, (torch.Tensor, type)) and v is not model:
                    stack.append(v)
    return list(seen.values())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--skip-linear", action="store_true")
    a = ap.parse_args()
    if not a.skip_linear:
        linear_table()
    profile_decode(a.model, a.layers)


if __name__ == "__main__":
    main()
