"""What the fused RoPE + K/V write costs a layer on the GPU, one head a program against ROPE_TILE_HEADS
(MEMRA_ROPE_TILE), at the token counts of decode and mixed steps (run through the device tool):

    python tools/gpu_profile_rope.py [--tokens 1,64,256,770,2048]

Timed as a CUDA graph of back-to-back calls (gpu_tune_linear.bench), so the GPU's time without the host's
launch, as in a captured step. A profiler, not a check: the tiled launch's bits are tests/test_cuda_kernels.py's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from memra.kernels.triton import rope  # noqa: E402
from gpu_tune_linear import bench  # noqa: E402 - tools/, this script's folder

SHAPES = {"Llama-3-8B": (32, 8, 128, 128), "Qwen3.5 attention": (16, 4, 256, 64)}  # Hq, Hkv, D, rotated


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,64,256,770,2048")
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
            # bench's FLOP count only sets how many calls a graph holds: 1 gives its most, 20
            us = [bench(lambda h=h: rope.rope_write_kv(q, k, v, cos, sin, *pools, rows, h), 1.0) * 1e6
                  for h in (1, rope.ROPE_TILE_HEADS)]
            print(f"| {name} | {t} | {us[0]:.1f} | {us[1]:.1f} | {us[0] / us[1]:.2f}x |")


if __name__ == "__main__":
    main()
