"""Is cuBLAS row-invariant on this GPU, and what would it save? One process per setting:

    python tools/gpu_probe_cublas.py --setting default     # torch's defaults (cuBLAS, split-K allowed)
    python tools/gpu_probe_cublas.py --setting nosplit     # cuBLASLt, allow_bf16_reduced_precision_reduction=(False, False)
    python tools/gpu_probe_cublas.py --setting nosplit-ws1 # and CUBLASLT_WORKSPACE_SIZE=1, CUBLAS_WORKSPACE_CONFIG=:16:8

For every projection of the Llama-3-8B and Qwen3.5-9B shapes (gpu_tune_linear.SHAPES, lm_heads included),
F.linear over the first M rows of one fixed [8192, K] input, for M in a dense sweep (every M to 256, every
third to 1,024, every 256th to 8,192), is compared bit for bit with the same rows of the 8,192-row call; a
few windows that do not start at row 0, and a few calls inside a CUDA graph, likewise; and at a few M with
memra's own kernels' rows (where those are equal, the two could share a weight across row counts). A row-invariant
setting prints 0 mismatching M for every shape. Then the model's linears (each projection times its
count, as the model runs them: gate_up then silu_mul, o and down then the residual add) through cuBLAS
against memra's kernels (linear_persistent's routing, today's default), with weights cycled through four
copies so none is re-read from L2. About a minute an H100 per setting.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

SETTINGS = ("default", "nosplit", "nosplit-ws1")


def _env(setting: str) -> None:
    """Workspace sizes are read when torch first makes a cuBLAS handle, so they are set before torch loads."""
    if setting == "nosplit-ws1":
        os.environ["CUBLASLT_WORKSPACE_SIZE"] = "1"
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":16:8"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--setting", choices=SETTINGS, default="nosplit")
    ap.add_argument("--time-ms", default="1,16,64,96,128,256,512,772,896,1024,4096", help="row counts timed ('' for none)")
    a = ap.parse_args()
    _env(a.setting)
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_tune_linear import SHAPES, bench, kind
    from gpu_tune_shaped import COPIES, cycling

    from memra.kernels.triton import linear_persistent as P
    from memra.kernels.triton.activation import silu_mul

    if a.setting != "default":
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = (False, False)
        torch.backends.cuda.preferred_blas_library("cublaslt")
    P.install_scratch()
    g = torch.Generator(device="cuda").manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, setting {a.setting}", flush=True)
    sweep = list(range(1, 257)) + list(range(259, 1025, 3)) + list(range(1280, 8193, 256))
    invariant = {}
    for nm, (n, k, _) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
        x = torch.randn(8192 + 64, k, device="cuda", dtype=torch.bfloat16, generator=g)
        ref = F.linear(x[:8192], w)
        bad = [m for m in sweep if not torch.equal(F.linear(x[:m], w), ref[:m])]
        shifted = [(s, m) for s in (1, 7, 64) for m in (1, 5, 64, 200, 1000)
                   if not torch.equal(F.linear(x[s:s + m], w), ref[s:s + m])]
        graphed = []
        for m in (1, 64, 128, 256, 512):
            out = F.linear(x[:m], w)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = F.linear(x[:m], w)
            graph.replay()
            if not torch.equal(out, ref[:m]):
                graphed.append(m)
        invariant[nm] = not (bad or shifted or graphed)
        # and against memra's kernels' bits (if equal, the two could share a weight across row counts)
        ours = [m for m in (1, 16, 17, 64, 128, 256, 257, 512, 1024, 4096)
                if torch.equal(P.linear(x[:m], w), ref[:m])]
        print(f"{nm:14s} {len(sweep)} M: {len(bad)} differ {bad[:8]}; windows off row 0 differ {shifted[:4]}; "
              f"graphed differ {graphed}; equal to memra's at M {ours}", flush=True)
        del w, x, ref
        torch.cuda.empty_cache()

    rows = []
    for m in [int(v) for v in a.time_ms.split(",") if v]:
        total = {"l8b": [0.0, 0.0], "q9b": [0.0, 0.0]}
        for nm, (n, k, count) in SHAPES.items():
            if nm.endswith("lm_head") and m > 1024:
                continue  # the head runs on sampled rows only
            how = kind(nm)
            ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02 for _ in range(COPIES)]
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
            nout = n // 2 if how == "swiglu" else n
            r = torch.randn(m, nout, device="cuda", dtype=torch.bfloat16, generator=g) if how == "residual" else None
            if how == "swiglu":
                ours, theirs = (lambda w: P.linear_silu_mul(x, w)), (lambda w: silu_mul(F.linear(x, w)))
            elif how == "residual":
                ours, theirs = (lambda w: P.linear(x, w, residual=r)), (lambda w: r + F.linear(x, w))
            else:
                ours, theirs = (lambda w: P.linear(x, w)), (lambda w: F.linear(x, w))
            flops = 2.0 * m * n * k
            t_ours, t_cublas = bench(cycling(ours, ws), flops), bench(cycling(theirs, ws), flops)
            total[nm[:3]][0] += t_ours * count
            total[nm[:3]][1] += t_cublas * count
            del ws
        for model, (t_o, t_c) in total.items():
            rows.append((m, model, t_o, t_c))
        torch.cuda.empty_cache()
    print(f"\nsetting {a.setting}: row-invariant on every shape: {all(invariant.values())} "
          f"({sum(invariant.values())} of {len(invariant)})")
    print("    M  model   memra ms  cuBLAS ms  ratio   (each projection times its count, epilogue ops included)")
    for m, model, t_o, t_c in rows:
        print(f"{m:5d}  {model}   {t_o * 1e3:8.3f}  {t_c * 1e3:9.3f}  {t_o / t_c:5.2f}")


if __name__ == "__main__":
    main()
