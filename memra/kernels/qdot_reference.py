"""The pure-torch twin of the CPU integer-dot kernel (memra/kernels/cpu/qdot.cpp): its arithmetic, bit for bit.

A packed linear on CPU quantizes each activation row to int8 per block, as llama.cpp's q8_0 / q8_K do,
and takes integer dot products with the weight's integer quants. Integer sums are exact, so their order
is free; what fixes the bits is the float arithmetic after them, one fixed order per output:

  activations, per block of 32 (Q8_0) or 256 (K-quants):  d = max|x| / 127, q = round(x * (1 / d)) (half to
      even; q = 0 where d = 0), and for the K-quants the int sums of q per 16 values.
  Q8_0   per 32-block b and lane l (values 4l..4l+3 of the block): s = int sum of w * x,
         acc[l] = acc[l] + (wd_b * xd_b) * s; y = ((acc0 + acc4) + (acc2 + acc6)) + ((acc1 + acc5) + (acc3 + acc7))
         (the kernel's eight AVX2 lanes and their reduction).
  Q4_K, Q5_K  per 256-block: isum = sum_j scale_j * dot_j over its eight 32-value sub-blocks,
         msum = sum_j min_j * (sum of x's q in sub-block j); acc = acc + (d * xd) * isum; acc = acc - (dmin * xd) * msum.
  Q6_K   per 256-block: isum = sum_j scale_j * dot_j over sixteen 16-value sub-blocks; acc = acc + (d * xd) * isum.

An output is a function of its activation row and its weight row only, so a row's bits never depend on
the batch, the chunking or the thread count (tests/test_cpu_qdot.py). It is not the dequantized fp32
product (memra.kernels.quant.reference_linear): the activations lose their low bits to int8, as in
llama.cpp; docs/FORMATS.md states the tolerance.
"""

from __future__ import annotations

import torch

from memra.kernels import split

CHUNK = 256  # weight rows per step of the twin: bounds its int32 products [M, CHUNK, K]


def quantize_rows(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x fp32 [M, K] -> (q int8 [M, K], d fp32 [M, K / block], sums of q per 16 int32 [M, K / 16])."""
    m, k = x.shape
    xb = x.reshape(m, k // block, block)
    d = xb.abs().amax(-1) / 127  # [M, K / block]
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    q = torch.round(xb * inv[..., None]).clamp(-127, 127).to(torch.int8).reshape(m, k)
    sums = q.view(m, k // 16, 16).sum(-1, dtype=torch.int32)
    return q, d, sums


def _ints(w, a: int, b: int) -> torch.Tensor:
    """Weight rows a..b's integer quants as int32 [b - a, K] (Q4_K's nibbles unpacked to value order)."""
    if isinstance(w, split.Q4KSplit):
        qs = w.qs[a:b].view(b - a, -1, 1, 32)
        return torch.cat((qs & 0x0F, qs >> 4), dim=2).reshape(b - a, -1).int()
    if isinstance(w, split.Q6KSplit):
        return w.quants(a, b).int()
    return w.q[a:b].int()


def _q8_0(w: split.Q8Split, a: int, b: int, act) -> torch.Tensor:
    q, d, _ = act  # [M, K], [M, K / 32]
    m, n, nb = q.shape[0], b - a, q.shape[1] // 32
    s = (_ints(w, a, b)[None] * q.int()[:, None]).view(m, n, nb, 8, 4).sum(-1, dtype=torch.int32)  # [M, n, nb, 8]
    dd = w.d[a:b].float()[None] * d[:, None]  # [M, n, nb]
    acc = torch.zeros(m, n, 8)
    for blk in range(nb):
        acc = acc + dd[..., blk, None] * s[..., blk, :].float()
    return ((acc[..., 0] + acc[..., 4]) + (acc[..., 2] + acc[..., 6])) + ((acc[..., 1] + acc[..., 5]) + (acc[..., 3] + acc[..., 7]))


def _k(w, a: int, b: int, act) -> torch.Tensor:
    q, d, sums = act  # [M, K], [M, K / 256], [M, K / 16]
    m, n, nsb = q.shape[0], b - a, q.shape[1] // 256
    sub = 16 if isinstance(w, split.Q6KSplit) else 32
    dots = (_ints(w, a, b)[None] * q.int()[:, None]).view(m, n, nsb, 256 // sub, sub).sum(-1, dtype=torch.int32)
    isum = (dots * w.scale[a:b].int().view(1, n, nsb, -1)).sum(-1, dtype=torch.int32)  # [M, n, nsb]
    scale = w.d[a:b][None] * d[:, None]  # [M, n, nsb]
    if sub == 32:
        xsum = sums.view(m, nsb, 8, 2).sum(-1, dtype=torch.int32)  # [M, nsb, 8]: per 32-value sub-block
        msum = (w.mins[a:b].int().view(1, n, nsb, 8) * xsum[:, None]).sum(-1, dtype=torch.int32)
        offset = w.dmin[a:b][None] * d[:, None]
    acc = torch.zeros(m, n)
    for s in range(nsb):
        acc = acc + scale[..., s] * isum[..., s].float()
        if sub == 32:
            acc = acc - offset[..., s] * msum[..., s].float()
    return acc


def linear(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ w^T (+ bias) -> [..., N] in x's dtype, for w a Q8_0 / Q4_K / Q5_K / Q6_K split layout or a
    SplitRows of them: the kernel's arithmetic (module doc)."""
    n, k = w.shape
    x2 = x.reshape(-1, k).float()
    acts = {}
    out = torch.empty(x2.shape[0], n)
    lo = 0
    for part in (w.parts if isinstance(w, split.SplitRows) else (w,)):
        block = 32 if isinstance(part, split.Q8Split) else 256
        if block not in acts:
            acts[block] = quantize_rows(x2, block)
        fn = _q8_0 if block == 32 else _k
        for a in range(0, part.shape[0], CHUNK):
            b = min(a + CHUNK, part.shape[0])
            out[:, lo + a : lo + b] = fn(part, a, b, acts[block])
        lo += part.shape[0]
    if bias is not None:
        out = out + bias.float()
    return out.reshape(*x.shape[:-1], n).to(x.dtype)
