"""Rotary embedding in Triton: the reference's five elementwise kernels in one launch (reference.apply_rope),
and the attention's whole step between projection and attention in one launch (reference.rope_write_kv:
rotate q and k, write k and v into the paged pool: two ropes and two scatters before)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from memra.kernels.triton.launch import lean


# MEMRA_ROPE_TILE (on): heads a program of the two kernels below takes (1 with the door shut: a program per
# (token, head)). One head a program, a prefill wave of 770 tokens of the Llama-3-8B shape launched 37k
# programs of 128 values a layer, each too small to keep memory busy; with 8, the launch took 5.4 us against
# 23.5 on one H100 (tools/gpu_profile_rope.py), and 1 token 1.5 against 1.4.
ROPE_TILE_HEADS = 8


@triton.jit
def _rotated(base, cos_ptr, sin_ptr, t, c, D, R, live, HALF: tl.constexpr, ty: tl.constexpr):
    # Heads of D channels at `base` ([HB, 1] pointers, each head's channels contiguous; c [1, BLOCK_D]), the
    # first R rotated NeoX style with token t's tables; `live` [HB, 1] masks the heads past the last. The
    # reference's five elementwise kernels (neg, cat, two muls, add) in one, rounding to the model dtype
    # after each product and after the sum as the reference does. Measured on the H200 this is within one
    # rounding of the reference, not always its bits (it is elementwise, so a value's bits never depend on
    # the batch, nor on how many heads a program takes; the exact and the fast path both use it, so
    # prefill, decode and verify agree). Both kernels below call this one body: their bits are equal.
    x = tl.load(base + c, mask=(c < D) & live, other=0.0)
    in_rot = c < R
    partner = tl.where(c < HALF, c + HALF, c - HALF)
    xp = tl.load(base + partner, mask=in_rot & live, other=0.0).to(tl.float32)
    rotated = tl.where(c < HALF, -xp, xp)
    cos = tl.load(cos_ptr + t * R + c, mask=in_rot, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + t * R + c, mask=in_rot, other=0.0).to(tl.float32)
    a = (x.to(tl.float32) * cos).to(ty)
    b = (rotated * sin).to(ty)
    return tl.where(in_rot, (a.to(tl.float32) + b.to(tl.float32)).to(ty), x)


@lean
@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, y_ptr, H, stride_xt, stride_xh, D, R, HALF: tl.constexpr,
                 BLOCK_D: tl.constexpr, HB: tl.constexpr):
    # One program per (token, HB heads).
    t = tl.program_id(0)
    h = tl.program_id(1) * HB + tl.arange(0, HB)[:, None]  # [HB, 1]
    c = tl.arange(0, BLOCK_D)[None, :]  # [1, BLOCK_D]
    live = h < H
    y = _rotated(x_ptr + t * stride_xt + h * stride_xh, cos_ptr, sin_ptr, t, c, D, R, live, HALF,
                 y_ptr.dtype.element_ty)
    tl.store(y_ptr + (t * H + h) * D + c, y, mask=(c < D) & live)


@lean
@triton.jit
def _rope_write_kv_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, rows_ptr, qo_ptr, kp_ptr, vp_ptr, HQ, HKV,
                          sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, D, R, HALF: tl.constexpr, BLOCK_D: tl.constexpr,
                          HB: tl.constexpr):
    # Program (token t, group j of HB heads: the query heads' groups, then the key heads', then the value
    # heads'): query heads are rotated into qo; key heads rotated and value heads copied straight into
    # the pool row rows[t] (flat: block * BLOCK_SIZE + offset), so the separately rotated K and V never exist.
    t = tl.program_id(0)
    j = tl.program_id(1)
    nq = (HQ + HB - 1) // HB
    nk = (HKV + HB - 1) // HB
    hh = tl.arange(0, HB)[:, None]  # [HB, 1]
    c = tl.arange(0, BLOCK_D)[None, :]  # [1, BLOCK_D]
    ty = qo_ptr.dtype.element_ty
    if j < nq:
        h = j * HB + hh
        live = h < HQ
        y = _rotated(q_ptr + t * sq_t + h * sq_h, cos_ptr, sin_ptr, t, c, D, R, live, HALF, ty)
        tl.store(qo_ptr + (t * HQ + h) * D + c, y, mask=(c < D) & live)
    else:
        row = tl.load(rows_ptr + t)
        if j < nq + nk:
            kh = (j - nq) * HB + hh
            live = kh < HKV
            y = _rotated(k_ptr + t * sk_t + kh * sk_h, cos_ptr, sin_ptr, t, c, D, R, live, HALF, ty)
            tl.store(kp_ptr + (row * HKV + kh) * D + c, y, mask=(c < D) & live)
        else:
            vh = (j - nq - nk) * HB + hh
            live = vh < HKV
            x = tl.load(v_ptr + t * sv_t + vh * sv_h + c, mask=(c < D) & live, other=0.0)
            tl.store(vp_ptr + (row * HKV + vh) * D + c, x, mask=(c < D) & live)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int = 1) -> torch.Tensor:
    """Same contract as reference.apply_rope: x [T, H, D] (any strides over T and H), cos/sin [T, R]
    -> [T, H, D] contiguous, the first R channels of each head rotated NeoX style. heads: how many a
    program takes (1, or ROPE_TILE_HEADS where MEMRA_ROPE_TILE is open); the same bits."""
    t, h, d = x.shape
    r = cos.shape[-1]
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty((t, h, d), dtype=x.dtype, device=x.device)
    if t * h:
        _rope_kernel[(t, triton.cdiv(h, heads))](x, cos.contiguous(), sin.contiguous(), y, h, x.stride(0),
                                                 x.stride(1), d, r, HALF=r // 2, BLOCK_D=triton.next_power_of_2(d),
                                                 HB=heads)
    return y


def rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_pool: torch.Tensor, v_pool: torch.Tensor, rows: torch.Tensor, heads: int = 1) -> torch.Tensor:
    """Same contract as reference.rope_write_kv: q [T, Hq, D], k/v [T, Hkv, D] (any strides over T and
    H), cos/sin [T, R], k/v_pool [n_blocks, BLOCK, Hkv, D], rows [T] flat pool rows -> rotated q
    [T, Hq, D] contiguous; k rotated and v written to the pool rows. Bits: apply_rope's, then a copy.
    heads: as apply_rope's."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    qo = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    if t:
        groups = triton.cdiv(hq, heads) + 2 * triton.cdiv(hkv, heads)
        _rope_write_kv_kernel[(t, groups)](q, k, v, cos.contiguous(), sin.contiguous(), rows.contiguous(), qo,
                                           k_pool, v_pool, hq, hkv, q.stride(0), q.stride(1), k.stride(0),
                                           k.stride(1), v.stride(0), v.stride(1), d, cos.shape[-1],
                                           HALF=cos.shape[-1] // 2, BLOCK_D=triton.next_power_of_2(d), HB=heads)
    return qo
