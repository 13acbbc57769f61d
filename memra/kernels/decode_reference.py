"""The pure-torch twin of memra/kernels/cpu/decode.cpp (RMSNorm, SwiGLU, decode attention on CPU): its
arithmetic, bit for bit.

  RMSNorm of a row x [n]: ss = tree8 of eight lanes of x_i * x_i, r = 1 / sqrt(ss / n + eps), y = w * (x * r).
  SwiGLU: e = exp_neg(-|g|), s = g >= 0 ? 1 / (1 + e) : e / (1 + e), y = (g * s) * u.
  GDN's q / k norm and one token of the gated delta rule (memra.kernels.cpu_gdn): gdn_heads_rows and
  delta_rule_step below.

Decode attention on CPU is one query per head over a paged prefix. Its torch form (reference.
paged_decode_attention) gathers the prefix, repeats each KV head over its query heads and leaves the
reduction orders to torch's matmul and softmax; the kernel reads the pool in place and fixes every
order, so this twin spells each step out as elementwise torch ops (each exactly rounded, in the same
order as the C code):

  RoPE, and the K/V write: reference.rope_write_kv itself (elementwise: the kernel gives its bits).
  score s_j = tree8(acc) * scale, acc_l = acc_l + q_{8t+l} * k_{j,8t+l} over t (l = 0..7; D a multiple of 8);
  p_j = exp_neg(s_j - max_j s_j); l = ((p_0 + p_1) + p_2) + ...; o = (p_0 v_0 + p_1 v_1) + ...; out = o / l.

A (row, head)'s output is a function of its query and its own prefix only, so its bits do not depend on
the batch, the chunking or the thread count (tests/test_cpu_decode.py). It is not the torch reference's
bits (another reduction order and exp): the two agree to fp32 rounding (~1e-6 relative).
"""

from __future__ import annotations

import numpy as np
import torch

from memra.kernels import reference

_f = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731 (constants as fp32, never promoted)
LOG2E, LN2_HI, LN2_LO, FLOOR = _f(1.44269504088896341), _f(0.693359375), _f(-2.12194440e-4), -87.0
POLY = [_f(c) for c in (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1,
                        5.0000001201e-1)]


def exp_neg(x: torch.Tensor) -> torch.Tensor:
    """exp(x) for fp32 x <= 0: n = round(x log2 e), r = x - n ln2 (Cody-Waite, two steps), Cephes' degree-5
    polynomial p(r), (p r^2 + r) + 1, times 2^n built from its bits; 0 below -87."""
    n = torch.round(x * LOG2E)
    r = x - n * LN2_HI
    r = r - n * LN2_LO
    p = POLY[0].expand_as(r)
    for c in POLY[1:]:
        p = p * r + c
    y = p * (r * r)
    y = y + r
    y = y + 1.0
    two_n = ((n.int() + 127) << 23).view(torch.float32)
    return torch.where(x < FLOOR, torch.zeros_like(y), y * two_n)


def tree8(a: torch.Tensor) -> torch.Tensor:
    """[..., 8] -> [...]: ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7))."""
    return ((a[..., 0] + a[..., 4]) + (a[..., 2] + a[..., 6])) + ((a[..., 1] + a[..., 5]) + (a[..., 3] + a[..., 7]))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [Hq, D] (rotated) over k, v [S, Hkv, D] (positions in order) -> [Hq, D]; query head h reads KV head
    h // (Hq / Hkv)."""
    hq, d = q.shape
    s_len, hkv = k.shape[0], k.shape[1]
    kv_head = torch.arange(hq) // (hq // hkv)
    kh, vh = k[:, kv_head], v[:, kv_head]  # [S, Hq, D]: the twin's gather; the kernel indexes
    prod = (q[None] * kh).view(s_len, hq, d // 8, 8)
    acc = torch.zeros(s_len, hq, 8)
    for t in range(d // 8):
        acc = acc + prod[:, :, t]
    scores = tree8(acc) * _f(scale)  # [S, Hq]
    p = exp_neg(scores - scores.amax(0))
    total, o = torch.zeros(hq), torch.zeros(hq, d)
    for j in range(s_len):
        total = total + p[j]
        o = o + p[j][:, None] * vh[j]
    return o / total[:, None]


def attend_rows(q: torch.Tensor, k_new: torch.Tensor | None, v_new: torch.Tensor | None, cos: torch.Tensor | None,
                sin: torch.Tensor | None, k_pool: torch.Tensor, v_pool: torch.Tensor, write_rows: torch.Tensor | None,
                read_rows: torch.Tensor, starts: list[int], lens: list[int], scale: float) -> torch.Tensor:
    """The kernel's call: q [R, Hq, D]; with k_new / v_new [R, Hkv, D], k rotated and both written to the pool
    rows write_rows [R] first (reference.rope_write_kv); with cos / sin [R, Rd] q is rotated. Then each row
    over read_rows[starts[r] : starts[r] + lens[r]]. -> [R, Hq, D]."""
    if k_new is not None:
        q = reference.rope_write_kv(q, k_new, v_new, cos, sin, k_pool, v_pool, write_rows) if cos is not None else q
        if cos is None:
            hkv, d = k_new.shape[1:]
            k_pool.view(-1, hkv, d).index_copy_(0, write_rows, k_new)
            v_pool.view(-1, hkv, d).index_copy_(0, write_rows, v_new)
    elif cos is not None:
        q = reference.apply_rope(q, cos, sin)
    hkv, d = k_pool.shape[-2:]
    kf, vf = k_pool.view(-1, hkv, d), v_pool.view(-1, hkv, d)
    out = [attend(q[r], kf[read_rows[a : a + n]], vf[read_rows[a : a + n]], scale)
           for r, (a, n) in enumerate(zip(starts, lens))]
    return torch.stack(out)


def lanes8(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """[..., n] . [..., n] -> [...]: eight lanes acc_l = acc_l + x_{8t+l} * y_{8t+l}, then tree8."""
    prod = (x * y).view(*x.shape[:-1], -1, 8)
    acc = torch.zeros(prod.shape[:-2] + (8,))
    for t in range(prod.shape[-2]):
        acc = acc + prod[..., t, :]
    return tree8(acc)


def sqrt(x: torch.Tensor) -> torch.Tensor:
    """The correctly rounded fp32 square root (C's sqrtf): numpy's. torch's CPU sqrt is not correctly
    rounded (its AVX-512 form differed in the last bit for 20% of random inputs)."""
    return torch.from_numpy(np.sqrt(x.numpy()))


def rms_rows(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of fp32 x (a multiple of 8 wide) with weight w: the kernel's order."""
    n = x.shape[-1]
    r = 1 / sqrt(lanes8(x, x) / n + _f(eps))
    return w * (x * r[..., None])


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2F] (gate | up) -> [..., F], fp32: SwiGLU through exp_neg."""
    g, u = gate_up.chunk(2, dim=-1)
    e = exp_neg(-g.abs())
    d = 1 + e
    s = torch.where(g >= 0, 1 / d, e / d)
    return (g * s) * u


def l2norm(x: torch.Tensor, eps: float, mul: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., D] / sqrt(lanes8(x, x) + eps), then * mul (GDN's q scale)."""
    y = x * (1 / sqrt(lanes8(x, x) + _f(eps)))[..., None]
    return y if mul is None else y * mul


def gdn_heads_rows(mixed: torch.Tensor, n_k_heads: int, n_v_heads: int, dk: int, eps: float = 1e-6):
    """mixed [N, C] (q | k | v) -> q, k [N, Hv, Dk]: each key head l2-normed (q times fp32 Dk^-0.5), then
    repeated over its Hv / Hk value heads (grouped: value head h reads key head h // (Hv / Hk))."""
    n, key_dim = mixed.shape[0], n_k_heads * dk
    q = l2norm(mixed[:, :key_dim].reshape(n, n_k_heads, dk), eps, _f(dk ** -0.5))
    k = l2norm(mixed[:, key_dim : 2 * key_dim].reshape(n, n_k_heads, dk), eps)
    ratio = n_v_heads // n_k_heads
    return q.repeat_interleave(ratio, dim=1), k.repeat_interleave(ratio, dim=1)


def delta_rule_step(q, k, v, beta, g, s):
    """One token of the delta rule in the kernel's order: q, k [..., Dk], v [..., Dv], beta, g [...],
    s [..., Dk, Dv] -> (o [..., Dv], new s). e = exp_neg(g); over i = 0..Dk-1 in order S_i = S_i * e and
    m = m + S_i * k_i; d = (v - m) * beta; over i in order S_i = S_i + k_i * d and o = o + S_i * q_i."""
    s = s * exp_neg(g)[..., None, None]
    m = torch.zeros_like(v)
    for i in range(q.shape[-1]):
        m = m + s[..., i, :] * k[..., i, None]
    d = (v - m) * beta[..., None]
    s = s + k[..., :, None] * d[..., None, :]
    o = torch.zeros_like(v)
    for i in range(q.shape[-1]):
        o = o + s[..., i, :] * q[..., i, None]
    return o, s
