"""Dense linears on cuBLASLt with split-K forbidden (MEMRA_LINEAR_CUBLAS, off): another bit reference for the
exact path, held to row invariance on the running GPU before a model may use it.

cuBLAS picks its kernel from the shape of a call, which is why the exact path runs Triton's frozen tiles
(triton.linear) by default. What makes a row's bits follow the row count, though, is not the tile: it is
split-K (a row's K products summed in parts, then the parts added) and GEMV-shaped kernels that reduce in
another order. With split-K forbidden (torch's allow_bf16_reduced_precision_reduction = (False, False) on
cuBLASLt, as vLLM's batch-invariant mode sets on Hopper) the kernels cuBLASLt picks may all sum a row's
products in K order into one fp32 accumulator, and then a row's bits do not depend on M. That is a fact of
one cuBLAS build on one card, not a promise, so `row_failures` runs every dense weight shape of a model at
every row count a step can give it (ROW_COUNTS), and the model's load is refused in one line where any row
differs (memra.model.hybrid). The Triton kernels are never mixed in for the same weight: their bits differ.

SwiGLU's activation and the residual add run apart, with the meaning of the Triton kernels' fused epilogues:
silu_mul on the rounded products (triton.activation), then torch's add (fp32, rounded once).
The settings are process-wide (torch's cuBLAS flags); `configure` sets them when a table takes this family.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from memra.errors import MemraError
from memra.kernels.triton.activation import silu_mul

# Every row count a linear can see on the exact path: decode and mixed steps (up to 1,024 rows and a
# prompt bucket beside them) and prefill pieces (at most cache.PRIME_CHUNK_MAX_TOKENS = 4,096 tokens).
# Each up to 1,024, then every 8th: cuBLASLt's heuristics switch kernels at size thresholds, which a
# sparse sweep could step over where rows are few.
ROW_COUNTS = tuple(range(1, 1025)) + tuple(range(1032, 4097, 8))


def configure() -> None:
    """No split-K and no reduced-precision reduction, on cuBLASLt (the torch flags vLLM's Hopper mode sets)."""
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = (False, False)
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = (False, False)
    torch.backends.cuda.preferred_blas_library("cublaslt")


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
           residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ w[N, K]^T (+ b) (+ residual, added apart) -> [..., N] in x's dtype. x is made contiguous: a
    strided operand is another problem to cuBLAS's heuristics than the ones row_failures held."""
    y = F.linear(x.contiguous(), w, b)
    return y if residual is None else residual + y


def linear_silu_mul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """silu(x @ w[:F]^T) * (x @ w[F:]^T) -> [..., F]: the projection, then triton.activation.silu_mul."""
    return silu_mul(linear(x, w))


@torch.inference_mode()
def row_failures(shapes, dtype: torch.dtype, device: torch.device | str, row_counts=ROW_COUNTS,
                 fn=linear) -> list[str]:
    """For each weight shape (N, K): fn over the first M rows of one input, at every M of row_counts, against
    the same rows of the largest call, bit for bit. -> one line per shape whose rows changed (empty: none).
    fn: the linear under test (a canary passes one that breaks a bit)."""
    failures = []
    gen = torch.Generator(device="cpu").manual_seed(0)
    top = max(row_counts)
    for n, k in sorted(set(shapes)):
        w = (torch.randn(n, k, generator=gen) * 0.02).to(device=device, dtype=dtype)
        x = torch.randn(top, k, generator=gen).to(device=device, dtype=dtype)
        full = fn(x, w)
        bad = [m for m in row_counts if m < top and not torch.equal(fn(x[:m], w), full[:m])]
        if bad:
            failures.append(f"[{n}x{k}] at {len(bad)} row counts ({', '.join(map(str, bad[:4]))}"
                            f"{' ...' if len(bad) > 4 else ''})")
        del w, x, full
    return failures


_HELD: dict[tuple, list[str]] = {}  # row_failures per (shapes, dtype, device, rows, fn), once per process


def require_rows(shapes, dtype: torch.dtype, device: torch.device | str, rows=ROW_COUNTS, fn=linear) -> None:
    """configure(), then refuse (one line, before any token) where a shape's rows change with the row count."""
    configure()
    device = torch.device(device)
    key = (tuple(sorted(set(shapes))), str(dtype), str(device), rows, fn)
    if key not in _HELD:
        _HELD[key] = row_failures(key[0], dtype, device, rows, fn)
    if _HELD[key]:
        card = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        raise MemraError(f"MEMRA_LINEAR_CUBLAS=1 refused on {card}: cuBLAS gave rows whose bits change with the row "
                         f"count for {'; '.join(_HELD[key][:2])}; unset MEMRA_LINEAR_CUBLAS to run the Triton kernels")
