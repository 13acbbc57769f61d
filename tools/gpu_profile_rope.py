"""What the fused RoPE + K/V write costs a layer on the GPU, one head a program against ROPE_TILE_HEADS
(MEMRA_ROPE_TILE), at the token counts of decode and mixed steps (run through the device tool):

    python tools/gpu_profile_rope.py [--tokens 1,64,256,770,2048] [--reps 200]

A profiler, not a check: the tiled launch's bits are tests/test_cuda_kernels.py's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from memra.kernels.triton import rope  # noqa: E402

SHAPES = {"Llama-3-8B": (32, 8, 128, 128), "Qwen3.5 attention": (16, 4, 256, 64)}  # Hq, Hkv, D, rotated


def us_a_call(fn, reps: int) -> float:
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,64,256,770,2048")
    ap.add_argument("--reps", type=int, default=200)
    a = ap.parse_args()
    print(f"| shape | tokens | one head a program, us | {rope.ROPE_TILE_HEADS} heads, us | ratio |  ({torch.cuda.get_device_name()})")
    print("|---|---|---|---|---|")
    for name, (hq, hkv, d, r) in SHAPES.items():
        for t in map(int, a.tokens.split(",")):
            qkv = torch.randn(t, (hq + 2 * hkv) * d, device="cuda").to(torch.bfloat16)
            q, k, v = (x.view(t, -1, d) for x in qkv.split([hq * d, hkv * d, hkv * d], dim=-1))
            cos, sin = torch.randn(t, r, device="cuda").to(torch.bfloat16), torch.randn(t, r, device="cuda").to(torch.bfloat16)
            pools = [torch.zeros(t // 16 + 1, 16, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
            rows = torch.arange(t, device="cuda")
            us = [us_a_call(lambda h=h: rope.rope_write_kv(q, k, v, cos, sin, *pools, rows, h), a.reps)
                  for h in (1, rope.ROPE_TILE_HEADS)]
            print(f"| {name} | {t} | {us[0]:.1f} | {us[1]:.1f} | {us[0] / us[1]:.2f}x |")


if __name__ == "__main__":
    main()
