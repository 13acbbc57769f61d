"""The batch-invariant linears at large M against the bf16 peak and cuBLAS, and the persistent kernel's tile
candidates (run through the device tool, on one GPU):

    python tools/gpu_tune_linear.py [--quick] [--ms 256,512,1024,2048,4096,8192] [--buckets]

For each M and each projection of the Llama-3-8B and Qwen3.5-9B layers (SHAPES; the lm_heads are left out:
a prefill wave computes logits for its last rows only), run as the model runs it (gate_up with SwiGLU in the
epilogue, down with the residual add, the rest plain), it prints TFLOP/s and the share of the dense bf16 peak
(taken from the device's name) of: cuBLAS (F.linear alone, no epilogue), the bucket kernel memra runs today
(triton.linear), the persistent kernel as frozen (linear_persistent.PERSISTENT_CONFIG) and the best of its
candidates. Every Triton output is compared bit for bit with the reference configuration's (the bucket
kernel at its frozen 64x32x64 tile) on the same inputs: a candidate whose bits differ anywhere is never
eligible, and is named. A candidate that fails (compile, shared memory, launch) prints its error once and is
dropped; the sweep goes on. It ends with a table per M and model (the layer's time, weighted by how often
each projection occurs) and the candidate it would freeze per bucket. --buckets instead tunes the bucket
kernel's tiles at small M (the LINEAR_BUCKETS sweep). About 3-4 minutes on an H100; --quick about 90 s.
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
from memra.kernels.triton import linear_persistent as P  # noqa: E402

# (N, K, weight): the projections of one layer of each shape (9B: 3 GDN layers per attention layer).
SHAPES = {
    "l8b.qkv": (6144, 4096, 32), "l8b.o": (4096, 4096, 32), "l8b.gate_up": (28672, 4096, 32), "l8b.down": (4096, 14336, 32),
    "l8b.lm_head": (128256, 4096, 1),
    "q9b.attn_qkv": (10240, 4096, 8), "q9b.attn_o": (4096, 4096, 8), "q9b.gdn_in": (12352, 4096, 24), "q9b.gdn_o": (4096, 4096, 24),
    "q9b.gate_up": (24576, 4096, 32), "q9b.down": (4096, 12288, 32), "q9b.lm_head": (248320, 4096, 1),
}
DEVICE = "cuda"
REFERENCE = (64, 32, 64, 4, 4)  # the single tile memra used before M buckets: the bits every config must give
# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, GROUP_M, FLATTEN, EPILOGUE_SPLIT); fit_shared_memory trims each
# variant (the residual's epilogue to halves, then fewer stages) to what sm_90 gives a block.
PERSISTENT_CANDIDATES = [
    (128, 256, 64, 8, 3, 8, True, 1), (128, 256, 64, 8, 3, 8, False, 1), (128, 256, 64, 8, 3, 8, True, 2),
    (128, 256, 64, 8, 4, 8, True, 2), (128, 128, 64, 8, 4, 8, True, 1), (128, 128, 64, 4, 4, 8, True, 1),
    (128, 128, 128, 8, 3, 8, True, 1), (256, 128, 64, 8, 3, 8, True, 1), (128, 256, 64, 8, 3, 16, True, 1),
    (128, 128, 64, 8, 4, 16, False, 1), (64, 128, 64, 4, 4, 8, True, 1), (128, 64, 64, 4, 4, 8, True, 1),
    (128, 128, 64, 8, 3, 8, False, 2), (64, 256, 64, 4, 3, 8, True, 1),
]
# At decode's M (64-256 rows) the step streams the weights: tall narrow tiles, enough of them to fill the SMs.
SMALL_M_CANDIDATES = [
    (64, 128, 64, 4, 4, 8, True, 1), (128, 64, 64, 4, 4, 8, True, 1), (128, 32, 128, 4, 4, 8, True, 1),
    (128, 64, 128, 4, 4, 8, True, 1), (64, 64, 128, 4, 4, 8, True, 1), (64, 32, 128, 4, 5, 8, True, 1),
    (128, 32, 64, 4, 6, 8, True, 1), (64, 128, 128, 4, 3, 8, True, 1), (128, 128, 64, 4, 4, 8, True, 1),
    (128, 64, 128, 8, 4, 8, True, 1),
]
QUICK_CANDIDATES = [(128, 256, 64, 8, 3, 8, True, 1), (128, 128, 64, 8, 4, 8, True, 1), (128, 256, 64, 8, 3, 8, False, 2)]


def kind(name: str) -> str:
    return "swiglu" if name.endswith("gate_up") else "residual" if name.endswith("down") else "plain"


def dense_peak(name: str) -> tuple[float | None, str]:
    """Dense bf16 tensor-core peak in TFLOP/s from the device name (the vendor's sheet, without sparsity)."""
    n = name.upper()
    if "H100" in n and "PCIE" in n:
        return 756.0, "H100 PCIe: 756 TFLOP/s"
    if "H100" in n and "NVL" in n:
        return 835.0, "H100 NVL: 835 TFLOP/s"
    if "H100" in n or "H200" in n or "H800" in n:
        return 989.0, "H100 / H200 SXM: 989 TFLOP/s"
    if "A100" in n:
        return 312.0, "A100: 312 TFLOP/s"
    return None, "unknown card: no peak, shares not printed"


def bucket_ref(x, w, r, how, cfg=REFERENCE):
    """The bucket kernel at a tile, launched directly; at REFERENCE: the bits every candidate must give."""
    bm, bn, bk, warps, stages = cfg
    m, k = x.shape
    n = w.shape[0] // 2 if how == "swiglu" else w.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    rr = r if how == "residual" else y
    T._linear_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
        x, w, w, rr, y, m, n, k, x.stride(0), w.stride(0), rr.stride(0), y.stride(0), HAS_BIAS=False,
        HAS_RESIDUAL=how == "residual", IEEE=T._interpreting(), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        SWIGLU=how == "swiglu", LIBDEVICE=not T._interpreting(), num_warps=warps, num_stages=stages)
    return y


def bucket_now(x, w, r, how):
    """What memra runs today at this M (triton.linear's bucket)."""
    if how == "swiglu":
        return T.linear_silu_mul(x, w)
    return T.linear(x, w, residual=r if how == "residual" else None)


def persistent(cfg):
    return lambda x, w, r, how: P.persistent_linear(x, w, residual=r if how == "residual" else None,
                                                    swiglu=how == "swiglu", config=cfg)


def cublas(x, w, r, how):
    return F.linear(x, w)


def bench(fn, flops: float) -> float:
    """Seconds per call, from a CUDA graph of back-to-back calls: the GPU's time, not Python's launch overhead."""
    reps = int(max(3, min(20, 2e11 / flops)))
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


def sweep_large(ms: list[int], cands: list[tuple]) -> None:
    name = torch.cuda.get_device_name()
    peak, why = dense_peak(name)
    print(f"device: {name}; dense bf16 peak {why}; Triton {triton.__version__}, torch {torch.__version__}")
    P.install_scratch()
    g = torch.Generator(device=DEVICE).manual_seed(0)
    projs = {nm: v for nm, v in SHAPES.items() if not nm.endswith("lm_head")}
    weights = {nm: torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16, generator=g) * 0.02 for nm, (n, k, _) in projs.items()}
    impls = {"cuBLAS": cublas, "bucket": bucket_now, "frozen": persistent(P.PERSISTENT_CONFIG)}
    impls.update({f"P{i}": persistent(c) for i, c in enumerate(cands)})
    for i, c in enumerate(cands):
        print(f"  P{i} = {c}{'  (frozen)' if c == P.PERSISTENT_CONFIG else ''}")
    dropped: set[str] = set()
    times: dict[tuple[int, str, str], float] = {}  # (m, projection, impl) -> seconds
    pct = lambda tf: f"{100 * tf / peak:3.0f}%" if peak else "  -"  # noqa: E731
    for m in ms:
        xs = {k: torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16, generator=g) for k in {k for _, k, _ in projs.values()}}
        for nm, (n, k, _) in projs.items():
            how, x, w = kind(nm), xs[k], weights[nm]
            r = torch.randn(m, n, device=DEVICE, dtype=torch.bfloat16, generator=g) if how == "residual" else None
            flops = 2.0 * m * n * k
            try:
                ref = bucket_ref(x, w, r, how)
            except Exception as e:  # noqa: BLE001 -- no reference, no comparison: say so and go on
                print(f"M={m} {nm}: the reference failed: {type(e).__name__}: {str(e)[:200]}")
                continue
            cells = []
            for label, fn in impls.items():
                if label in dropped:
                    continue
                try:
                    if label != "cuBLAS" and not torch.equal(fn(x, w, r, how), ref):
                        print(f"M={m} {nm}: {label} gives OTHER BITS than the reference tile: never eligible")
                        dropped.add(label)
                        continue
                    t = bench(lambda: fn(x, w, r, how), flops)
                except Exception as e:  # noqa: BLE001 -- a candidate the compiler or the GPU refuses
                    print(f"M={m} {nm}: {label} failed, dropped: {type(e).__name__}: {str(e)[:300]}")
                    dropped.add(label)
                    torch.cuda.synchronize()
                    continue
                times[(m, nm, label)] = t
                if label in ("cuBLAS", "bucket", "frozen"):
                    cells.append(f"{label} {flops / t / 1e12:4.0f} TF {pct(flops / t / 1e12)}")
            best = min(((times[(m, nm, lb)], lb) for lb in impls if lb.startswith("P") and (m, nm, lb) in times), default=None)
            if best:
                cells.append(f"best {best[1]} {flops / best[0] / 1e12:4.0f} TF {pct(flops / best[0] / 1e12)}")
            print(f"M={m:5d} {nm:13s} {how:8s} " + " | ".join(cells), flush=True)
        del xs
    summary(ms, projs, impls, times, dropped, peak, cands)


def summary(ms, projs, impls, times, dropped, peak, cands) -> None:
    def layer(m, model, label):
        names = [nm for nm in projs if nm.startswith(model)]
        if any((m, nm, label) not in times for nm in names):
            return None
        return sum(times[(m, nm, label)] * projs[nm][2] for nm in names)

    def flops(m, model):
        return sum(2.0 * m * n * k * w for nm, (n, k, w) in projs.items() if nm.startswith(model))

    print("\nlayer time (ms, weighted by projection count) and share of the dense peak")
    print("    M  model   cuBLAS          bucket          frozen          best candidates")
    cand_labels = [lb for lb in impls if lb.startswith("P") and lb not in dropped]
    for m in ms:
        for model in ("l8b", "q9b"):
            row = []
            for label in ("cuBLAS", "bucket", "frozen"):
                t = layer(m, model, label)
                row.append(f"{t * 1e3:7.3f} {100 * flops(m, model) / t / 1e12 / peak:3.0f}%" if t and peak else
                           f"{t * 1e3:7.3f}  -  " if t else "   n/a      ")
            ranked = sorted((t, lb) for lb in cand_labels if (t := layer(m, model, lb)) is not None)
            best = ", ".join(f"{t * 1e3:7.3f} {lb}" for t, lb in ranked[:3]) if ranked else "n/a"
            print(f"{m:5d}  {model}  " + "  ".join(f"{c:14s}" for c in row) + f"  {best}")
    # the freeze: one tile for all M of a bucket, the least total layer time over both models and the bucket's Ms
    bucket_ms = {"M in (256, 512]": [m for m in ms if 256 < m <= 512], "M > 512": [m for m in ms if m > 512],
                 "M = 256 (today: the bucket kernel)": [m for m in ms if m == 256]}
    print()
    for bucket, bms in bucket_ms.items():
        if not bms:
            continue
        total = {}
        for lb in cand_labels + ["bucket"]:
            ts = [layer(m, model, lb) for m in bms for model in ("l8b", "q9b")]
            if all(t is not None for t in ts):
                total[lb] = sum(ts)
        if not total:
            print(f"freeze for {bucket}: no candidate ran at every M")
            continue
        lb = min(total, key=total.get)
        what = "the bucket kernel (leave the persistent kernel out here)" if lb == "bucket" else \
            f"{lb} = {cands[int(lb[1:])]}"
        print(f"freeze for {bucket}: {what}; {total['bucket'] / total[lb]:.2f}x the bucket kernel"
              if "bucket" in total else f"freeze for {bucket}: {what}")


def bucket_candidates(m: int) -> list[tuple[int, int, int, int, int]]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) worth trying for the bucket kernel at this M. Up to 256 rows
    a decode step is bound by reading the weights, so the candidates there include tiles as tall as the
    bucket (every weight tile read by one program) with narrow columns (enough programs to fill the SMs)."""
    if m <= 16:
        return [(16, bn, bk, w, s) for bn in (16, 32, 64) for bk in (64, 128, 256) for w in (2, 4)
                for s in (3, 4, 5) if not (bk == 256 and s == 5)]
    if m <= 64:
        return [(bm, bn, bk, 4, s) for bm in (32, 64) for bn in (32, 64, 128) for bk in (64, 128)
                for s in (3, 4)]
    tall = (128,) if m <= 128 else (128, 256)
    return [(64, 128, 128, 4, 4)] + [(bm, bn, bk, w, s) for bm in tall for bn in (16, 32, 64, 128)
                                     for bk in (64, 128) for w in (4, 8) for s in (3, 4)
                                     if (bm + bn) * bk * 2 * s <= 220 * 1024 and not (bm == 256 and bn == 16)]


def sweep_buckets(ms: list[int]) -> None:
    """The bucket kernel's tile per M (plain projections, lm_heads included), as LINEAR_BUCKETS was chosen."""
    weights = {nm: torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16) * 0.02 for nm, (n, k, _) in SHAPES.items()}
    for m in ms:
        xs = {nm: torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16) for nm, (_, k, _) in SHAPES.items()}
        refs = {nm: bucket_ref(xs[nm], weights[nm], None, "plain") for nm in SHAPES}
        fl = {nm: 2.0 * m * SHAPES[nm][0] * SHAPES[nm][1] for nm in SHAPES}
        results = []
        for cfg in bucket_candidates(m):
            try:
                same = all(torch.equal(bucket_ref(xs[nm], weights[nm], None, "plain", cfg), refs[nm]) for nm in SHAPES)
                ts = {nm: bench(lambda: bucket_ref(xs[nm], weights[nm], None, "plain", cfg), fl[nm]) for nm in SHAPES}
            except Exception as e:  # noqa: BLE001 -- a config the compiler refuses (shared memory)
                print(f"M={m} {cfg}: {type(e).__name__}: {str(e)[:200]}")
                continue
            results.append((cfg, same, ts))
        if bad := [r[0] for r in results if not r[1]]:
            print(f"M={m}: configs whose bits DIFFER from the reference: {bad}")
        for model in ("l8b", "q9b"):
            total = lambda ts: sum(ts[nm] * SHAPES[nm][2] for nm in SHAPES if nm.startswith(model))  # noqa: E731
            weight_bytes = sum(2 * n * k * c for nm, (n, k, c) in SHAPES.items() if nm.startswith(model))
            ranked = sorted((total(ts), cfg) for cfg, same, ts in results if same)
            now = next((total(ts) for cfg, same, ts in results if cfg == T.linear_config(m)), None)
            print(f"M={m:5d} {model}: LINEAR_BUCKETS' tile {T.linear_config(m)}: "
                  + (f"{now * 1e3:.3f} ms, weights read at {weight_bytes / now / 1e12:.2f} TB/s" if now else "not swept"))
            print(f"M={m:5d} {model}: best " + ", ".join(f"{c}={t * 1e3:.3f} ms ({weight_bytes / t / 1e12:.2f} TB/s)"
                                                         for t, c in ranked[:5]), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default=None, help="row counts (default 256..8192; --quick 256,1024,4096)")
    ap.add_argument("--quick", action="store_true", help="three persistent candidates at three M (~90 s)")
    ap.add_argument("--buckets", action="store_true", help="tune the bucket kernel's tiles at small M instead")
    ap.add_argument("--small", action="store_true", help="the persistent kernel's narrow tiles (decode's M: 64-256)")
    a = ap.parse_args()
    torch.manual_seed(0)
    if a.buckets:
        sweep_buckets([int(s) for s in (a.ms or "1,4,16,32,64,128,256").split(",")])
        return
    ms = [int(s) for s in (a.ms or ("256,1024,4096" if a.quick else "256,512,1024,2048,4096,8192")).split(",")]
    cands = QUICK_CANDIDATES if a.quick else SMALL_M_CANDIDATES if a.small else PERSISTENT_CANDIDATES
    sweep_large(ms, cands)


if __name__ == "__main__":
    main()
