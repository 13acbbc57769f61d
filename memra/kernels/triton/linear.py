"""Batch-invariant GPU kernels (Triton): a row's result never depends on how many rows share the call.

cuBLAS and torch's reductions choose their algorithm from the shape of the call (GEMV for one row,
split-K for few rows, a different tree for a different row count), so the same row gets different
bits at B=1 and B=64. The kernels here freeze every choice instead: one tile configuration for all M,
a K loop in one fixed order, one program per row for reductions, positions visited in order. Row i
of the output is then computed by exactly the same instructions whatever M is, which is what makes a
stacked decode of B sequences bit-identical to each sequence decoded alone (promise E1).

This module holds the dense linear (triton.linear_persistent, behind MEMRA_LINEAR_PERSISTENT, runs its
large calls as one persistent kernel with these bits); the other families of memra.kernels.triton follow
the same rules.
Each kernel has its meaning in memra.kernels.reference; tests/test_triton_kernels.py holds every
kernel to its twin (to a stated tolerance: the summation order differs, deliberately) and to its own
output across row counts (bit for bit). The kernels also run under TRITON_INTERPRET=1 on CPU, which
is how CI checks them without a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from memra.kernels.triton.activation import silu_mul_values
from memra.kernels.triton.common import _interpreting, round_to_dtype
from memra.kernels.triton.launch import lean

# The frozen configurations. Changing any of these changes bits (never across batch sizes, but
# across memra versions), so they are constants rather than autotuned.
#
# The linear kernel's tiles are chosen per bucket of M, because one tile cannot serve both a B=1
# decode (a GEMV: it wants narrow M and many programs to stream the weight) and a 4096-token prefill
# (a GEMM: it wants 128-row tiles). What fixes a row's bits is not the tile but the order in which its
# K products are summed: every configuration walks K in the same order with the same fp32 accumulator
# and the same MMA step (k = 16) -- measured on the H200 (tools/gpu_tune_linear.py: every candidate
# tile gives the reference tile's bits at every M on every model shape). Because that is a fact of the
# hardware rather than a promise of the compiler, the self-test (memra.kernels.exact) re-checks rows
# across the buckets on the running GPU, and a failure refuses the stacked plan.
LINEAR_BUCKETS = (  # (largest M of the bucket, (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages))
    (16, (16, 16, 256, 2, 4)),  # decode: a GEMV, 3.8-4.4 TB/s on the 8B/9B projections at M=1
    (64, (64, 32, 128, 4, 4)),
    (256, (64, 128, 128, 4, 4)),
    (512, (128, 128, 64, 8, 4)),
    (None, (128, 128, 64, 8, 3)),  # prefill: ~570 TFLOP/s at M=4096 on the 8B layer (cuBLAS: ~770)
)
# Under TRITON_INTERPRET (CI's CPU runs) the dot is numpy's, whose summation order follows the tile
# shape, so there one tile serves every M.
LINEAR_INTERPRET_CONFIG = (64, 32, 64, 4, 4)


@triton.jit
def _mma(a, b, acc, IEEE: tl.constexpr):
    """acc + a @ b: fp32 models with no silent TF32 (and the interpreter, whose bf16 dot is broken, via fp32)."""
    if IEEE:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@lean
@triton.jit(do_not_specialize=["M"])
def _linear_kernel(x_ptr, w_ptr, b_ptr, r_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_rm, stride_ym,
                   HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, IEEE: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   SWIGLU: tl.constexpr = False, LIBDEVICE: tl.constexpr = False):
    # M is not specialised: an M == 1 call must compile to the same instructions as M == 64.
    # SWIGLU: w holds gate rows [0, N) and up rows [N, 2N); the program accumulates both for its
    # columns, each column's products summed as the plain kernel sums them, and stores silu(gate) * up
    # from the two rounded products (triton.activation's steps): linear then silu_mul, in one launch.
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # SWIGLU only (otherwise never computed)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        a = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        mask_w = (rn[None, :] < N) & (kk[:, None] < K)
        b = tl.load(w_ptr + rn[None, :] * stride_wn + kk[:, None], mask=mask_w, other=0.0)
        acc = _mma(a, b, acc, IEEE)
        if SWIGLU:
            b = tl.load(w_ptr + (N + rn)[None, :] * stride_wn + kk[:, None], mask=mask_w, other=0.0)
            up = _mma(a, b, up, IEEE)
    y = _epilogue(acc, up, b_ptr, r_ptr, rm, rn, M, N, stride_rm, y_ptr.dtype.element_ty, HAS_BIAS, HAS_RESIDUAL,
                  SWIGLU, LIBDEVICE)
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], y, mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _epilogue(acc, up, b_ptr, r_ptr, rm, rn, M, N, stride_rm, ty: tl.constexpr, HAS_BIAS: tl.constexpr,
              HAS_RESIDUAL: tl.constexpr, SWIGLU: tl.constexpr, LIBDEVICE: tl.constexpr):
    """A block's epilogue (this kernel's and triton.linear_persistent's): acc (SWIGLU: and up) [BM, W] fp32 for
    rows rm and columns rn -> the block in dtype ty."""
    if SWIGLU:  # each product rounded to the dtype as the projection would store it, then the activation
        y = silu_mul_values(acc.to(ty).to(tl.float32), up.to(ty).to(tl.float32), ty, LIBDEVICE)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        y = acc.to(ty)
        if HAS_RESIDUAL:  # residual + y as torch adds two tensors of the model dtype: in fp32, rounded once
            r = tl.load(r_ptr + rm[:, None] * stride_rm + rn[None, :], mask=(rm[:, None] < M) & (rn[None, :] < N),
                        other=0.0)
            y = round_to_dtype(r.to(tl.float32) + y.to(tl.float32), ty).to(ty)
    return y


SHARED_MEMORY_BUDGET = 200 * 1024  # bytes of pipelined tiles per program (the H200 allows 227 KiB)


def linear_config(m: int, elem_bytes: int = 2) -> tuple[int, int, int, int, int]:
    """The tile configuration for an M-row call: its bucket's (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages).
    fp32 tiles are twice the bytes, so the pipeline gets fewer stages where they would not fit in
    shared memory (stages only overlap loads with math; they do not change the K order or the bits)."""
    if _interpreting():
        return LINEAR_INTERPRET_CONFIG
    return bucket_config(m, elem_bytes)


def bucket_config(m: int, elem_bytes: int = 2) -> tuple[int, int, int, int, int]:
    """The GPU's tile for an M-row call: LINEAR_BUCKETS', its stages fitted to the dtype."""
    bm, bn, bk, warps, stages = next(cfg for top, cfg in LINEAR_BUCKETS if top is None or m <= top)
    return bm, bn, bk, warps, _fit_stages(bm, bn, bk, elem_bytes, stages)


def _tile(m: int, elem_bytes: int, config: tuple | None) -> tuple[int, int, int, int, int]:
    """linear_config(m), or `config` with its stages fitted to the dtype (the interpreter keeps its one tile)."""
    if config is None or _interpreting():
        return linear_config(m, elem_bytes)
    bm, bn, bk, warps, stages = config
    return bm, bn, bk, warps, _fit_stages(bm, bn, bk, elem_bytes, stages)


def swiglu_tile(bm: int, bn: int, bk: int, elem_bytes: int, stages: int) -> tuple[int, int]:
    """(BLOCK_N, stages) of a fused SwiGLU launch from its plain tile's: a program reads a gate tile and an up
    tile each K step, so its columns are half the plain tile's (the same weight bytes a step), its stages
    fitted to that. The interpreter keeps the plain width (its numpy dot sums in an order set by the shape)."""
    if _interpreting():
        return bn, stages
    bn = max(16, bn // 2)
    return bn, _fit_stages(bm, 2 * bn, bk, elem_bytes, stages)


def _fit_stages(bm: int, weight_cols: int, bk: int, elem_bytes: int, stages: int) -> int:
    while stages > 2 and (bm + weight_cols) * bk * elem_bytes * stages > SHARED_MEMORY_BUDGET:
        stages -= 1
    return stages


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
           residual: torch.Tensor | None = None, config: tuple | None = None) -> torch.Tensor:
    """x [..., K] @ w[N, K]^T (+ b) -> [..., N] in x's dtype; fp32 accumulation, M-invariant. With
    `residual` [..., N]: residual + that, in the epilogue, with the bits of the add done apart (the
    block's residual add after its down projection, one launch fewer per layer). `config`: another tile
    than the bucket's (triton.linear_shaped's choice; any tile gives the same bits)."""
    lead, x2, w = _operands(x, w)
    m, n, k = x2.shape[0], w.shape[0], x2.shape[1]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    r = residual.reshape(m, n) if residual is not None else y
    if r.stride(-1) != 1:
        r = r.contiguous()
    if m:
        bm, bn, bk, warps, stages = _tile(m, x.element_size(), config)
        _linear_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
            x2, w, b if b is not None else w, r, y, m, n, k, x2.stride(0), w.stride(0), r.stride(0), y.stride(0),
            HAS_BIAS=b is not None, HAS_RESIDUAL=residual is not None, IEEE=x.dtype == torch.float32 or _interpreting(),
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
    return y.reshape(*lead, n)


def linear_silu_mul(x: torch.Tensor, w: torch.Tensor, config: tuple | None = None) -> torch.Tensor:
    """silu(x @ w[:F]^T) * (x @ w[F:]^T) -> [..., F] in x's dtype, w [2F, K] (gate rows, then up rows):
    SwiGLU's projection and activation in one launch, with the bits of `linear` then
    triton.activation.silu_mul, and no [T, 2F] product in memory. A program reads a gate tile and an up
    tile each K step, so its columns are half the bucket's: the same weight bytes and accumulator
    registers a step as the plain tile (a column's bits do not depend on the tile's width, which the
    self-test re-checks). Under the interpreter the halves are the plain tile's width: its numpy dot
    sums in an order set by the tile shape."""
    lead, x2, w = _operands(x, w)
    m, f, k = x2.shape[0], w.shape[0] // 2, x2.shape[1]
    y = torch.empty(m, f, dtype=x.dtype, device=x.device)
    if m:
        bm, bn, bk, warps, stages = _tile(m, x.element_size(), config)
        bn, stages = swiglu_tile(bm, bn, bk, x.element_size(), stages)
        _linear_kernel[(triton.cdiv(m, bm), triton.cdiv(f, bn))](
            x2, w, w, y, y, m, f, k, x2.stride(0), w.stride(0), y.stride(0), y.stride(0),
            HAS_BIAS=False, HAS_RESIDUAL=False, IEEE=x.dtype == torch.float32 or _interpreting(),
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SWIGLU=True, LIBDEVICE=not _interpreting(),
            num_warps=warps, num_stages=stages)
    return y.reshape(*lead, f)


def _operands(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Size, torch.Tensor, torch.Tensor]:
    """x [..., K] -> (its leading dims, its rows [M, K]), and w: each with unit stride along K, copied only
    where it is not."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return x.shape[:-1], x2, (w if w.stride(-1) == 1 else w.contiguous())
