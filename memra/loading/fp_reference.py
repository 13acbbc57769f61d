"""The FP8 block-scaled and NVFP4 formats, defined bit by bit in plain torch, and quantizers that write them.

This is the formats' meaning, written to be read, not to be fast: memra.loading.fp_formats (what the
loader runs) must equal `fp8_block_reference` / `nvfp4_reference` bit for bit, and tests hold it to that.
Conventions (tensor names, packing, scale meaning) are the ones documented in memra.loading.fp_formats.

The quantizers are what tools/make_fixture_quant.py uses to make the test checkpoints, written after
the writers' own code: FP8 blocks as transformers' Fp8Quantize (scale = 448 / amax of the block, values
clamped to +-448 and cast; `weight_scale_inv` = 1 / scale), NVFP4 as modelopt's NVFP4QTensor.quantize
(weight_scale_2 = amax / (6 * 448); each 16-value group's scale amax / (6 * weight_scale_2), 1 where 0,
clamped to [2^-9, 448] and cast to fp8; values divided by scale * weight_scale_2 and rounded to the
nearest e2m1 value, ties to the even mantissa). compressed-tensors stores the per-tensor scale inverted
(`weight_global_scale` = 6 * 448 / amax).
"""

from __future__ import annotations

import math

import torch

from memra.loading.fp_formats import FP8_MAX, NVFP4_GROUP

E2M1_MAX = 6.0


def e4m3_value(byte: int) -> float:
    """float8_e4m3fn: sign | 4 exponent bits (bias 7) | 3 mantissa bits; no infinities, and S.1111.111 is NaN."""
    sign = -1.0 if byte & 0x80 else 1.0
    exponent, mantissa = (byte >> 3) & 0xF, byte & 0x7
    if exponent == 0xF and mantissa == 0x7:
        return math.nan
    if exponent == 0:  # subnormal: 2^-6 * m/8
        return sign * math.ldexp(mantissa / 8, -6)
    return sign * math.ldexp(1 + mantissa / 8, exponent - 7)


def e2m1_value(nibble: int) -> float:
    """e2m1 (fp4): sign | 2 exponent bits (bias 1) | 1 mantissa bit; every code is a number."""
    sign = -1.0 if nibble & 0x8 else 1.0
    exponent, mantissa = (nibble >> 1) & 0x3, nibble & 0x1
    if exponent == 0:  # subnormal: 0 or 0.5
        return sign * mantissa * 0.5
    return sign * math.ldexp(1 + mantissa / 2, exponent - 1)


def _table(fn, n: int) -> torch.Tensor:
    return torch.tensor([fn(i) for i in range(n)], dtype=torch.float32)  # every value is exact in fp32


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).long()


def fp8_block_reference(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """weight float8_e4m3fn [R, C], scale_inv [ceil(R/br), ceil(C/bc)] -> float32 [R, C]:
    value[i, j] = e4m3(weight[i, j]) * scale_inv[i // br, j // bc], one fp32 multiply."""
    rows, cols = weight.shape
    values = _table(e4m3_value, 256)[_bytes(weight)]  # [R, C]
    i = torch.arange(rows).view(-1, 1) // block[0]
    j = torch.arange(cols).view(1, -1) // block[1]
    return values * scale_inv.float()[i, j]


def nvfp4_reference(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
                    inverted_global: bool) -> torch.Tensor:
    """packed uint8 [R, C/2] (column 2k in the low nibble of byte k, 2k+1 in the high one), scale fp8
    [R, ceil(C/16)], global one fp32 -> float32 [R, C]: e2m1 * (e4m3(scale) * global), or `/ global`
    when the global is stored inverted (compressed-tensors)."""
    rows, half = packed.shape
    b = packed.long()
    nibble = torch.empty(rows, 2 * half, dtype=torch.long)
    nibble[:, 0::2], nibble[:, 1::2] = b & 0xF, b >> 4
    values = _table(e2m1_value, 16)[nibble]
    group_scale = _table(e4m3_value, 256)[_bytes(scale)]  # [R, G]
    g = global_scale.float().reshape(())
    group_scale = group_scale / g if inverted_global else group_scale * g
    j = torch.arange(2 * half) // NVFP4_GROUP
    return values * group_scale[:, j]


# --- quantizers (for fixtures and round trips) ---------------------------------------------------------


def _pad_to(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, cols - x.shape[1], 0, rows - x.shape[0]))


def fp8_block_quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """float [R, C] -> (float8_e4m3fn [R, C], weight_scale_inv float32 [ceil(R/br), ceil(C/bc)])."""
    rows, cols = w.shape
    br, bc = block
    gr, gc = -(-rows // br), -(-cols // bc)
    blocks = _pad_to(w.float(), gr * br, gc * bc).view(gr, br, gc, bc)
    amax = blocks.abs().amax(dim=(1, 3))  # [gr, gc]
    scale = torch.where(amax > 0, FP8_MAX / amax, torch.ones_like(amax))
    q = (blocks * scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(gr * br, gc * bc)[:rows, :cols].contiguous(), (1.0 / scale).float()


def _e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """float -> nearest e2m1 code (uint8 0..15), magnitudes clamped to 6, ties to the even mantissa."""
    mags = _table(e2m1_value, 8)  # 0 .. 6
    a = x.abs().clamp(max=E2M1_MAX).unsqueeze(-1)
    dist = (a - mags).abs()
    # prefer even codes on ties: add a tiny penalty to odd codes that never outweighs a real difference
    code = (dist + (torch.arange(8) % 2) * 1e-7).argmin(dim=-1)
    return (code | ((x < 0).long() << 3)).to(torch.uint8)


def nvfp4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float [R, C] (C even) -> modelopt's (weight uint8 [R, C/2], weight_scale fp8 [R, ceil(C/16)],
    weight_scale_2 float32 [])."""
    rows, cols = w.shape
    groups = -(-cols // NVFP4_GROUP)
    x = _pad_to(w.float(), rows, groups * NVFP4_GROUP).view(rows, groups, NVFP4_GROUP)
    amax = w.float().abs().max()
    scale_2 = amax / (E2M1_MAX * FP8_MAX) if amax > 0 else torch.tensor(1.0)
    per_group = x.abs().amax(dim=-1) / (E2M1_MAX * scale_2)
    per_group = torch.where(per_group == 0, torch.ones_like(per_group), per_group)
    scale = per_group.clamp(min=2 ** -9, max=FP8_MAX).to(torch.float8_e4m3fn)  # [R, G]
    codes = _e2m1_codes(x / (scale.float() * scale_2).unsqueeze(-1)).view(rows, -1)[:, :cols]
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.contiguous(), scale, scale_2.float().reshape(())
