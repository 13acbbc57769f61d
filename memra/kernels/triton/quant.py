"""Batch-invariant Triton matmuls over GGUF weights repacked at load (memra.kernels.split: the quants
apart from their scales), dequantizing each weight tile in registers.

Same contract as triton.linear.linear, whose loop this mirrors: frozen tile configurations bucketed by
M (QUANT_BUCKETS, whose tiles give one set of bits), M not specialised by the compiler, K walked in one
order with fp32 accumulation (in fixed chunks of QUANT_CHUNK_K, their sums added in order). So a row's
bits cannot depend on the batch.

What is new is the weight tile. The file's layout interleaves a block's fp16 scale with its quants (34
bytes for 32 Q8_0 values), so a kernel reading it gathers byte by byte and assembles every scale from
two bytes. The split layouts keep the quants as plain byte planes [N, K] (Q4_K: the file's nibbles
[N, K/2]) beside small scale planes, so a [BLOCK_K, BLOCK_N] tile is one wide load of contiguous bytes
along K, and each scale group's scales one load per column, spread over the group. Each tile decodes
with the split's own fp32 operations in its order (memra.kernels.split, bit-identical to
memra.loading.dequant), so it equals `w.dequantize(torch.float32)` to the bit, then rounded to the
activation dtype exactly as the twin (memra.kernels.quant.reference_linear) rounds its dense weight:

  Q8_0  q * d                          int8 q [N, K], fp16 d [N, K/32]
  Q4_K  (d * scale) * q - dmin * min   nibbles [N, K/2], fp32 d, dmin [N, K/256], bytes scale, min [N, K/32]
  Q5_K  the same, with a byte per q    uint8 q [N, K]
  Q6_K  (d * scale) * q                6-bit q as the file's planes: uint8 ql [N, K/2], qh [N, K/4] (q - 32 from
                                       both), fp32 d [N, K/256], int8 scale [N, K/16]
  FP8   e4m3(q) * s                    e4m3 bytes [N, K], fp32 s [N, cdiv(K, block)] (HF FP8 block-scaled)
  NVFP4 e2m1(q) * s                    two nibbles a byte [N, K/2], fp32 s [N, cdiv(K, 16)] (modelopt / c-t)
  (FP8 / NVFP4 decode their codes exactly in integer arithmetic, then one fp32 product; on a GPU only with
  --packed-weights / packed_weights=True: by default they are dequantized at load there.)

Why the weight bits hold on the GPU and in the interpreter alike:
  * the compiler may contract a multiply and an add into one FMA, but here that cannot change a bit:
    every product is exact in fp32 (an fp16 scale has an 11-bit significand, a 6-bit K-quant scale or
    min and a 4- or 5-bit q add at most 11 more, Q6_K's 8-bit scale and 6-bit q 13: <= 24 bits; Q8_0's
    d * q needs 11 + 7), so in `(d * scale) * q - (dmin * min)` only the subtraction rounds (tested);
  * fp32 -> bf16 is the GPU's round-to-nearest-even cast; Triton's interpreter truncates, so there it
    is rounded in integer arithmetic (`triton.common.round_to_bf16`, ROUND_IN_INTEGERS).
Hand-written because no library multiplies by these layouts with fp32 values that equal GGUF's own
dequantization: llama.cpp's kernels multiply in int8, which would change the bits of every logit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from memra.errors import MemraError
from memra.kernels.quant import _check_linear
from memra.kernels.split import SPLIT_TYPES, Fp8BlockSplit, Nvfp4Split, Q4KSplit, Q5KSplit, Q6KSplit, Q8Split, SplitRows
from memra.kernels.triton.common import _interpreting, both, round_to_bf16
from memra.kernels.triton.launch import lean
from memra.kernels.triton.linear import _mma

# The frozen configurations (as triton.linear.LINEAR_BUCKETS): changing one changes bits across memra
# versions, never across batch sizes. Every tile has BLOCK_M a multiple of 64 (the H200's wgmma): tiles
# of 16 rows (mma.sync) changed bits against them, while tiles differing in BLOCK_M (64 / 128), BLOCK_N
# or BLOCK_K gave the same bits at every M on the 8B projection shapes (measured on the H200, Q8_0 and
# Q4_K; the self-test re-checks rows across the buckets on the running GPU). BLOCK_K is a multiple of
# 64, one 32-byte run of a Q4_K super-block's nibbles (groups 2r and 2r + 1 as low / high nibbles).
QUANT_BUCKETS = (  # (largest M of the bucket, (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages))
    (64, (64, 64, 64, 4, 3)),  # decode: M=1 on the H200, Q8_0 qkv / down / gate_up 56 / 176 / 116 us
    (None, (128, 128, 64, 8, 3)),  # prefill
)
QUANT_INTERPRET_CONFIG = (64, 32, 64, 4, 4)  # numpy's dot sums in an order set by the tile: one tile

# Split-K at fixed positions: K is summed in chunks of QUANT_CHUNK_K (a multiple of every BLOCK_K), each
# from zero, and the chunks' sums are added in order. Calls of up to SPLIT_ROWS rows (decode) give each
# chunk its own programs and add their sums in a second launch; larger calls sum the chunks one after
# another in one program. The additions are the same either way, so a row's bits do not depend on M,
# while a decode projection gets K / QUANT_CHUNK_K times the programs: at B=1 a 4096-column weight
# streamed by 64 programs of one tile wide left half of the H200's 132 SMs idle.
QUANT_CHUNK_K = 1024
SPLIT_ROWS = 64  # the decode bucket's rows
CHUNK_SUM_BLOCK = 1024

Q8_0, Q4_K, Q5_K, Q6_K, FP8_BLOCK, NVFP4 = 0, 1, 2, 3, 4, 5  # the kernel's FORMAT


@triton.jit
def _signed(negative, magnitude):
    return tl.where(negative != 0, -magnitude, magnitude)  # a negation is exact; -0.0 where the code says so


@triton.jit
def _e4m3_values(byte):
    """float8_e4m3fn codes (int32 0..255) -> their fp32 values, exactly: sign | exponent (bias 7) | 3-bit
    mantissa; exponent 0 is subnormal (m * 2^-9), S.1111.111 is NaN."""
    e = (byte >> 3) & 0xF
    m = byte & 0x7
    normal = ((e + 120) << 23 | (m << 20)).to(tl.float32, bitcast=True)  # 2^(e-7) * (1 + m/8), fp32 bits
    mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)
    mag = tl.where((e == 0xF) & (m == 0x7), float("nan"), mag)
    return _signed(byte >> 7, mag)


@triton.jit
def _e2m1_values(nibble):
    """e2m1 codes (int32 0..15) -> fp32, exactly: sign (bit 3) | exponent (bias 1) | 1-bit mantissa."""
    e = (nibble >> 1) & 0x3
    m = (nibble & 0x1).to(tl.float32)
    mag = tl.where(e == 0, m * 0.5, (1.0 + m * 0.5) * tl.where(e == 1, 1.0, tl.where(e == 2, 2.0, 4.0)))
    return _signed(nibble >> 3, mag)


@triton.jit
def _spread(scale, G: tl.constexpr, BLOCK_K: tl.constexpr):
    """scale [BLOCK_K // G, BLOCK_N] -> [BLOCK_K, BLOCK_N], each row repeated over its group of G positions."""
    bn: tl.constexpr = scale.shape[1]
    return tl.reshape(tl.broadcast_to(scale[:, None, :], (BLOCK_K // G, G, bn)), (BLOCK_K, bn))


@triton.jit
def _group_scales(ptr, rows, cols, k0, K, G: tl.constexpr, BLOCK_K: tl.constexpr):
    """A per-G-positions scale plane [N, K // G] at the tile's groups -> [BLOCK_K // G, BLOCK_N] fp32 (one load
    per column and group, not per value; _spread then repeats it over the group); zeros past the weight."""
    g = k0 // G + tl.arange(0, BLOCK_K // G)
    return tl.load(ptr + rows * (K // G) + g[:, None], mask=cols[None, :] & (g < K // G)[:, None],
                   other=0).to(tl.float32)


@triton.jit
def _tile_values(q_ptr, d_ptr, dmin_ptr, sc_ptr, mn_ptr, rn, k0, kk, mask, N, K, FORMAT: tl.constexpr,
                 BLOCK_K: tl.constexpr, G: tl.constexpr):
    """The fp32 values of weight tile [BLOCK_K, BLOCK_N] over K positions kk = k0 + arange(BLOCK_K):
    element (i, j) is W[rn[j], kk[i]]. The quants are one wide load; the scales of a group of G positions
    are one load per column, broadcast over the group (a [BLOCK_K // G, BLOCK_N] tile), not a load per
    value. rn int64; mask [BLOCK_K, BLOCK_N]: the values inside the weight. BLOCK_K divides 256, so a tile
    lies in one K-quant super-block."""
    rows = rn[None, :]
    cols = rn < N
    if FORMAT == 4 or FORMAT == 5:  # FP8 block / NVFP4 (split.Fp8BlockSplit / Nvfp4Split): per-row scales
        # of G positions [N, cdiv(K, G)], read per value (G may exceed BLOCK_K, and K need not divide by it)
        s = tl.load(d_ptr + rows * tl.cdiv(K, G) + (kk // G)[:, None], mask=mask, other=0.0)
        if FORMAT == 4:  # the file's e4m3 bytes [N, K]
            v = _e4m3_values(tl.load(q_ptr + rows * K + kk[:, None], mask=mask, other=0).to(tl.int32))
        else:  # two e2m1 per byte [N, K / 2], the even position in the low nibble
            byte = tl.load(q_ptr + rows * (K // 2) + (kk // 2)[:, None], mask=mask, other=0).to(tl.int32)
            v = _e2m1_values((byte >> (4 * (kk % 2))[:, None]) & 0xF)
        return v * s  # one fp32 product, the split's (exact decoding, then one rounding)
    elif FORMAT == 0:  # Q8_0
        q = tl.load(q_ptr + rows * K + kk[:, None], mask=mask, other=0).to(tl.float32)
        return q * _spread(_group_scales(d_ptr, rows, cols, k0, K, 32, BLOCK_K), 32, BLOCK_K)
    elif FORMAT == 3:  # Q6_K: groups of 16; a value's low nibble from ql (q_ptr), its high two bits from qh (mn_ptr)
        v = kk % 256
        h, c, lane = v // 128, v % 128 // 32, v % 32
        lo = tl.load(q_ptr + rows * (K // 2) + (kk // 256 * 128 + 64 * h + 32 * (c % 2) + lane)[:, None], mask=mask,
                     other=0).to(tl.int32)
        hi = tl.load(mn_ptr + rows * (K // 4) + (kk // 256 * 64 + 32 * h + lane)[:, None], mask=mask,
                     other=0).to(tl.int32)
        q = (((lo >> (4 * (c // 2))[:, None]) & 0x0F) | (((hi >> (2 * c)[:, None]) & 3) << 4)) - 32
        q = tl.where(mask, q, 0).to(tl.float32)  # zero past the weight, as the byte-per-value load gave
        d = tl.load(d_ptr + rn * (K // 256) + k0 // 256, mask=both(cols, k0 < K), other=0.0)
        return q * _spread(d[None, :] * _group_scales(sc_ptr, rows, cols, k0, K, 16, BLOCK_K), 16, BLOCK_K)
    else:  # Q4_K, Q5_K: per 256 d and dmin, per 32 a 6-bit scale and min
        if FORMAT == 1:  # run kk // 64 of 32 bytes: its first 32 values in the low nibbles, the next 32 high
            byte = tl.load(q_ptr + rows * (K // 2) + (kk // 64 * 32 + kk % 32)[:, None], mask=mask, other=0)
            q = ((byte.to(tl.int32) >> (4 * (kk % 64 // 32))[:, None]) & 0x0F).to(tl.float32)
        else:
            q = tl.load(q_ptr + rows * K + kk[:, None], mask=mask, other=0).to(tl.float32)
        live = both(cols, k0 < K)
        d = tl.load(d_ptr + rn * (K // 256) + k0 // 256, mask=live, other=0.0)
        dmin = tl.load(dmin_ptr + rn * (K // 256) + k0 // 256, mask=live, other=0.0)
        sc = _group_scales(sc_ptr, rows, cols, k0, K, 32, BLOCK_K)
        mn = _group_scales(mn_ptr, rows, cols, k0, K, 32, BLOCK_K)
        # the split's fp32 order, q * (d * scale) - dmin * min: only the subtraction rounds
        return q * _spread(d[None, :] * sc, 32, BLOCK_K) - _spread(dmin[None, :] * mn, 32, BLOCK_K)


@lean
@triton.jit(do_not_specialize=["M"])
def _split_linear_kernel(x_ptr, q_ptr, d_ptr, dmin_ptr, sc_ptr, mn_ptr, b_ptr, y_ptr, part_ptr, M, N, K, stride_xm,
                         stride_ym, FORMAT: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
                         ROUND_IN_INTEGERS: tl.constexpr, PARTIAL: tl.constexpr, CHUNK: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, G: tl.constexpr):
    # M is not specialised: an M == 1 call must compile to the same instructions as M == 64.
    # K is summed in chunks of CHUNK positions (QUANT_CHUNK_K), each from zero, then the chunks' sums in order.
    # PARTIAL: program (., ., c) sums chunk c alone into part [chunks, M, N] (_chunk_sum_kernel adds
    # them); else one program sums every chunk of its tile and stores the result.
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    rn64 = rn.to(tl.int64)  # byte offsets of whole rows pass 2 GiB in a large embedding or head
    inside = (rm[:, None] < M) & (rn[None, :] < N)
    first = tl.program_id(2) * CHUNK if PARTIAL else 0
    last = tl.minimum(first + CHUNK, K) if PARTIAL else K
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for c0 in range(first, last, CHUNK):
        chunk = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(c0, tl.minimum(c0 + CHUNK, K), BLOCK_K):
            kk = k0 + rk
            a = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K),
                        other=0.0)
            w = _tile_values(q_ptr, d_ptr, dmin_ptr, sc_ptr, mn_ptr, rn64, k0, kk,
                             (rn[None, :] < N) & (kk[:, None] < K), N, K, FORMAT, BLOCK_K, G)  # [BK, BN] fp32
            if ROUND_IN_INTEGERS:  # == w.dequantize(bf16) where a cast truncates (the interpreter)
                w = round_to_bf16(w)
            # the cast rounds to nearest-even on the GPU: w.dequantize(x's dtype), the twin's weight
            chunk = _mma(a, w.to(a.dtype), chunk, IEEE)
        acc += chunk
    if PARTIAL:
        at = (tl.program_id(2) * M + rm[:, None]).to(tl.int64) * N + rn[None, :]
        tl.store(part_ptr + at, acc, mask=inside)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=inside)


@lean
@triton.jit
def _chunk_sum_kernel(part_ptr, b_ptr, y_ptr, M, N, CHUNKS, stride_ym, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    # The split kernel's epilogue over part [CHUNKS, M, N]: the chunks' sums added in order from zero,
    # as one program adds them, then the bias and the cast.
    at = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = at < M * N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for c in range(0, CHUNKS):
        acc += tl.load(part_ptr + c * M * N + at, mask=live, other=0.0)
    col = at % N
    if HAS_BIAS:
        acc += tl.load(b_ptr + col, mask=live, other=0.0).to(tl.float32)
    tl.store(y_ptr + (at // N) * stride_ym + col, acc.to(y_ptr.dtype.element_ty), mask=live)


def _planes(w) -> tuple[int, tuple[torch.Tensor, ...], int]:
    """The kernel's FORMAT, (q, d, dmin, scale, min) planes of one split layout (unused ones repeat d), and
    G, the positions per scale of the FP8 / NVFP4 layouts (32, unused, for the GGUF ones)."""
    if isinstance(w, Q8Split):
        return Q8_0, (w.q, w.d, w.d, w.d, w.d), 32
    if isinstance(w, Q4KSplit):
        return Q4_K, (w.qs, w.d, w.dmin, w.scale, w.mins), 32
    if isinstance(w, Q5KSplit):
        return Q5_K, (w.q, w.d, w.dmin, w.scale, w.mins), 32
    if isinstance(w, Q6KSplit):
        return Q6_K, (w.ql, w.d, w.d, w.scale, w.qh), 32
    if isinstance(w, Fp8BlockSplit):
        q = w.q.view(torch.uint8)
        return FP8_BLOCK, (q, w.s, w.s, w.s, w.s), w.cols
    if isinstance(w, Nvfp4Split):
        return NVFP4, (w.packed, w.s, w.s, w.s, w.s), 16
    raise MemraError(f"no packed GPU kernel reads a {type(w).__name__}")


def quant_config(m: int, dtype: torch.dtype = torch.bfloat16) -> tuple[int, int, int, int, int]:
    """The tile configuration of an M-row packed call: its bucket's (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages).
    fp32 activations take two stages: their tiles are twice a bf16 one's, and the prefill tile's three stages
    needed 180 KB of shared memory, past the 163 KB an sm_80 block gets. Stages pipeline the loads; they
    move no bits (the K order is the tile's)."""
    if _interpreting():
        return QUANT_INTERPRET_CONFIG
    bm, bn, bk, warps, stages = next(cfg for top, cfg in QUANT_BUCKETS if top is None or m <= top)
    return bm, bn, bk, warps, min(stages, 2) if dtype == torch.float32 else stages


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
            fmt, planes, group = _planes(part)
            b = bias[lo:hi] if bias is not None else y
            bm, bn, bk, warps, stages = quant_config(m, x.dtype)
            n_part, chunks = hi - lo, triton.cdiv(k, QUANT_CHUNK_K)
            split = chunks > 1 and m <= SPLIT_ROWS
            sums = torch.empty(chunks, m, n_part, dtype=torch.float32, device=x.device) if split else y
            _split_linear_kernel[(triton.cdiv(m, bm), triton.cdiv(n_part, bn), chunks if split else 1)](
                x2, *planes, b, y[:, lo:hi], sums, m, n_part, k, x2.stride(0), y.stride(0), FORMAT=fmt,
                HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32 or _interpreting(),
                ROUND_IN_INTEGERS=x.dtype == torch.bfloat16 and _interpreting(), PARTIAL=split,
                CHUNK=QUANT_CHUNK_K, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, G=group, num_warps=warps,
                num_stages=stages)
            if split:
                _chunk_sum_kernel[(triton.cdiv(m * n_part, CHUNK_SUM_BLOCK),)](
                    sums, b, y[:, lo:hi], m, n_part, chunks, y.stride(0), HAS_BIAS=bias is not None,
                    BLOCK=CHUNK_SUM_BLOCK)
        lo = hi
    return y.reshape(*lead, n)
