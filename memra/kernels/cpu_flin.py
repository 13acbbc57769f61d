"""A row-invariant fp32 linear on CPU: memra/kernels/cpu/flin.cpp (built with the linears' library,
memra.kernels.cpu_qdot), behind MEMRA_CPU_FLIN.

torch's fp32 linear on CPU is MKL's, which picks its kernel by the row count M: a row's bits then depend on
how many rows share its call, so the CPU sampler decodes each sequence as its own B=1 step (the `row`
plan, memra.decode_plan) and an exact trainer must repeat those one-row steps token by token. This kernel
computes every output y[m, n] from x's row m and w's row n alone, in one fixed order (16 lanes of fused
multiply-adds over K, then one fixed tree: memra.kernels.flin_reference, its pure-torch twin), with threads
splitting weight rows only: a row's bits are the same at any M, at any place in the batch, at any thread
count (tests/test_cpu_flin.py). It is not MKL's bits (another order); the two agree to fp32 rounding.
"""

from __future__ import annotations

import functools

import torch

from memra.kernels import cpu_qdot


def supports(x: torch.Tensor, w) -> bool:
    """Can the kernel take x @ w^T? fp32 activations and a plain fp32 weight [N, K] on CPU."""
    return (x.dtype == torch.float32 and isinstance(w, torch.Tensor) and w.dtype == torch.float32 and w.dim() == 2
            and not x.is_cuda and not w.is_cuda and x.device.type == "cpu" and not (w.requires_grad or x.requires_grad))


@functools.cache
def level() -> int:
    """The best instruction level here: 0 scalar, 1 AVX2 + FMA, 2 AVX-512F (the same bits at every one)."""
    return int(cpu_qdot.library().memra_flin_level())


def outputs(at: int) -> int:
    """Outputs computed at instruction level `at` since load: the liveness counter of the path."""
    return int(cpu_qdot.library().memra_flin_outputs(at))


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, at: int | None = None,
           threads: int | None = None) -> torch.Tensor:
    """x [..., K] fp32 @ w [N, K]^T (+ bias [N]) -> [..., N] fp32: flin_reference.linear's bits. `at` caps the
    instruction level (0 scalar, 1 AVX2, 2 AVX-512; None: the CPU's best), `threads` the threads (None:
    torch's), for the tests between them. Lean on purpose: a decode step makes a few such calls a layer on
    small weights, where the Python around the C call is most of its cost."""
    fn, best = _bound or _bind()
    n, k = w.shape
    x2 = x if x.dim() == 2 else x.reshape(-1, k)
    if x2.stride(-1) != 1 or x2.stride(0) < k:
        x2 = x2.contiguous()
    if not w.is_contiguous():
        w = w.contiguous()
    m = x2.shape[0]
    out = torch.empty(m, n)
    if m and n:
        b = None if bias is None else bias.float().contiguous()
        fn(x2.data_ptr(), x2.stride(0), w.data_ptr(), None if b is None else b.data_ptr(), m, n, k, out.data_ptr(), n,
           torch.get_num_threads() if threads is None else threads, best if at is None else min(int(at), best))
    return out if x.dim() == 2 else out.view(*x.shape[:-1], n)


_bound: tuple | None = None  # (the C function, the CPU's level), bound at the first call


def _bind() -> tuple:
    global _bound
    _bound = (cpu_qdot.library().memra_flin, level())
    return _bound
