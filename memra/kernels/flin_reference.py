"""The pure-torch twin of memra/kernels/cpu/flin.cpp (the row-invariant fp32 linear, memra.kernels.cpu_flin):
its arithmetic, bit for bit.

    acc[l] = fma(x[16t + l], w[16t + l], acc[l])   for t = 0, 1, ... (lane l < 16; the tail's lanes < K % 16)
    s8[l] = acc[l] + acc[l + 8]; s4[l] = s8[l] + s8[l + 4]; s2[l] = s4[l] + s4[l + 2]; y = s2[0] + s2[1]
    y = y + b                                          (a bias)

torch has no fp32 fused multiply-add, so `fma` makes one: the product of two fp32 values is exact in fp64,
the sum is rounded to odd there (round to nearest, then one ulp toward the exact error TwoSum gives, where
the nearest was even and inexact), and rounding that to fp32 gives the correctly rounded a * b + c
(Boldo & Melquiond, "Emulation of FMA and correctly rounded sums: proved algorithms using rounding to odd",
2008: 53 >= 2 * 24 + 2). fp64 holds one step's exact value only; every lane's sum lives in fp32.
"""

from __future__ import annotations

import torch

LANES = 16


def fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 a * b + c with one rounding (broadcasting), as std::fmaf / vfmadd give it."""
    p = a.double() * b.double()  # exact: 24 + 24 bits of significand, fp64's exponent range
    cd = c.double().expand_as(p) if c.dim() < p.dim() else c.double()
    s = p + cd
    bv = s - p
    err = (p - (s - bv)) + (cd - bv)  # TwoSum: s + err == p + c exactly
    even = (s.view(torch.int64) & 1) == 0
    toward = torch.where(err > 0, torch.full_like(s, float("inf")), torch.full_like(s, float("-inf")))
    odd = torch.where((err != 0) & even, torch.nextafter(s, toward), s)
    return odd.float()


def tree16(acc: torch.Tensor) -> torch.Tensor:
    """acc [..., 16] -> [...]: the kernel's horizontal sum, pairs (l, l+8), (l, l+4), (l, l+2), (0, 1)."""
    while acc.shape[-1] > 1:
        half = acc.shape[-1] // 2
        acc = acc[..., :half] + acc[..., half:]
    return acc[..., 0]


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] fp32 @ w [N, K]^T (+ b [N]) -> [..., N] fp32, in the kernel's order."""
    n, k = w.shape
    x2 = x.reshape(-1, k).float()
    acc = torch.zeros(x2.shape[0], n, LANES)  # [M, N, 16] fp32: each output's lanes
    for t in range(0, k, LANES):
        r = min(LANES, k - t)
        xs, ws = x2[:, None, t : t + r], w.float()[None, :, t : t + r]  # [M, 1, r], [1, N, r]
        acc = torch.cat((fma(xs, ws, acc[..., :r]), acc[..., r:]), dim=-1)
    y = tree16(acc)
    if b is not None:
        y = y + b.float()
    return y.reshape(*x.shape[:-1], n)
