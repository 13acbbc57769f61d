"""Row norms in Triton (RMS, residual add + RMS, gated RMS): one program per row, the whole row in one
tile, so a row's sum is one tree of fixed shape whatever the number of rows (memra.kernels.triton.linear
says why that matters). Twins: reference.rms_norm, add_rms_norm, gated_rms_norm. (GDN's l2 norms run
inside memra.kernels.triton.gdn_heads.)"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from memra.kernels.triton.common import round_to_dtype
from memra.kernels.triton.launch import lean

RMS_ZERO_CENTRED, RMS_LLAMA = 0, 1


@lean
@triton.jit
def _row_norm_kernel(x_ptr, w_ptr, y_ptr, r_ptr, s_ptr, D, eps, H, stride_xt, stride_xh, MODE: tl.constexpr,
                     RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    # One program per row, the whole row in one tile: the sum is one tree of fixed shape. x's row
    # `row` is head row % H of token row // H (a [T, H, D] view, e.g. q and k inside a fused
    # projection's output, is read where it lies); r, s and y are contiguous rows.
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    at = (row // H).to(tl.int64) * stride_xt + (row % H) * stride_xh
    x = tl.load(x_ptr + at + cols, mask=mask, other=0.0).to(tl.float32)
    if RESIDUAL:  # x + r rounded to the dtype as torch's add rounds it, stored, then normalised
        x = x + tl.load(r_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
        s_ty = s_ptr.dtype.element_ty
        x = round_to_dtype(x, s_ty)
        tl.store(s_ptr + row * D + cols, x.to(s_ty), mask=mask)
    xn = x * (1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps))
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    out_ty = y_ptr.dtype.element_ty
    if MODE == 0:  # zero-centred style: multiply in fp32, round last
        tl.store(y_ptr + row * D + cols, (xn * w).to(out_ty), mask=mask)
    else:  # llama style: round the normalised row, multiply in the model dtype
        y = w.to(out_ty).to(tl.float32) * xn.to(out_ty).to(tl.float32)
        tl.store(y_ptr + row * D + cols, y.to(out_ty), mask=mask)


def _row_norm(x: torch.Tensor, w: torch.Tensor, eps: float, mode: int, out_dtype: torch.dtype,
              residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    d = x.shape[-1]
    if x.dim() in (2, 3) and x.stride(-1) == 1:  # rows read in place: no copy of a strided view first
        x2, h = x, (x.shape[1] if x.dim() == 3 else 1)
        strides = (x.stride(0), x.stride(1) if x.dim() == 3 else 0)
    else:
        x2, h = x.reshape(-1, d).contiguous(), 1
        strides = (d, 0)
    rows = x.numel() // d
    y = torch.empty(rows, d, dtype=out_dtype, device=x.device)
    r2 = residual.reshape(-1, d).contiguous() if residual is not None else None
    s = torch.empty(rows, d, dtype=x.dtype, device=x.device) if residual is not None else None
    if rows:
        _row_norm_kernel[(rows,)](x2, w, y, r2 if r2 is not None else y, s if s is not None else y, d, eps, h,
                                  *strides, MODE=mode, RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(d))
    return y.reshape(x.shape), (s.reshape(x.shape) if s is not None else None)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, zero_centered: bool) -> torch.Tensor:
    return _row_norm(x, w, eps, RMS_ZERO_CENTRED if zero_centered else RMS_LLAMA, x.dtype)[0]


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor, w: torch.Tensor, eps: float,
                 zero_centered: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, rms_norm(h + delta)) in one pass over the row: the residual add and the next
    pre-norm of a block, which otherwise write the sum and read it straight back. Same code as
    rms_norm on the rounded sum, so the same bits as the two ops apart."""
    y, s = _row_norm(h, w, eps, RMS_ZERO_CENTRED if zero_centered else RMS_LLAMA, h.dtype, residual=delta)
    return s, y


@lean
@triton.jit
def _gated_rms_norm_kernel(o_ptr, z_ptr, w_ptr, y_ptr, D, eps, stride_on, stride_oh, stride_zn, stride_zh,
                           BLOCK: tl.constexpr):
    # Program (token, head). o of another dtype (the delta rule's fp32) is rounded to the output's first,
    # as the cast the caller would otherwise launch rounds it; z may be a column slice of wider rows.
    n = tl.program_id(0)
    h = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    out_ty = y_ptr.dtype.element_ty
    o = tl.load(o_ptr + n * stride_on + h * stride_oh + cols, mask=mask, other=0.0).to(tl.float32)
    if o_ptr.dtype.element_ty != out_ty:
        o = round_to_dtype(o, out_ty)
    z = tl.load(z_ptr + n * stride_zn + h * stride_zh + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    row = n * tl.num_programs(1) + h
    on = o * (1.0 / tl.sqrt(tl.sum(o * o, axis=0) / D + eps))
    y = (w.to(out_ty).to(tl.float32) * on.to(out_ty).to(tl.float32)).to(out_ty).to(tl.float32)
    tl.store(y_ptr + row * D + cols, (y * (z / (1.0 + tl.exp(-z)))).to(out_ty), mask=mask)


def gated_rms_norm(o: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """o, z [N, H, D] (o of any float dtype, rounded to z's first; either may be strided by token and
    head) -> [N, H, D] of z's dtype, contiguous."""
    n, h, d = z.shape
    o, z = (t if t.stride(-1) == 1 else t.contiguous() for t in (o, z))
    y = torch.empty(n, h, d, dtype=z.dtype, device=z.device)
    if n * h:
        _gated_rms_norm_kernel[(n, h)](o, z, w, y, d, eps, o.stride(0), o.stride(1), z.stride(0), z.stride(1),
                                       BLOCK=triton.next_power_of_2(d))
    return y
