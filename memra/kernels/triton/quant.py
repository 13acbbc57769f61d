"""Batch-invariant Triton matmuls that read GGUF-packed weights (Q8_0, Q4_K) and dequantize in registers.

Same contract as triton.linear.linear, whose loop this mirrors: one frozen tile configuration for
every M, M not specialised by the compiler, K walked in one order with fp32 accumulation. Row i of the
output is computed by the same instructions whatever M is, so its bits cannot depend on the batch.

What is new is the weight tile. Each [BLOCK_K, BLOCK_N] tile is decoded from the packed bytes with the
reference's fp32 operations in the reference's order (memra.loading.dequant), so it equals
`qw.dequantize(torch.float32)` to the bit, then rounded to the activation dtype exactly as the twin
(memra.kernels.quant.reference_linear) rounds its dense weight. The only difference from the twin is
the order of the dot's sum: fp32 within 2e-5 relative, bf16 within two output roundings (2^-6).

Why the weight bits hold on the GPU and in the interpreter alike:
  * the compiler may contract a multiply and an add into one FMA, but here that cannot change a bit:
    every product is exact in fp32 (an fp16 scale has an 11-bit significand, a 6-bit Q4_K scale or
    min and a 4-bit q add at most 10 more: 21 <= 24 bits; Q8_0's d * q needs 11 + 7), so in
    `(d * scale) * q - (dmin * min)` only the subtraction rounds, fused or not (tested);
  * fp32 -> bf16 is rounded to nearest-even in integer arithmetic (`triton.common.round_to_bf16`): the GPU's fptrunc
    does that too, but Triton's interpreter truncates.

The tiles gather each value's scale(s) per element (the same bytes again and again, from cache): simple
and obviously right. Tuning (wider tiles, a split over N for decode) belongs with a GPU measurement.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from memra.errors import MemraError
from memra.kernels.quant import QType, QuantWeight, _check_linear
from memra.kernels.triton.common import _interpreting, round_to_bf16

# The frozen configuration (as triton.linear.LINEAR_*): changing one changes bits across memra versions,
# never across batch sizes. BLOCK_K = 64 is two Q8_0 blocks, or one 32-byte run of a Q4_K super-block's
# quants (sub-blocks 2r and 2r + 1 as low / high nibbles), so a K step never straddles a Q4_K run.
QUANT_BLOCK_M = 64
QUANT_BLOCK_N = 32
QUANT_BLOCK_K = 64
QUANT_WARPS = 4
QUANT_STAGES = 4


# --- in-register decoding -------------------------------------------------------------------------


@triton.jit
def _byte(ptr, mask):
    """uint8 at ptr, as int32 (zero-extended), so all unpacking arithmetic is plain int32."""
    return tl.load(ptr, mask=mask, other=0).to(tl.int32)


@triton.jit
def _f16_at(ptr, mask):
    """The little-endian fp16 field at ptr, widened to fp32 (exact: every fp16 is an fp32). Read as two
    bytes because packed rows do not keep fields 2-byte aligned in general."""
    bits = _byte(ptr, mask) | (_byte(ptr + 1, mask) << 8)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _q8_0_tile(w_ptr, row, kk, mask):
    """Q8_0 weights of a [BLOCK_K, BLOCK_N] tile in fp32. row [BLOCK_N] byte offset of each output row,
    kk [BLOCK_K] column indices. Block b of a row: bytes 34b..34b+1 = d, 34b+2.. = 32 int8 q."""
    blk = row[None, :] + (kk // 32 * 34)[:, None]  # [BK, BN] byte offset of the block holding (k, n)
    d = _f16_at(w_ptr + blk, mask)
    q = tl.load(w_ptr + blk + 2 + (kk % 32)[:, None], mask=mask, other=0).to(tl.int8, bitcast=True)
    return q.to(tl.float32) * d  # value = q * d: one fp32 multiply, as the reference


@triton.jit
def _q4_k_tile(w_ptr, row, kk, mask):
    """Q4_K weights of a [BLOCK_K, BLOCK_N] tile in fp32 (arguments as _q8_0_tile). Super-block s of a
    row: 144 bytes at 144s = d | dmin | 12 bytes of 6-bit scales/mins | 128 bytes of 4-bit q."""
    sb = row[None, :] + (kk // 256 * 144)[:, None]  # [BK, BN] byte offset of the super-block
    j = kk % 256  # [BK] position inside the super-block
    sub = j // 32  # its 32-value sub-block, 0..7
    d = _f16_at(w_ptr + sb, mask)
    dmin = _f16_at(w_ptr + sb + 2, mask)
    # scale/min of sub-block s (memra.loading.dequant._k_scale_min): with a, b, c = bytes s%4, 4 + s%4,
    # 8 + s%4 of the 12, s < 4 reads the low 6 bits of a (scale) and b (min); s >= 4 takes a low nibble
    # of c (scale: low, min: high) and its top 2 bits from the spare top bits of a (scale) and b (min).
    scales = w_ptr + sb + 4 + (sub % 4)[:, None]  # -> byte a
    a, b, c = _byte(scales, mask), _byte(scales + 4, mask), _byte(scales + 8, mask)
    high = (sub >= 4)[:, None]
    sc = tl.where(high, (c & 0x0F) | ((a >> 6) << 4), a & 0x3F)
    mn = tl.where(high, (c >> 4) | ((b >> 6) << 4), b & 0x3F)
    # quants: run j // 64 of 32 bytes; the first 32 values of a run in the low nibbles, the next 32 high
    byte = _byte(w_ptr + sb + 16 + (j // 64 * 32 + j % 32)[:, None], mask)
    q = (byte >> (4 * (sub % 2))[:, None]) & 0x0F
    # the reference's fp32 order; only the subtraction rounds (see the module docstring)
    return (d * sc.to(tl.float32)) * q.to(tl.float32) - dmin * mn.to(tl.float32)


# --- the matmul --------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["M"])
def _quant_linear_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                         Q4_K: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, ROUND_BF16: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # M is not specialised: an M == 1 call must compile to the same instructions as M == 64.
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    row = rn.to(tl.int64) * stride_wn  # [BN] byte offset of each output row (int64: weights pass 2 GiB)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        a = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        mask_w = (rn[None, :] < N) & (kk[:, None] < K)
        if Q4_K:
            w = _q4_k_tile(w_ptr, row, kk, mask_w)  # [BK, BN] fp32, == qw.dequantize(fp32)^T here
        else:
            w = _q8_0_tile(w_ptr, row, kk, mask_w)
        if ROUND_BF16:
            w = round_to_bf16(w)  # == qw.dequantize(bf16), held in fp32
        if IEEE:  # fp32 models: no silent TF32 (and the interpreter, whose bf16 dot is broken, via fp32)
            acc = tl.dot(a.to(tl.float32), w.to(a.dtype).to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w.to(a.dtype), acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def _quant_linear(x: torch.Tensor, qw: QuantWeight, b: torch.Tensor | None, qtype: QType) -> torch.Tensor:
    if qw.qtype != qtype:
        raise MemraError(f"{qtype.name.lower()}_linear got a {qw.qtype.name} weight")
    _check_linear(x, qw, b)
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, n = x2.shape[0], qw.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        grid = (triton.cdiv(m, QUANT_BLOCK_M), triton.cdiv(n, QUANT_BLOCK_N))
        _quant_linear_kernel[grid](x2, qw.data, b if b is not None else y, y, m, n, k, x2.stride(0), qw.data.stride(0),
                                   y.stride(0), Q4_K=qtype == QType.Q4_K, HAS_BIAS=b is not None,
                                   IEEE=x.dtype == torch.float32 or _interpreting(),
                                   ROUND_BF16=x.dtype == torch.bfloat16,
                                   BLOCK_M=QUANT_BLOCK_M, BLOCK_N=QUANT_BLOCK_N, BLOCK_K=QUANT_BLOCK_K,
                                   num_warps=QUANT_WARPS, num_stages=QUANT_STAGES)
    return y.reshape(*lead, n)


def q8_0_linear(x: torch.Tensor, qw: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ Q8_0 weight [N, K]^T (+ bias[N]) -> [..., N] in x's dtype; fp32 accumulation, M-invariant."""
    return _quant_linear(x, qw, bias, QType.Q8_0)


def q4_k_linear(x: torch.Tensor, qw: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ Q4_K weight [N, K]^T (+ bias[N]) -> [..., N] in x's dtype; fp32 accumulation, M-invariant."""
    return _quant_linear(x, qw, bias, QType.Q4_K)


def linear(x: torch.Tensor, qw: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The fused kernel for qw's format (the kernel table's entry: memra.kernels.table.KernelTable.linear)."""
    return _quant_linear(x, qw, bias, qw.qtype)
