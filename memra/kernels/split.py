"""GGUF weights repacked for the CPU at load: the quants apart from their scales, so a tile of a
linear's weight decodes in a few whole-tensor ops into a reused buffer (memra.kernels.quant.tiled_linear)
and the model's memory tracks the file's size instead of four bytes a value.

    Q8Split   Q8_0: int8 q [N, K] | fp32 d [N, K/32]                      value = d * q
    Q4KSplit  Q4_K: 4-bit q as the file packs it [N, K/2] | fp32 d, dmin [N, K/256]
              | 6-bit scale, min as bytes [N, K/32]                       value = (d * scale) * q - (dmin * min)

The file interleaves every block's header with its quants, so decoding from it means a strided read and
a small widening per block; split, a tile is one widening copy (Q4_K: of its nibbles, interleaved in
bytes first) and one or two broadcast ops per 32 values. Each decodes to the very values memra.loading.dequant gives (bit-identical
to gguf.quants.dequantize): the same fp32 operations in the same order (tests/test_quant_linear.py).
Hand-written because neither torch nor gguf decodes a tile into a caller's buffer; llama.cpp's own
kernels multiply in int8, which would change the bits of every logit.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from memra.errors import MemraError
from memra.kernels.quant import QType, QuantWeight
from memra.loading import dequant


class _Split:
    """What every layout answers as QuantWeight does; a layout is a frozen dataclass of tensors (all
    indexed by output row first) and the activation `dtype`, with `shape` and `decode(a, b, out)`."""

    def _tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "dtype"}

    @property
    def device(self) -> torch.device:
        return next(iter(self._tensors().values())).device

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self._tensors().values())

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return self.decode(0, self.shape[0]).to(dtype or self.dtype)

    def __getitem__(self, rows) -> torch.Tensor:
        """Rows as values in self.dtype, decoding only those (`embed[ids]` on a packed table)."""
        picked = dataclasses.replace(self, **{k: _take(t, rows) for k, t in self._tensors().items()})
        return picked.decode(0, picked.shape[0]).to(self.dtype)

    def to(self, device: torch.device | str):
        return dataclasses.replace(self, **{k: t.to(device) for k, t in self._tensors().items()})


def _take(t: torch.Tensor, rows) -> torch.Tensor:
    got = t[rows]
    return got[None] if got.dim() == t.dim() - 1 else got  # one row by an int keeps its row dim


@dataclass(frozen=True, eq=False)  # eq=False: tensors have no single truth value
class Q8Split(_Split):
    """A Q8_0 weight [N, K]: 1.125 bytes a value against the file's 1.0625."""

    q: torch.Tensor  # int8 [N, K]
    d: torch.Tensor  # fp32 [N, K // 32] (fp16 -> fp32 is exact)
    dtype: torch.dtype  # the activation dtype (QuantWeight's)

    qtype = QType.Q8_0

    @classmethod
    def from_quant(cls, qw: QuantWeight) -> "Q8Split":
        n, k = qw.shape
        blocks = qw.data.view(n, k // 32, 34)
        d = dequant._f16_field(blocks.reshape(-1, 34), 0).view(n, k // 32)
        return cls(blocks[..., 2:].contiguous().view(torch.int8).reshape(n, k), d, qw.dtype)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def decode(self, a: int, b: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows a..b as fp32 [b - a, K] (into `out` where given)."""
        n, k = b - a, self.shape[1]
        out = torch.empty(n, k, device=self.q.device) if out is None else out
        out.copy_(self.q[a:b])  # widen, then scale in place: ~7x faster on CPU than one mixed-dtype mul
        out.view(n, k // 32, 32).mul_(self.d[a:b, :, None])
        return out


@dataclass(frozen=True, eq=False)
class Q4KSplit(_Split):
    """A Q4_K weight [N, K]: 0.59 bytes a value against the file's 0.5625. The scales stay 6-bit
    integers and meet d per tile (d * scale: one fp32 product, as dequant computes it)."""

    qs: torch.Tensor  # uint8 [N, K / 2]: per 64 values, 32 bytes (low nibbles: the first 32, high: the next)
    d: torch.Tensor  # fp32 [N, K // 256]
    dmin: torch.Tensor  # fp32 [N, K // 256]
    scale: torch.Tensor  # uint8 [N, K // 32]
    mins: torch.Tensor  # uint8 [N, K // 32]
    dtype: torch.dtype

    qtype = QType.Q4_K

    @classmethod
    def from_quant(cls, qw: QuantWeight) -> "Q4KSplit":
        n, k = qw.shape
        blocks = qw.data.view(n * (k // 256), 144)
        scale, mins = dequant._k_scale_min(blocks[:, 4:16])  # [n * K/256, 8] each
        field = lambda at: dequant._f16_field(blocks, at).view(n, k // 256)  # noqa: E731
        return cls(blocks[:, 16:].contiguous().view(n, k // 2), field(0), field(2), scale.reshape(n, k // 32),
                   mins.reshape(n, k // 32), qw.dtype)

    @property
    def shape(self) -> tuple[int, int]:
        return self.qs.shape[0], self.qs.shape[1] * 2

    def decode(self, a: int, b: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows a..b as fp32 [b - a, K] (into `out` where given)."""
        n, k = b - a, self.shape[1]
        out = torch.empty(n, k, device=self.qs.device) if out is None else out
        qs = self.qs[a:b].view(n, k // 64, 1, 32)
        out.view(n, k // 64, 2, 32).copy_(torch.cat((qs & 0x0F, qs >> 4), dim=2))  # interleaved in bytes, then widened
        per_block = lambda v, ints: (v[a:b, :, None] * ints[a:b].view(n, k // 256, 8).float()).view(n, k // 32, 1)  # noqa: E731
        out.view(n, k // 32, 32).mul_(per_block(self.d, self.scale)).sub_(per_block(self.dmin, self.mins))
        return out


SPLITS = {QType.Q8_0: Q8Split, QType.Q4_K: Q4KSplit}
SPLIT_TYPES = tuple(SPLITS.values())


def split_for_cpu(qw: QuantWeight):
    """The CPU layout of a packed weight (Q8_0 or Q4_K)."""
    if qw.qtype not in SPLITS:
        raise MemraError(f"no CPU layout for {qw.qtype.name} weights; they are dequantized at load")
    return SPLITS[qw.qtype].from_quant(qw)
