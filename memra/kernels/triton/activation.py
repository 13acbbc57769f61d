"""SwiGLU's activation in one Triton launch: silu(gate) * up over the gate|up projection [T, 2F] -> [T, F]
(reference.silu_mul, whose torch form is two elementwise launches with the SiLU's [T, F] written to
memory and read back: on the 8B shape ~8% of a 4096-token prefill, and 32 launches of every decode step).

The arithmetic is torch's, step by step, so on a GPU the bits are torch's too (tested with torch.equal
under MEMRA_TEST_DEVICE=cuda): SiLU in fp32 as x / (1 + exp(-x)) with CUDA's own expf (libdevice) and an
IEEE division, rounded to the model dtype; then the product in fp32, rounded again. It is elementwise, so
a value's bits never depend on how many rows share the call or where its row sits. Triton's interpreter
has no libdevice: there (the CPU tests) the kernel takes tl.exp, and the tests check the layout and the
rounding steps, the GPU test the bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from memra.kernels.triton.common import _interpreting, round_to_dtype
from memra.kernels.triton.launch import lean

SILU_BLOCK = 1024  # feature columns per program (8 per thread at 4 warps: 16-byte loads of bf16)


@triton.jit
def silu_mul_values(g, u, ty: tl.constexpr, LIBDEVICE: tl.constexpr):
    """silu(g) * u in dtype `ty`, from g and u held in fp32 (values of `ty`), with torch's steps. Shared
    with the gate/up projection's epilogue (triton.linear), so the two give one set of bits."""
    e = libdevice.exp(-g) if LIBDEVICE else tl.exp(-g)
    s = round_to_dtype(tl.math.div_rn(g, 1.0 + e), ty)
    return round_to_dtype(s * u, ty).to(ty)


@triton.jit
def sigmoid_values(g, ty: tl.constexpr, LIBDEVICE: tl.constexpr):
    """torch.sigmoid of g (a block, fp32 holding values of `ty`) in dtype `ty`, with torch's steps: 1 / (1 +
    exp(-g)) in fp32 with CUDA's expf and an IEEE division, rounded once (the MoE shared expert's gate,
    triton.moe)."""
    e = libdevice.exp(-g) if LIBDEVICE else tl.exp(-g)
    return round_to_dtype(tl.math.div_rn(tl.full(g.shape, 1.0, tl.float32), 1.0 + e), ty)


@lean
@triton.jit
def _silu_mul_kernel(x_ptr, y_ptr, F, stride_x, stride_y, BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr):
    # Program (row, block of features): gate at columns [0, F), up at [F, 2F) of the row.
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = c < F
    row = x_ptr + t * stride_x
    ty = y_ptr.dtype.element_ty
    g = tl.load(row + c, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(row + F + c, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + t * stride_y + c, silu_mul_values(g, u, ty, LIBDEVICE), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2F] (gate | up) -> silu(gate) * up [..., F], one launch."""
    two_f = gate_up.shape[-1]
    x = gate_up.reshape(-1, two_f)
    if x.stride(-1) != 1:
        x = x.contiguous()
    f = two_f // 2
    y = torch.empty(x.shape[0], f, dtype=x.dtype, device=x.device)
    if x.shape[0]:
        _silu_mul_kernel[(x.shape[0], triton.cdiv(f, SILU_BLOCK))](
            x, y, f, x.stride(0), y.stride(0), BLOCK=SILU_BLOCK, LIBDEVICE=not _interpreting(), num_warps=4)
    return y.view(*gate_up.shape[:-1], f)
