"""FP8 block-scaled and NVFP4 weights to float32, in plain torch: what the loader runs.

The two formats, as their writers store them in safetensors (and as vLLM / transformers / modelopt /
compressed-tensors read them back):

FP8 block-scaled (DeepSeek-V3 / Qwen3 "-FP8" checkpoints; config.json `quantization_config`
  {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], ...}):
    `X.weight`            float8_e4m3fn [R, C]
    `X.weight_scale_inv`  float32 (or bf16) [ceil(R / 128), ceil(C / 128)]
  value[i, j] = float(weight[i, j]) * scale_inv[i // 128, j // 128], one fp32 multiply. The last block
  of a row or column may be ragged (R or C not a multiple of 128): it still has one scale. Followed:
  transformers `integrations/finegrained_fp8.py` (Fp8Dequantize: `q.to(float32) * s.to(float32)` per
  block, then `.to(dtype)`), DeepSeek-V3 `inference/kernel.py` weight_dequant (scale grid
  [cdiv(M, 128), cdiv(N, 128)], `y = x * s` in fp32).

NVFP4 (NVIDIA modelopt, quant_algo "NVFP4"; compressed-tensors format "nvfp4-pack-quantized"):
    modelopt:            `X.weight` uint8 [R, C/2], `X.weight_scale` float8_e4m3fn [R, C/16],
                         `X.weight_scale_2` float32 (one value), `X.input_scale` (activations; unused)
    compressed-tensors:  `X.weight_packed` uint8 [R, C/2], `X.weight_scale` float8_e4m3fn [R, C/16],
                         `X.weight_global_scale` float32 (one value), `X.input_global_scale` (unused)
  Each byte holds two e2m1 values, the even column in the low nibble and the odd one in the high nibble;
  a nibble is sign (bit 3) | exponent (bits 2-1) | mantissa (bit 0): magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6.
  Every 16 consecutive values of a row share one fp8 scale. The per-tensor scale is stored inverted by
  compressed-tensors, so the block scale in fp32 is
    modelopt:            s = float(weight_scale) * weight_scale_2
    compressed-tensors:  s = float(weight_scale) / weight_global_scale
  and value = e2m1 * s (fp32, each operation rounded on its own). Followed: modelopt
  `torch/quantization/qtensor/nvfp4_tensor.py` (NVFP4QTensor.dequantize: `per_block_scale = q_scale *
  double_scale`, then the unpacked values times it; quantize packs `(q[..., 1::2] << 4) | q[..., 0::2]`),
  compressed-tensors `compressors/nvfp4` (unpack_fp4_from_uint8: low nibble first) and its
  `_dequantize` (`scale.to(global_scale.dtype) / global_scale`, then `x_q * scale`).

The readable, bit-by-bit definitions are in memra.loading.fp_reference; tests hold these equal to them,
bit for bit. Scales are checked here (NaN / Inf refused naming the tensor); the values (FP8 NaN codes,
products that overflow) are checked by the caller on the result.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn
NVFP4_GROUP = 16  # values per fp8 scale

# e2m1 nibble -> value: index = sign << 3 | exponent << 1 | mantissa.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

# Rows dequantized per step: bounds the scratch (the expanded scales) to a few times this many values.
_CHUNK_VALUES = 1 << 22


def _row_chunks(rows: int, cols: int, align: int):
    """Row ranges of about _CHUNK_VALUES values each, every start a multiple of `align` (a block edge)."""
    step = max(align, (_CHUNK_VALUES // max(cols, 1)) // align * align)
    for r0 in range(0, rows, step):
        yield r0, min(rows, r0 + step)


def fp8_block_dequant(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """weight float8_e4m3fn [R, C], scale_inv [ceil(R/br), ceil(C/bc)] (any float dtype) -> float32 [R, C]."""
    rows, cols = weight.shape
    br, bc = block
    s_cols = scale_inv.float().repeat_interleave(bc, dim=1)[:, :cols]  # [ceil(R/br), C]
    out = torch.empty(rows, cols, dtype=torch.float32, device=weight.device)
    for r0, r1 in _row_chunks(rows, cols, br):
        s = s_cols[r0 // br:(r1 + br - 1) // br].repeat_interleave(br, dim=0)[:r1 - r0]  # [r1-r0, C]
        torch.mul(weight[r0:r1].float(), s, out=out[r0:r1])
    return out


def nvfp4_block_scales(scale: torch.Tensor, global_scale: torch.Tensor, inverted_global: bool) -> torch.Tensor:
    """The fp32 scale of each 16-value group: fp8 [R, G] with the per-tensor scale -> float32 [R, G].
    `inverted_global`: compressed-tensors stores 1 / (modelopt's weight_scale_2), so it divides."""
    s = scale.float()
    g = global_scale.float().reshape(())
    return s / g if inverted_global else s * g


def nvfp4_dequant(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
                  inverted_global: bool) -> torch.Tensor:
    """packed uint8 [R, C/2], scale float8_e4m3fn [R, ceil(C/16)], global fp32 (one value) -> float32 [R, C]."""
    rows, half = packed.shape
    cols = 2 * half
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    block_scale = nvfp4_block_scales(scale, global_scale, inverted_global)  # [R, G]
    out = torch.empty(rows, cols, dtype=torch.float32, device=packed.device)
    for r0, r1 in _row_chunks(rows, cols, 1):
        p = packed[r0:r1]
        nibbles = torch.stack((p & 0x0F, p >> 4), dim=-1).reshape(r1 - r0, cols)  # low nibble = even column
        s = block_scale[r0:r1].repeat_interleave(NVFP4_GROUP, dim=1)[:, :cols]  # [r1-r0, C]
        torch.mul(lut[nibbles.long()], s, out=out[r0:r1])
    return out
