"""Gated DeltaNet's per-token preparation in one launch (Triton): from the conv output and the two gate
inputs to what the delta rule reads. Twin: reference.gdn_heads.

    mixed [N, 2*Hk*Dk + Hv*Dv] (q | k | v of the model dtype), b, a [N, Hv]
      q = l2_normalize(q) * Dk^-0.5, k = l2_normalize(k)   fp32 [N, Hv, Dk], each key head repeated
                                                            over its Hv/Hk value heads
      v                                                     fp32 [N, Hv, Dv]
      beta = sigmoid(b), decay = a_neg * softplus(a + dt_bias)   fp32 [N, Hv]

In torch these are some fifteen launches per GDN layer (casts, the two norms, the scale, two repeats,
the gate's five elementwise ops); a decode step of the 9B shape ran ~360 of them. One program per
(token, key head) does it all: the two l2 sums are each one tree over one head's Dk values, as in
memra.kernels.triton.norm, and everything else is elementwise, so a token's values do not depend on
how many tokens share the call (promise E1). Every path (prefill chunk, stacked decode, the verify's
tokens) prepares its heads here wherever Triton runs on CUDA, so they agree with each other bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from memra.kernels.triton.launch import lean


@triton.jit
def _softplus(x):
    """log(1 + e^x), as torch's softplus (threshold 20): log1p through log, exact to a rounding where
    1 + e^x rounds to 1 (Goldberg's form, since Triton has no log1p everywhere these kernels run)."""
    e = tl.exp(x)
    u = 1.0 + e
    small = u == 1.0
    log1p = tl.where(small, e, tl.log(u) * (e / tl.where(small, 1.0, u - 1.0)))
    return tl.where(x > 20.0, x, log1p)


@lean
@triton.jit
def _gdn_heads_kernel(m_ptr, b_ptr, a_ptr, a_neg_ptr, dt_bias_ptr, q_ptr, k_ptr, v_ptr, beta_ptr, decay_ptr,
                      stride_m, stride_b, stride_a, KEY_DIM, DK, DV, eps, scale,
                      RATIO: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    n = tl.program_id(0)
    g = tl.program_id(1)
    hv = tl.num_programs(1) * RATIO  # value heads
    dk = tl.arange(0, BLOCK_K)
    mk = dk < DK
    row = m_ptr + n.to(tl.int64) * stride_m
    q = tl.load(row + g * DK + dk, mask=mk, other=0.0).to(tl.float32)
    k = tl.load(row + KEY_DIM + g * DK + dk, mask=mk, other=0.0).to(tl.float32)
    q = q * (1.0 / tl.sqrt(tl.sum(q * q, axis=0) + eps)) * scale
    k = k * (1.0 / tl.sqrt(tl.sum(k * k, axis=0) + eps))
    dv = tl.arange(0, BLOCK_V)
    mv = dv < DV
    for j in tl.static_range(RATIO):
        h = g * RATIO + j
        out = n.to(tl.int64) * hv + h  # (token, value head)
        tl.store(q_ptr + out * DK + dk, q, mask=mk)
        tl.store(k_ptr + out * DK + dk, k, mask=mk)
        v = tl.load(row + 2 * KEY_DIM + h * DV + dv, mask=mv, other=0.0).to(tl.float32)
        tl.store(v_ptr + out * DV + dv, v, mask=mv)
        b = tl.load(b_ptr + n * stride_b + h).to(tl.float32)
        a = tl.load(a_ptr + n * stride_a + h).to(tl.float32)
        tl.store(beta_ptr + out, 1.0 / (1.0 + tl.exp(-b)))
        tl.store(decay_ptr + out, tl.load(a_neg_ptr + h) * _softplus(a + tl.load(dt_bias_ptr + h)))


def gdn_heads(mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor, a_neg: torch.Tensor, dt_bias: torch.Tensor,
              n_k_heads: int, n_v_heads: int, dk: int, dv: int, eps: float = 1e-6):
    """reference.gdn_heads in one launch. mixed [N, >= 2*Hk*Dk + Hv*Dv] and b, a [N, Hv] may be column
    slices of wider rows (the projection's split); a_neg, dt_bias [Hv] fp32 -> q, k, v, beta, decay."""
    n, dev = mixed.shape[0], mixed.device
    q = torch.empty(n, n_v_heads, dk, dtype=torch.float32, device=dev)
    k = torch.empty_like(q)
    v = torch.empty(n, n_v_heads, dv, dtype=torch.float32, device=dev)
    beta = torch.empty(n, n_v_heads, dtype=torch.float32, device=dev)
    decay = torch.empty_like(beta)
    mixed, b, a = (t if t.stride(-1) == 1 else t.contiguous() for t in (mixed, b, a))  # rows of unit stride
    if n:
        _gdn_heads_kernel[(n, n_k_heads)](mixed, b, a, a_neg, dt_bias, q, k, v, beta, decay,
                                          mixed.stride(0), b.stride(0), a.stride(0), n_k_heads * dk, dk, dv,
                                          eps, dk ** -0.5,
                                          RATIO=n_v_heads // n_k_heads, BLOCK_K=triton.next_power_of_2(dk),
                                          BLOCK_V=triton.next_power_of_2(dv))
    return q, k, v, beta, decay
