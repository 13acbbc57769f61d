"""Choose the batch-invariant linear kernel's tile configuration per M bucket (run through the device tool):

    python tools/gpu_tune_linear.py [--ms 1,4,16,32,64,128,256,4096] [--quick]

Every candidate runs the same kernel (memra.kernels.triton.linear._linear_kernel): fp32 accumulation, K walked
in order. Its output is compared bit for bit with the reference configuration's (the frozen 64x32x64) on
the same input; a candidate whose bits differ anywhere is never eligible. For each M the table prints the
time of each eligible candidate summed over one decoder layer of the Llama-3-8B and Qwen3.5-9B shapes
(weighted by how often each projection occurs) plus their lm_heads, and F.linear (cuBLAS) for scale.
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

# (N, K, weight): the projections of one layer of each shape (9B: 3 GDN layers per attention layer).
SHAPES = {
    "l8b.qkv": (6144, 4096, 32), "l8b.o": (4096, 4096, 32), "l8b.gate_up": (28672, 4096, 32), "l8b.down": (4096, 14336, 32),
    "l8b.lm_head": (128256, 4096, 1),
    "q9b.attn_qkv": (10240, 4096, 8), "q9b.attn_o": (4096, 4096, 8), "q9b.gdn_in": (12352, 4096, 24), "q9b.gdn_o": (4096, 4096, 24),
    "q9b.gate_up": (24576, 4096, 32), "q9b.down": (4096, 12288, 32), "q9b.lm_head": (248320, 4096, 1),
}


def candidates(m: int) -> list[tuple[int, int, int, int, int]]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) worth trying at this M."""
    if m <= 16:
        return [(bm, bn, bk, w, s) for bm in (16,) for bn in (16, 32, 64) for bk in (64, 128, 256) for w in (2, 4)
                for s in (3, 4, 5) if not (bk == 256 and s == 5)]
    if m <= 128:
        return [(bm, bn, bk, w, s) for bm in (32, 64) for bn in (32, 64, 128) for bk in (64, 128) for w in (4,)
                for s in (3, 4)] + [(128, 64, 64, 4, 3), (128, 128, 64, 8, 3)]
    return [(bm, bn, bk, w, s) for bm in (64, 128) for bn in (64, 128, 256) for bk in (64,) for w in (4, 8)
            for s in (3, 4) if not (bm == 128 and bn == 256 and s == 4)]


def run(x, w, cfg):
    bm, bn, bk, warps, stages = cfg
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    T._linear_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
        x, w, w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0), HAS_BIAS=False, IEEE=False,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
    return y


def bench(fn, out_bytes: int) -> float:
    """Seconds per call, from a CUDA graph of `reps` back-to-back calls: the GPU's time, not Python's
    launch overhead (which a decode step captured in a graph does not pay either)."""
    reps = int(max(2, min(20, 4e9 // out_bytes)))  # each captured call keeps its own output
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / (3 * reps)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="1,4,16,32,64,128,256,4096")
    a = ap.parse_args()
    torch.manual_seed(0)
    weights = {name: torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for name, (n, k, _) in SHAPES.items()}
    frozen = (64, 32, 64, 4, 4)  # the single tile memra used before M buckets
    summary = []
    for m in [int(s) for s in a.ms.split(",")]:
        xs = {name: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for name, (_, k, _) in SHAPES.items()}
        refs = {name: run(xs[name], weights[name], frozen) for name in SHAPES}
        ob = {name: m * SHAPES[name][0] * 2 for name in SHAPES}
        cublas = {name: bench(lambda: F.linear(xs[name], weights[name]), ob[name]) for name in SHAPES}
        results = []
        for cfg in candidates(m) + [frozen]:
            try:
                same = all(torch.equal(run(xs[nm], weights[nm], cfg), refs[nm]) for nm in SHAPES)
                times = {nm: bench(lambda: run(xs[nm], weights[nm], cfg), ob[nm]) for nm in SHAPES}
            except Exception as e:  # noqa: BLE001 — a config the compiler refuses (shared memory)
                print(f"M={m} {cfg}: {type(e).__name__}")
                continue
            results.append((cfg, same, times))
        bad = [r[0] for r in results if not r[1]]
        if bad:
            print(f"M={m}: configs whose bits DIFFER from the frozen one: {bad}")
        for model in ("l8b", "q9b"):
            total = lambda times: sum(times[nm] * SHAPES[nm][2] for nm in SHAPES if nm.startswith(model))  # noqa: E731
            ranked = sorted((total(t), cfg) for cfg, same, t in results if same)
            tc = total(cublas)
            tf = total(next(t for cfg, _, t in results if cfg == frozen))
            print(f"M={m:5d} {model}: cuBLAS {tc*1e3:7.3f} ms  frozen {tf*1e3:7.3f}  best " +
                  ", ".join(f"{c}={t*1e3:.3f}" for t, c in ranked[:4]))
            summary.append((m, model, tc, tf, ranked[0][0], ranked[0][1]))
        per_shape = {nm: min((t[nm], cfg) for cfg, same, t in results if same) for nm in SHAPES}
        for nm, (t, cfg) in per_shape.items():
            n, k, _ = SHAPES[nm]
            print(f"    {nm:14s} best {cfg} {t*1e6:8.1f} us ({n*k*2/t/1e9:5.0f} GB/s; {2*m*n*k/t/1e12:6.1f} TFLOP/s)"
                  f"  cuBLAS {cublas[nm]*1e6:8.1f} us")
    print("\n   M  model  cuBLAS ms  frozen ms  best ms  best config")
    for m, model, tc, tf, tb, cfg in summary:
        print(f"{m:5d}  {model}  {tc*1e3:9.3f}  {tf*1e3:9.3f}  {tb*1e3:7.3f}  {cfg}")


if __name__ == "__main__":
    main()
