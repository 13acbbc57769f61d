"""Batch-invariant Triton matmuls over GGUF weights repacked at load (memra.kernels.split: the quants
apart from their scales), dequantizing each weight tile in registers.

Same contract as triton.linear.linear, whose loop this mirrors: one frozen tile configuration for
every M, M not specialised by the compiler, K walked in one order with fp32 accumulation. Row i of the
output is computed by the same instructions whatever M is, so its bits cannot depend on the batch.

What is new is the weight tile. The file's layout interleaves a block's fp16 scale with its quants (34
bytes for 32 Q8_0 values), so a kernel reading it gathers byte by byte and assembles every scale from
two bytes. The split layouts keep the quants as plain byte planes [N, K] (Q4_K: the file's nibbles
[N, K/2]) beside small scale planes, so a [BLOCK_K, BLOCK_N] tile is a wide load of contiguous bytes
along K and a broadcast of a few scales. Each tile decodes with the split's own fp32 operations in its
order (memra.kernels.split, bit-identical to memra.loading.dequant), so it equals
`w.dequantize(torch.float32)` to the bit, then rounded to the activation dtype exactly as the twin
(memra.kernels.quant.reference_linear) rounds its dense weight:

  Q8_0  q * d                          int8 q [N, K], fp16 d [N, K/32]
  Q4_K  (d * scale) * q - dmin * min   nibbles [N, K/2], fp32 d, dmin [N, K/256], bytes scale, min [N, K/32]
  Q5_K  the same, with a byte per q    uint8 q [N, K]
  Q6_K  (d * scale) * q                int8 q - 32 [N, K], fp32 d [N, K/256], int8 scale [N, K/16]

Why the weight bits hold on the GPU and in the interpreter alike:
  * the compiler may contract a multiply and an add into one FMA, but here that cannot change a bit:
    every product is exact in fp32 (an fp16 scale has an 11-bit significand, a 6-bit K-quant scale or
    min and a 4- or 5-bit q add at most 11 more, Q6_K's 8-bit scale and 6-bit q 13: <= 24 bits; Q8_0's
    d * q needs 11 + 7), so in `(d * scale) * q - (dmin * min)` only the subtraction rounds (tested);
  * fp32 -> bf16 is rounded to nearest-even in integer arithmetic (`triton.common.round_to_bf16`): the GPU's
    fptrunc does that too, but Triton's interpreter truncates.
Hand-written because no library multiplies by these layouts with fp32 values that equal GGUF's own
dequantization: llama.cpp's kernels multiply in int8, which would change the bits of every logit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from memra.errors import MemraError
from memra.kernels.quant import _check_linear
from memra.kernels.split import SPLIT_TYPES, Q4KSplit, Q5KSplit, Q6KSplit, Q8Split, SplitRows
from memra.kernels.triton.common import _interpreting, round_to_bf16
from memra.kernels.triton.launch import lean

# The frozen configuration (as triton.linear.LINEAR_*): changing one changes bits across memra versions,
# never across batch sizes. BLOCK_K = 64 is two Q8_0 blocks, or one 32-byte run of a Q4_K super-block's
# nibbles (sub-blocks 2r and 2r + 1 as low / high nibbles), so a K step never straddles a Q4_K run.
QUANT_BLOCK_M = 64
QUANT_BLOCK_N = 32
QUANT_BLOCK_K = 64
QUANT_WARPS = 4
QUANT_STAGES = 4

Q8_0, Q4_K, Q5_K, Q6_K = 0, 1, 2, 3  # the kernel's FORMAT


@triton.jit
def _split_tile(q_ptr, d_ptr, dmin_ptr, sc_ptr, mn_ptr, rn, kk, mask, K, FORMAT: tl.constexpr):
    """The fp32 values of weight tile [BLOCK_K, BLOCK_N]: element (i, j) is W[rn[j], kk[i]]. rn int64."""
    rows = rn[None, :]
    if FORMAT == 0:  # Q8_0
        q = tl.load(q_ptr + rows * K + kk[:, None], mask=mask, other=0).to(tl.float32)
        d = tl.load(d_ptr + rows * (K // 32) + (kk // 32)[:, None], mask=mask, other=0.0).to(tl.float32)
        return q * d
    elif FORMAT == 3:  # Q6_K
        q = tl.load(q_ptr + rows * K + kk[:, None], mask=mask, other=0).to(tl.float32)
        d = tl.load(d_ptr + rows * (K // 256) + (kk // 256)[:, None], mask=mask, other=0.0)
        sc = tl.load(sc_ptr + rows * (K // 16) + (kk // 16)[:, None], mask=mask, other=0).to(tl.float32)
        return q * (d * sc)
    else:  # Q4_K, Q5_K: per 256 d and dmin, per 32 a 6-bit scale and min
        if FORMAT == 1:  # run kk // 64 of 32 bytes: its first 32 values in the low nibbles, the next 32 high
            byte = tl.load(q_ptr + rows * (K // 2) + (kk // 64 * 32 + kk % 32)[:, None], mask=mask, other=0)
            q = ((byte.to(tl.int32) >> (4 * (kk % 64 // 32))[:, None]) & 0x0F).to(tl.float32)
        else:
            q = tl.load(q_ptr + rows * K + kk[:, None], mask=mask, other=0).to(tl.float32)
        at = rows * (K // 256) + (kk // 256)[:, None]
        sub = rows * (K // 32) + (kk // 32)[:, None]
        d = tl.load(d_ptr + at, mask=mask, other=0.0)
        dmin = tl.load(dmin_ptr + at, mask=mask, other=0.0)
        sc = tl.load(sc_ptr + sub, mask=mask, other=0).to(tl.float32)
        mn = tl.load(mn_ptr + sub, mask=mask, other=0).to(tl.float32)
        return q * (d * sc) - dmin * mn  # the split's fp32 order; only the subtraction rounds


@lean
@triton.jit(do_not_specialize=["M"])
def _split_linear_kernel(x_ptr, q_ptr, d_ptr, dmin_ptr, sc_ptr, mn_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_ym,
                         FORMAT: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, ROUND_BF16: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # M is not specialised: an M == 1 call must compile to the same instructions as M == 64.
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    rn64 = rn.to(tl.int64)  # byte offsets of whole rows pass 2 GiB in a large embedding or head
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        a = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        w = _split_tile(q_ptr, d_ptr, dmin_ptr, sc_ptr, mn_ptr, rn64, kk, (rn[None, :] < N) & (kk[:, None] < K), K,
                        FORMAT)  # [BK, BN] fp32, == w.dequantize(fp32)^T here
        if ROUND_BF16:
            w = round_to_bf16(w)  # == w.dequantize(bf16), held in fp32
        if IEEE:  # fp32 models: no silent TF32 (and the interpreter, whose bf16 dot is broken, via fp32)
            acc = tl.dot(a.to(tl.float32), w.to(a.dtype).to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w.to(a.dtype), acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def _planes(w) -> tuple[int, tuple[torch.Tensor, ...]]:
    """The kernel's FORMAT and (q, d, dmin, scale, min) planes of one split layout (unused ones repeat d)."""
    if isinstance(w, Q8Split):
        return Q8_0, (w.q, w.d, w.d, w.d, w.d)
    if isinstance(w, Q4KSplit):
        return Q4_K, (w.qs, w.d, w.dmin, w.scale, w.mins)
    if isinstance(w, Q5KSplit):
        return Q5_K, (w.q, w.d, w.dmin, w.scale, w.mins)
    if isinstance(w, Q6KSplit):
        return Q6_K, (w.q, w.d, w.d, w.scale, w.scale)
    raise MemraError(f"no packed GPU kernel reads a {type(w).__name__}")


def linear(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ w[N, K]^T (+ bias[N]) -> [..., N] in x's dtype, w a split layout (memra.kernels.split;
    SplitRows: one launch per row block, each writing its columns); fp32 accumulation, M-invariant."""
    if not isinstance(w, SPLIT_TYPES):
        raise MemraError(f"the packed GPU linear takes a split layout (memra.kernels.split), not {type(w).__name__}")
    _check_linear(x, w, bias)
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, n = x2.shape[0], w.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    lo = 0
    for part in (w.parts if isinstance(w, SplitRows) else (w,)):
        hi = lo + part.shape[0]
        if m:
            fmt, planes = _planes(part)
            b = bias[lo:hi] if bias is not None else y
            grid = (triton.cdiv(m, QUANT_BLOCK_M), triton.cdiv(hi - lo, QUANT_BLOCK_N))
            _split_linear_kernel[grid](x2, *planes, b, y[:, lo:hi], m, hi - lo, k, x2.stride(0), y.stride(0),
                                       FORMAT=fmt, HAS_BIAS=bias is not None,
                                       IEEE=x.dtype == torch.float32 or _interpreting(),
                                       ROUND_BF16=x.dtype == torch.bfloat16, BLOCK_M=QUANT_BLOCK_M,
                                       BLOCK_N=QUANT_BLOCK_N, BLOCK_K=QUANT_BLOCK_K, num_warps=QUANT_WARPS,
                                       num_stages=QUANT_STAGES)
        lo = hi
    return y.reshape(*lead, n)
