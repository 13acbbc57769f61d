"""Dense linears of more than CUBLAS_ABOVE rows on cuBLASLt with split-K forbidden (MEMRA_LINEAR_CUBLAS, on), with
the Triton kernels' bits, held to them on the running GPU before a model may use it.

cuBLAS picks its kernel from the shape of a call, which is why the exact path runs Triton's frozen tiles
(triton.linear). What makes a row's bits follow the row count, though, is not the tile: it is split-K (a row's K
products summed in parts, then the parts added) and GEMV-shaped kernels that reduce in another order. With
split-K forbidden (torch's allow_bf16_reduced_precision_reduction = (False, False) on cuBLASLt, as vLLM's
batch-invariant mode sets on Hopper), an H100's cuBLASLt (torch 2.11, CUDA 13.0) gave every row of the Llama-3-8B
and Qwen3.5-9B projections and heads the same bits at 540 row counts from 1 to 8,192, and the same bits as
triton.linear's (tools/gpu_probe_cublas.py; presumably because both sum a row's products in K order, 16 at a
time, the MMA's step, into one fp32 accumulator). So the two can share a weight: Triton's tiles where cuBLAS is
slow (few rows: at 16 rows the Llama layer's linears took 15.0 ms on cuBLAS against 6.3), cuBLAS above (1.18x at
128 rows, 1.30x at 256, 1.19x at 772 on the same layer). That is a fact of one cuBLAS build on one card, not a
promise, so `hold_rows` runs every dense weight shape of a model at every row count cuBLAS takes (ROW_COUNTS)
against the Triton kernel's rows at load (memra.model.hybrid): only the shapes it held go to cuBLAS; a shape whose
rows differ anywhere keeps the Triton kernel at every M, and one line on stderr names it.

Above CUBLAS_ABOVE, SwiGLU's activation and the residual add run apart, with the meaning of the Triton kernels'
fused epilogues: silu_mul on the rounded products (triton.activation), then torch's add (fp32, rounded once).
The settings are process-wide (torch's cuBLAS flags); `hold_rows` sets them when a model takes this family.
"""

from __future__ import annotations

import contextlib
import sys

import torch
import torch.nn.functional as F

from memra.kernels.triton import linear as bucket
from memra.kernels.triton.activation import silu_mul

# Rows at or below which the Triton bucket kernel runs (its GEMV and 64-row tiles; cuBLAS without split-K is
# 2.4x slower than them at 16 rows on an H100).
CUBLAS_ABOVE = 64

# Weights of fewer outputs (N) than this keep the Triton kernel without being probed: cuBLAS runs such a call as
# a GEMV, which sums a row in another order (an H100 gave the Qwen3.5-35B-A3B's one-column shared-expert gate,
# [1x2048], other rows than the Triton kernel's at 438 of the row counts), and their arithmetic is negligible.
CUBLAS_MIN_N = 16

# Every row count cuBLAS can be given on the exact path: decode and mixed steps (up to 1,024 rows and a prompt
# bucket beside them) and prefill pieces (at most cache.PRIME_CHUNK_MAX_TOKENS = 4,096 tokens). Each up to
# 1,024, then every 8th: cuBLASLt's heuristics switch kernels at size thresholds, which a sparse sweep could
# step over where rows are few.
ROW_COUNTS = tuple(range(CUBLAS_ABOVE + 1, 1025)) + tuple(range(1032, 4097, 8))


def _flags() -> tuple:
    m = torch.backends.cuda.matmul
    return m.allow_bf16_reduced_precision_reduction, m.allow_fp16_reduced_precision_reduction, \
        torch.backends.cuda.preferred_blas_library()


def _set_flags(bf16, fp16, library) -> None:
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = bf16
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = fp16
    if torch.backends.cuda.is_built():  # a CPU build of torch has no cuBLAS to prefer, and refuses the call
        torch.backends.cuda.preferred_blas_library(library)


_BEFORE: list[tuple] = []  # torch's flags as configure() first found them (the process's own)


def configure() -> None:
    """No split-K and no reduced-precision reduction, on cuBLASLt (the torch flags vLLM's Hopper mode sets)."""
    if not _BEFORE:
        _BEFORE.append(_flags())
    _set_flags((False, False), (False, False), "cublaslt")


@contextlib.contextmanager
def torch_defaults():
    """torch's cuBLAS flags as they were before configure(), for the duration: for code that is not memra's and
    should run as it would alone (the HF peer of `memra bench model`: split-K is much of its speed at few rows)."""
    if not _BEFORE:  # never configured: nothing to undo
        yield
        return
    _set_flags(*_BEFORE[0])
    try:
        yield
    finally:  # memra's again (read back, a flag set as (False, False) gives only its first half)
        configure()


def _rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1]


def on_cublas(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ w[N, K]^T on cuBLAS (what hold_rows holds). x is made contiguous: a strided operand is
    another problem to cuBLAS's heuristics than the ones the check ran."""
    return F.linear(x.contiguous(), w)


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
           residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ w[N, K]^T (+ b) (+ residual) -> [..., N] in x's dtype, with triton.linear's bits. A bias
    (Qwen2's qkv) keeps the Triton kernel at every M: it is added before the rounding there, and cuBLAS's bias
    epilogue is not among what hold_rows holds; so does a weight whose shape it has not held."""
    if _rows(x) <= CUBLAS_ABOVE or b is not None or (*w.shape, w.dtype) not in HELD_SHAPES:
        return bucket.linear(x, w, b, residual)
    y = on_cublas(x, w)
    return y if residual is None else residual + y


def linear_silu_mul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """silu(x @ w[:F]^T) * (x @ w[F:]^T) -> [..., F]: triton.linear's fused kernel, or the projection on cuBLAS
    then triton.activation.silu_mul."""
    if _rows(x) <= CUBLAS_ABOVE or (*w.shape, w.dtype) not in HELD_SHAPES:
        return bucket.linear_silu_mul(x, w)
    return silu_mul(on_cublas(x, w))


@torch.inference_mode()
def row_failures(shapes, dtype: torch.dtype, device: torch.device | str, row_counts=None, fn=None,
                 reference=None) -> dict[tuple[int, int], str]:
    """For each weight shape (N, K): fn (default on_cublas) over the first M rows of one input, at every M of
    row_counts (default ROW_COUNTS), against the same rows of `reference` (default the Triton kernel,
    triton.linear.linear, itself row-invariant: the self-test's probes) over the largest, bit for bit.
    -> {(N, K): one line saying where its rows differ}, for the shapes whose rows differ (empty: none)."""
    row_counts = ROW_COUNTS if row_counts is None else row_counts
    fn = on_cublas if fn is None else fn
    reference = bucket.linear if reference is None else reference
    failures = {}
    gen = torch.Generator(device="cpu").manual_seed(0)
    top = max(row_counts)
    for n, k in sorted(set(shapes)):
        w = (torch.randn(n, k, generator=gen) * 0.02).to(device=device, dtype=dtype)
        x = torch.randn(top, k, generator=gen).to(device=device, dtype=dtype)
        full = reference(x, w)
        bad = [m for m in row_counts if not torch.equal(fn(x[:m], w), full[:m])]
        if bad:
            failures[n, k] = (f"[{n}x{k}] at {len(bad)} row counts ({', '.join(map(str, bad[:4]))}"
                              f"{' ...' if len(bad) > 4 else ''})")
        del w, x, full
    return failures


_HELD: dict[tuple, dict] = {}  # row_failures per (shapes, dtype, device), once per process
# (N, K, dtype) of the weights whose cuBLAS rows hold_rows held to the Triton kernel's: the only ones `linear`
# gives to cuBLAS, so a weight a model's list of linears missed, or one whose rows differ, runs with the Triton bits.
HELD_SHAPES: set[tuple] = set()


def hold_rows(shapes, dtype: torch.dtype, device: torch.device | str) -> dict[tuple[int, int], str]:
    """configure(), then hold cuBLAS's rows to the Triton kernel's on these weight shapes (row_failures'
    defaults), once per process: mark the shapes that held, and say in one line on stderr which did not (they
    keep the Triton kernel at every M). Shapes of fewer than CUBLAS_MIN_N outputs are left out: unheld, unprobed
    and unnamed. -> row_failures' answer."""
    configure()
    device = torch.device(device)
    key = (tuple(sorted({(n, k) for n, k in shapes if n >= CUBLAS_MIN_N})), str(dtype), str(device))
    if key not in _HELD:
        _HELD[key] = failed = row_failures(key[0], dtype, device)
        if device.type == "cuda":  # the probe's outputs of many sizes, back to the driver: pools are sized from it
            torch.cuda.empty_cache()
        HELD_SHAPES.update((n, k, dtype) for n, k in key[0] if (n, k) not in failed)
        if failed:
            card = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
            print(f"memra: on {card} cuBLAS gave rows other than the Triton kernel's for {'; '.join(failed.values())}: "
                  f"those weights keep the Triton kernel (MEMRA_LINEAR_CUBLAS)", file=sys.stderr)
    return _HELD[key]
