"""MEMRA_LINEAR_SHAPED's tiles (memra.kernels.triton.linear_shaped) against today's, per projection and row
count, on one GPU:

    python tools/gpu_tune_shaped.py [--ms 128,192,256,384,512,772]

For every projection of the Llama-3-8B and Qwen3.5-9B layers (gpu_tune_linear.SHAPES, lm_heads left out),
run as the model runs it (gate_up with SwiGLU, down with the residual add): today's tile (the bucket
kernel's up to 256 rows, PERSISTENT_CONFIG above), the cost model's pick, every candidate of
linear_shaped.BUCKET_TILES / PERSISTENT_TILES, and cuBLAS. Every candidate's output is compared bit for bit
with today's tile's (a tile never changes bits; one that did would print nan). A call cycles through
COPIES copies of its weight, so a weight smaller than L2 (o: 32 MB, qkv: 48 MB) is not re-read from it as a
single copy would be. It ends with the model's linears (each projection times its count) per M: today, the
pick, the best candidate, cuBLAS. About 2 minutes on an H100.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_tune_linear import SHAPES, bench, kind  # noqa: E402

from memra.kernels.triton import linear as T  # noqa: E402
from memra.kernels.triton import linear_persistent as P  # noqa: E402
from memra.kernels.triton import linear_shaped as S  # noqa: E402

COPIES = 4  # weight copies a timed call cycles through (L2: 50 MB on an H100)


def cycling(fn, ws):
    """fn(w) over the copies in turn: each call of the returned function takes the next copy."""
    state = {"i": 0}

    def call():
        state["i"] += 1
        return fn(ws[state["i"] % len(ws)])

    return call


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="128,192,256,384,512,772")
    ms = [int(v) for v in ap.parse_args().ms.split(",")]
    P.install_scratch()
    g = torch.Generator(device="cuda").manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name()}, {sms} SMs", flush=True)
    total: dict[tuple, float] = {}  # (m, model, label) -> seconds, each projection times its count
    for nm, (n, k, count) in SHAPES.items():
        if nm.endswith("lm_head"):
            continue
        how, swiglu = kind(nm), kind(nm) == "swiglu"
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02 for _ in range(COPIES)]
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
            r = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, generator=g) if how == "residual" else None
            if m > P.PERSISTENT_ABOVE:
                tiles, pick = S.PERSISTENT_TILES, S.persistent_tile(m, n, k, sms)
                run = lambda c, w: P.persistent_linear(x, w, residual=r, swiglu=swiglu, config=c)  # noqa: E731
            else:
                tiles, pick = S.BUCKET_TILES, S.bucket_tile(m, n, k, sms)
                run = lambda c, w: (T.linear_silu_mul(x, w, config=c) if swiglu  # noqa: E731
                                    else T.linear(x, w, residual=r, config=c))
            today, flops = tiles[0][0], 2.0 * m * n * k
            ref = run(today, ws[0])
            times = {c: bench(cycling(lambda w, c=c: run(c, w), ws), flops) if torch.equal(run(c, ws[0]), ref)
                     else float("nan") for c, _ in tiles}
            cublas = bench(cycling(lambda w: F.linear(x, w), ws), flops)
            for label, t in (("today", times[today]), ("pick", times[pick]), ("best", min(times.values())),
                             ("cuBLAS", cublas)):
                total[(m, nm[:3], label)] = total.get((m, nm[:3], label), 0.0) + t * count
            print(f"{nm:13s} M={m:4d} today {times[today] * 1e6:6.1f} us, pick {pick[:2]} {times[pick] * 1e6:6.1f}, "
                  f"cuBLAS {cublas * 1e6:6.1f} | " + " ".join(f"{c[:2]}={t * 1e6:.1f}" for c, t in times.items()),
                  flush=True)
    print("\nthe model's linears, each projection times its count (ms)")
    print("    M  model    today     pick     best   cuBLAS")
    for m in ms:
        for model in ("l8b", "q9b"):
            print(f"{m:5d}  {model}  " + " ".join(f"{total[(m, model, lb)] * 1e3:8.3f}"
                                               for lb in ("today", "pick", "best", "cuBLAS")))


if __name__ == "__main__":
    main()
