"""Gated DeltaNet's chunked prefill as one Triton launch per layer (the delta rule over a prompt piece).

The reference (reference.gdn_prefill) runs the closed (WY) form chunk by chunk from the host: ~25 torch
launches per 64-token chunk, so a 4096-token piece of a 24-GDN-layer model issues ~40k launches. Here
one program per (value head, block of value columns) walks all the piece's chunks in order with its
columns of the state in registers, and per chunk of n <= 64 tokens computes (G = cumsum(g), Gamma_ij =
exp(G_i - G_j) for i >= j, else 0):

    A   = strict_lower(diag(beta) K K^T * Gamma)                     [n, n]
    T   = (I + A)^-1 = (I - A)(I + A^2)(I + A^4)(I + A^8)(I + A^16)(I + A^32)
          (A is strictly lower triangular, so A^64 = 0: five squarings replace the triangular solve's
          64 dependent row steps with tensor-shaped products)
    U   = T diag(beta) V          W = T diag(beta exp(G)) K
    V'  = U - W S                  O = diag(exp(G)) Q S + (Q K^T * Gamma) V'
    S'  = exp(G_last) S + (diag(exp(G_last - G)) K)^T V'

Same meaning as the reference; the sums differ in order (and T is a product rather than a
substitution), so the twin test allows fp32 rounding noise. Bits: chunks are cut at absolute multiples
of the chunk length (the same cuts as the reference), and a chunk's arithmetic reads only its own
tokens and the state it is handed, so a token's output does not depend on how the prompt was split
into pieces (E5) -- tested bit for bit. Every dot is fp32 (input_precision="ieee": no TF32).

Status: built and checked in Triton's interpreter; behind MEMRA_GDN_KERNEL (off by default) until it
has been measured on a GPU against the reference (register pressure at Dk = 128 is the open question).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from memra.kernels.exact import aligned_cuts
from memra.kernels.reference import GDN_CHUNK
GDN_PREFILL_BLOCK_DV = 32  # value columns of the state per program
GDN_PREFILL_WARPS = 8


@triton.jit
def _dot(a, b):
    return tl.dot(a, b, input_precision="ieee")


@triton.jit(do_not_specialize=["n_chunks"])
def _gdn_prefill_kernel(q_ptr, k_ptr, v_ptr, beta_ptr, g_ptr, s_ptr, o_ptr, s_out_ptr, cuts_ptr, n_chunks, H,
                        DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
                        CHUNK: tl.constexpr):
    h = tl.program_id(0)
    cv = tl.program_id(1) * BLOCK_DV + tl.arange(0, BLOCK_DV)
    ck = tl.arange(0, BLOCK_DK)
    rc = tl.arange(0, CHUNK)
    mk, mv = ck < DK, cv < DV
    s = tl.load(s_ptr + h * DK * DV + ck[:, None] * DV + cv[None, :], mask=mk[:, None] & mv[None, :], other=0.0)
    eye = tl.where(rc[:, None] == rc[None, :], 1.0, 0.0)
    below = rc[:, None] > rc[None, :]
    for c in range(n_chunks):
        a = tl.load(cuts_ptr + c)
        n = tl.load(cuts_ptr + c + 1) - a
        t = a + rc
        mt = rc < n
        kq_mask = mt[:, None] & mk[None, :]
        kc = tl.load(k_ptr + (t[:, None] * H + h) * DK + ck[None, :], mask=kq_mask, other=0.0)  # [C, DK]
        qc = tl.load(q_ptr + (t[:, None] * H + h) * DK + ck[None, :], mask=kq_mask, other=0.0)
        vc = tl.load(v_ptr + (t[:, None] * H + h) * DV + cv[None, :], mask=mt[:, None] & mv[None, :], other=0.0)
        beta = tl.load(beta_ptr + t * H + h, mask=mt, other=0.0)  # [C]; padding rows: beta = 0, g = 0
        gcum = tl.cumsum(tl.load(g_ptr + t * H + h, mask=mt, other=0.0), axis=0)  # G
        # Gamma_ij = exp(G_i - G_j) on and below the diagonal (<= 1: the decays are <= 0), zero above
        gamma = tl.where(rc[:, None] >= rc[None, :], tl.exp(gcum[:, None] - gcum[None, :]), 0.0)
        amat = tl.where(below, beta[:, None] * _dot(kc, tl.trans(kc)) * gamma, 0.0)
        inv = eye - amat  # (I + A)^-1 as (I - A) times (I + A^(2^i)), i = 1..5
        power = _dot(amat, amat)
        for i in tl.static_range(5):
            inv = _dot(inv, eye + power)
            if i < 4:
                power = _dot(power, power)
        u = _dot(inv, beta[:, None] * vc)  # [C, DV]
        w = _dot(inv, (beta * tl.exp(gcum))[:, None] * kc)  # [C, DK]
        v_new = u - _dot(w, s)
        out = _dot(tl.exp(gcum)[:, None] * qc, s) + _dot(_dot(qc, tl.trans(kc)) * gamma, v_new)
        tl.store(o_ptr + (t[:, None] * H + h) * DV + cv[None, :], out, mask=mt[:, None] & mv[None, :])
        g_last = tl.sum(tl.where(rc == n - 1, gcum, 0.0), axis=0)
        s = s * tl.exp(g_last) + _dot(tl.trans(tl.exp(g_last - gcum)[:, None] * kc), v_new)
    tl.store(s_out_ptr + h * DK * DV + ck[:, None] * DV + cv[None, :], s, mask=mk[:, None] & mv[None, :])


def gdn_prefill(q, k, v, beta, g, state, pos0: int):
    """The delta rule over T prompt tokens at absolute position pos0, in chunks cut at multiples of
    GDN_CHUNK. q, k [T, Hv, Dk] (l2-normalised, q scaled), v [T, Hv, Dv], beta, g [T, Hv], state
    [Hv, Dk, Dv], all fp32 -> (o [T, Hv, Dv], final state). Same contract as reference.gdn_prefill."""
    t, h, dk = q.shape
    dv = v.shape[-1]
    cuts = aligned_cuts(t, pos0, GDN_CHUNK)
    bounds = torch.tensor([a for a, _ in cuts] + [t], dtype=torch.int32, device=q.device)
    args = [x.contiguous().float() for x in (q, k, v, beta, g)]
    o = torch.empty(t, h, dv, dtype=torch.float32, device=q.device)
    s_out = torch.empty(h, dk, dv, dtype=torch.float32, device=q.device)
    if t:
        _gdn_prefill_kernel[(h, triton.cdiv(dv, GDN_PREFILL_BLOCK_DV))](
            *args, state.contiguous(), o, s_out, bounds, len(cuts), h, DK=dk, DV=dv,
            BLOCK_DK=triton.next_power_of_2(dk), BLOCK_DV=GDN_PREFILL_BLOCK_DV, CHUNK=GDN_CHUNK,
            num_warps=GDN_PREFILL_WARPS)
    else:
        s_out.copy_(state)
    return o, s_out
