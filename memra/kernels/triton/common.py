"""What several Triton families share: whether Triton's interpreter runs them (TRITON_INTERPRET, CI's CPU
runs), the count of kernels compiled, fp32 -> bf16 rounding to nearest-even in bit arithmetic, and the output
buffer a launch writes (a caller's, or a new one)."""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from memra import counters
from memra.settings import process_env


def output_buffer(out: torch.Tensor | None, shape: tuple, dtype: torch.dtype, device) -> torch.Tensor:
    """The output a launch writes: the caller's `out` (contiguous, of that dtype and element count, viewed as
    `shape`: a mixed step's rows of its whole output) or a new one."""
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    assert out.dtype == dtype and out.is_contiguous() and out.numel() == math.prod(shape), f"out: {dtype}, contiguous"
    return out.view(shape)


@functools.cache
def _interpreting() -> bool:
    """Triton's own switch (tests on CPU). Read once: Triton fixes it when a kernel is first decorated,
    and the launch wrappers ask on every call, which must not read the environment each time."""
    return process_env().get("TRITON_INTERPRET", "0") == "1"


def count_compiles() -> None:
    """From now on, count every kernel Triton compiles in this process (or loads from its disk cache)
    in the liveness counter `kernel_compiles` (on /metrics as memra:kernel_compiles_total): after the
    warm-up each one is a step that stalled for it. Through Triton's own post-compile hook, chained
    after any hook already there; a second call changes nothing (memra.kernels.triton_twins.triton_ops calls it)."""
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_post_compile_hook"):
        return  # a Triton without the hook: the counter stays at 0
    previous = runtime.jit_post_compile_hook
    if getattr(previous, "counts_kernel_compiles", False):
        return

    def counted(*args, **kwargs):
        counters.bump("kernel_compiles")
        return previous(*args, **kwargs) if previous is not None else None

    counted.counts_kernel_compiles = True
    runtime.jit_post_compile_hook = counted


@triton.jit
def round_to_bf16(w):
    """fp32 -> the nearest bf16 value (ties to even), still held in fp32, for finite values; NaN stays NaN.
    Bit arithmetic rather than a cast, because a cast does not round to nearest everywhere these kernels
    run (Triton's interpreter truncates), and the kernels that use this promise torch's bits."""
    bits = w.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return tl.where(w != w, w, rounded.to(tl.float32, bitcast=True))


@triton.jit
def round_to_dtype(x, ty: tl.constexpr):
    """fp32 -> the nearest value of dtype `ty` (held in fp32): what torch's store into a `ty` tensor keeps."""
    if ty == tl.bfloat16:
        return round_to_bf16(x)
    return x.to(ty).to(tl.float32)


@triton.jit
def both(mask, cond):
    """`mask & cond`, a boolean block, for a block mask and a scalar condition. Spelled as a comparison
    because Triton 3.7+'s interpreter types a boolean block & a boolean scalar as an integer block, which
    tl.load and tl.store refuse as a mask; compiled, the comparison folds away."""
    return (mask & cond) != 0

