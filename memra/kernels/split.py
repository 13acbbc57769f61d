"""GGUF weights repacked at load: the quants apart from their scales. On CPU the integer-dot kernel
(memra.kernels.cpu_qdot) reads each row's quants and scales as contiguous runs, or, as its fallback, a
tile of a linear's weight decodes in a few whole-tensor ops into a reused buffer
(memra.kernels.quant.tiled_linear), and the model's memory tracks the file's size instead of four bytes
a value; on a GPU the fused kernels
(memra.kernels.triton.quant) read a tile's quants with wide loads instead of gathering them byte by byte.

    Q8Split   Q8_0: int8 q [N, K] | fp16 d [N, K/32]                      value = d * q
    Q4KSplit  Q4_K: 4-bit q as the file packs it [N, K/2] | fp32 d, dmin [N, K/256]
              | 6-bit scale, min as bytes [N, K/32]                       value = (d * scale) * q - (dmin * min)
    Q5KSplit  Q5_K: 5-bit q, a byte each [N, K] | the rest as Q4_K        value = (d * scale) * q - (dmin * min)
    Q6KSplit  Q6_K: 6-bit q as the file's two planes [N, K/2], [N, K/4] | fp32 d [N, K/256]
              | int8 scale [N, K/16]                                      value = (d * scale) * (q - 32)

Q5_K spreads a value's bits over two planes; its split holds a whole byte per value (1.6x the file's
bytes) so a tile decodes as Q8_0's does, with no bit gathering per step. Q6_K keeps its planes (a byte per
value would be 1.3x the file): its kernels gather the two fields.

The file interleaves every block's header with its quants, so decoding from it means a strided read and
a small widening per block; split, a tile is one widening copy (Q4_K: of its nibbles, interleaved in
bytes first) and one or two broadcast ops per 16 or 32 values. Each decodes to the very values
memra.loading.dequant gives (bit-identical to gguf.quants.dequantize): the same fp32 operations in the
same order (tests/test_quant_linear.py).
Hand-written because neither torch nor gguf decodes a tile into a caller's buffer.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from memra.errors import MemraError
from memra.kernels.quant import MixedRows, QType, QuantWeight
from memra.loading import dequant


class _Split:
    """What every layout answers as QuantWeight does; a layout is a frozen dataclass of tensors (all
    indexed by output row first) and the activation `dtype`, with `shape` and `decode(a, b, out)`."""

    def _tensors(self) -> dict[str, torch.Tensor]:
        fields = ((f.name, getattr(self, f.name)) for f in dataclasses.fields(self))
        return {k: v for k, v in fields if isinstance(v, torch.Tensor)}  # not dtype, not a block size

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
    """A Q8_0 weight [N, K]: the file's 1.0625 bytes a value."""

    q: torch.Tensor  # int8 [N, K]
    d: torch.Tensor  # fp16 [N, K // 32], the file's (widened to fp32 where used: exact)
    dtype: torch.dtype  # the activation dtype (QuantWeight's)

    qtype = QType.Q8_0

    @classmethod
    def from_quant(cls, qw: QuantWeight) -> "Q8Split":
        n, k = qw.shape
        blocks = qw.data.view(n, k // 32, 34)
        d = blocks[..., :2].contiguous().view(torch.float16).reshape(n, k // 32)
        return cls(blocks[..., 2:].contiguous().view(torch.int8).reshape(n, k), d, qw.dtype)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def decode(self, a: int, b: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows a..b as fp32 [b - a, K] (into `out` where given)."""
        out = _widen(self.q, a, b, out)
        out.view(b - a, -1, 32).mul_(self.d[a:b, :, None].float())  # widened first: a mixed-dtype product is slow
        return out


@dataclass(frozen=True, eq=False)
class _KSplit(_Split):
    """What Q4_K and Q5_K share: per 256 values d and dmin, per 32 a 6-bit scale and min. The scales
    stay integers and meet d per tile (d * scale: one fp32 product, as dequant computes it)."""

    d: torch.Tensor  # fp32 [N, K // 256]
    dmin: torch.Tensor  # fp32 [N, K // 256]
    scale: torch.Tensor  # uint8 [N, K // 32]
    mins: torch.Tensor  # uint8 [N, K // 32]
    dtype: torch.dtype

    @staticmethod
    def header(blocks: torch.Tensor, n: int, k: int) -> dict[str, torch.Tensor]:
        """d, dmin, scale, mins of an [N, K] tensor's blocks (uint8 [N * K/256, block bytes])."""
        scale, mins = dequant._k_scale_min(blocks[:, 4:16])  # [n * K/256, 8] each
        field = lambda at: dequant._f16_field(blocks, at).view(n, k // 256)  # noqa: E731
        return dict(d=field(0), dmin=field(2), scale=scale.reshape(n, k // 32), mins=mins.reshape(n, k // 32))

    def scale_and_offset(self, a: int, b: int, out: torch.Tensor) -> torch.Tensor:
        """out [n, K] holds rows a..b's integer q: -> (d * scale) * q - (dmin * min) in place (dequant's order)."""
        n, k = out.shape
        out.view(n, k // 32, 32).mul_(_per_sub_block(self.d[a:b], self.scale[a:b], 32)).sub_(
            _per_sub_block(self.dmin[a:b], self.mins[a:b], 32))
        return out


@dataclass(frozen=True, eq=False)
class Q4KSplit(_KSplit):
    """A Q4_K weight [N, K]: 0.59 bytes a value against the file's 0.5625."""

    qs: torch.Tensor  # uint8 [N, K / 2]: per 64 values, 32 bytes (low nibbles: the first 32, high: the next)

    qtype = QType.Q4_K

    @classmethod
    def from_quant(cls, qw: QuantWeight) -> "Q4KSplit":
        n, k = qw.shape
        blocks = qw.data.view(n * (k // 256), 144)
        return cls(qs=blocks[:, 16:].contiguous().view(n, k // 2), dtype=qw.dtype, **cls.header(blocks, n, k))

    @property
    def shape(self) -> tuple[int, int]:
        return self.qs.shape[0], self.qs.shape[1] * 2

    def decode(self, a: int, b: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows a..b as fp32 [b - a, K] (into `out` where given)."""
        n, k = b - a, self.shape[1]
        out = torch.empty(n, k, device=self.qs.device) if out is None else out
        qs = self.qs[a:b].view(n, k // 64, 1, 32)
        out.view(n, k // 64, 2, 32).copy_(torch.cat((qs & 0x0F, qs >> 4), dim=2))  # interleaved in bytes, then widened
        return self.scale_and_offset(a, b, out)


@dataclass(frozen=True, eq=False)
class Q5KSplit(_KSplit):
    """A Q5_K weight [N, K]: 1.09 bytes a value against the file's 0.69."""

    q: torch.Tensor  # uint8 [N, K], 0..31

    qtype = QType.Q5_K

    @classmethod
    def from_quant(cls, qw: QuantWeight) -> "Q5KSplit":
        n, k = qw.shape
        blocks = qw.data.view(n * (k // 256), 176)
        q = _in_chunks(blocks, dequant.q5_k_quants, torch.uint8)
        return cls(q=q.reshape(n, k), dtype=qw.dtype, **cls.header(blocks, n, k))

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def decode(self, a: int, b: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows a..b as fp32 [b - a, K] (into `out` where given)."""
        return self.scale_and_offset(a, b, _widen(self.q, a, b, out))


def _in_chunks(blocks: torch.Tensor, fn, dtype: torch.dtype, rows: int = 4096) -> torch.Tensor:
    """fn(blocks) -> [n, 256] of `dtype`, a few thousand blocks at a time: the bit-plane unpacking makes
    several full-size temporaries (int16 among them), which for a whole FFN matrix were the peak of a
    Q4_K_M load (1.46x the file against 1.26x after it)."""
    out = torch.empty(blocks.shape[0], 256, dtype=dtype, device=blocks.device)
    for a in range(0, blocks.shape[0], rows):
        out[a : a + rows] = fn(blocks[a : a + rows])
    return out


def _widen(q: torch.Tensor, a: int, b: int, out: torch.Tensor | None) -> torch.Tensor:
    """Rows a..b of byte-per-value quants q [N, K] as fp32 [b - a, K] (into `out` where given): a widening
    copy, which the caller then scales in place (~7x faster on CPU than one mixed-dtype multiply)."""
    out = torch.empty(b - a, q.shape[1], device=q.device) if out is None else out
    return out.copy_(q[a:b])


def _per_sub_block(d: torch.Tensor, ints: torch.Tensor, sub: int) -> torch.Tensor:
    """d [n, K/256] times each of its super-block's integer scales [n, K/sub], as dequant computes them
    (one fp32 product) -> [n, K/sub, 1]."""
    n, per = ints.shape[0], 256 // sub
    return (d[:, :, None] * ints.view(n, -1, per).float()).view(n, -1, 1)


@dataclass(frozen=True, eq=False)
class Q6KSplit(_Split):
    """A Q6_K weight [N, K]: 0.83 bytes a value against the file's 0.82. The 6-bit quants stay in the file's
    two planes (the kernels gather a value's low nibble and its high two bits; a byte per value held a
    Q4_K_M file at 1.3-1.6x its size in memory)."""

    ql: torch.Tensor  # uint8 [N, K / 2]: per 256 values the file's 128 low-nibble bytes (q6_quants says where)
    qh: torch.Tensor  # uint8 [N, K / 4]: per 256 values the file's 64 bytes of high two-bit fields
    d: torch.Tensor  # fp32 [N, K // 256]
    scale: torch.Tensor  # int8 [N, K // 16]
    dtype: torch.dtype

    qtype = QType.Q6_K

    @classmethod
    def from_quant(cls, qw: QuantWeight) -> "Q6KSplit":
        n, k = qw.shape
        blocks = qw.data.view(n * (k // 256), 210)
        d = dequant._f16_field(blocks, 208).view(n, k // 256)
        return cls(blocks[:, :128].reshape(n, k // 2).contiguous(), blocks[:, 128:192].reshape(n, k // 4).contiguous(),
                   d, blocks[:, 192:208].contiguous().view(torch.int8).reshape(n, k // 16), qw.dtype)

    @property
    def shape(self) -> tuple[int, int]:
        return self.ql.shape[0], 2 * self.ql.shape[1]

    def quants(self, a: int, b: int) -> torch.Tensor:
        """Rows a..b's q - 32 as int8 [b - a, K], in value order."""
        return q6_quants(self.ql[a:b], self.qh[a:b])

    def decode(self, a: int, b: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows a..b as fp32 [b - a, K] (into `out` where given)."""
        out = _widen(self.quants(a, b), 0, b - a, out)
        out.view(b - a, -1, 16).mul_(_per_sub_block(self.d[a:b], self.scale[a:b], 16))
        return out


def q6_quants(ql: torch.Tensor, qh: torch.Tensor) -> torch.Tensor:
    """Q6_K's planes uint8 [n, K / 2], [n, K / 4] -> q - 32, int8 [n, K] (dequant's unpacking). Value v of a
    256-value block, with h = v // 128, c = v % 128 // 32, l = v % 32: its low nibble is byte 64 h + 32 (c % 2)
    + l of the block's 128 (the high nibble where c >= 2), its high two bits are bits 2c of byte 32 h + l of
    the block's 64."""
    n = ql.shape[0]
    blocks = torch.cat((ql.reshape(-1, 128), qh.reshape(-1, 64)), dim=1)  # [n * K / 256, 192] as the file
    q = _in_chunks(blocks, lambda b: (dequant.q6_k_quants(b).to(torch.int16) - 32).to(torch.int8), torch.int8)
    return q.reshape(n, -1)


@dataclass(frozen=True, eq=False)
class SplitRows:
    """Row blocks in several split layouts, one linear weight (a quant.MixedRows, split): a CPU tile that
    crosses blocks decodes each block's rows into its part of the buffer; the GPU kernel runs a launch
    per block, each writing its own columns."""

    parts: tuple  # of the layouts above, one width

    qtype = None  # several

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]

    @property
    def dtype(self) -> torch.dtype:
        return self.parts[0].dtype

    @property
    def device(self) -> torch.device:
        return self.parts[0].device

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def decode(self, a: int, b: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows a..b as fp32 [b - a, K] (into `out` where given)."""
        out = torch.empty(b - a, self.shape[1], device=self.device) if out is None else out
        lo = 0
        for p in self.parts:
            hi = lo + p.shape[0]
            if lo < b and a < hi:
                p.decode(max(a, lo) - lo, min(b, hi) - lo, out[max(a, lo) - a : min(b, hi) - a])
            lo = hi
        return out

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return self.decode(0, self.shape[0]).to(dtype or self.dtype)

    def to(self, device: torch.device | str) -> "SplitRows":
        return SplitRows(tuple(p.to(device) for p in self.parts))


@dataclass(frozen=True, eq=False)
class Fp8BlockSplit(_Split):
    """An FP8 block-scaled weight [N, K] (memra.loading.fp_formats): the file's e4m3 bytes, and each row's
    block scales (its row block's, so rows concatenate and index freely; 1/32 byte a value more).
    value = float(q) * scale_inv of its block: one fp32 product, as the loader's dequantizer computes it."""

    q: torch.Tensor  # float8_e4m3fn [N, K]
    s: torch.Tensor  # fp32 [N, ceil(K / cols)], row i = scale_inv[i // rows of the file's grid]
    cols: int  # values per block along K
    dtype: torch.dtype

    qtype = None  # not a GGML type

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def decode(self, a: int, b: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows a..b as fp32 [b - a, K] (into `out` where given)."""
        k = self.q.shape[1]
        out = torch.empty(b - a, k, device=self.q.device) if out is None else out
        return torch.mul(self.q[a:b].float(), self.s[a:b].repeat_interleave(self.cols, dim=1)[:, :k], out=out)


@dataclass(frozen=True, eq=False)
class Nvfp4Split(_Split):
    """An NVFP4 weight [N, K]: the file's bytes (two e2m1 values each, the even column in the low nibble)
    and each 16-value group's fp32 scale, computed once at load with the per-tensor scale folded in (the
    same fp32 operation the dequantizer does per group). value = e2m1 * scale: 0.5 + 0.25 bytes a value."""

    packed: torch.Tensor  # uint8 [N, K / 2]
    s: torch.Tensor  # fp32 [N, ceil(K / 16)]
    dtype: torch.dtype

    qtype = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], 2 * self.packed.shape[1]

    def decode(self, a: int, b: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows a..b as fp32 [b - a, K] (into `out` where given)."""
        from memra.loading.fp_formats import E2M1_VALUES, NVFP4_GROUP

        n, k = b - a, self.shape[1]
        out = torch.empty(n, k, device=self.packed.device) if out is None else out
        p = self.packed[a:b]
        lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=p.device)
        nibbles = torch.stack((p & 0x0F, p >> 4), dim=-1).reshape(n, k)
        return torch.mul(lut[nibbles.long()], self.s[a:b].repeat_interleave(NVFP4_GROUP, dim=1)[:, :k], out=out)


FP_SPLITS = (Fp8BlockSplit, Nvfp4Split)  # HF FP8 / NVFP4 checkpoints, CPU only (memra.loading.fp_source)


def fp_cat_rows(parts: list):
    """Row-concatenation of FP8 / NVFP4 layouts of one kind, width (and FP8 block width); None if they differ."""
    first = parts[0]
    if any(type(p) is not type(first) or p.shape[1] != first.shape[1] or getattr(p, "cols", 0) != getattr(first, "cols", 0)
           for p in parts):
        return None
    return dataclasses.replace(first, **{k: torch.cat([p._tensors()[k] for p in parts]) for k in first._tensors()})


SPLITS = {QType.Q8_0: Q8Split, QType.Q4_K: Q4KSplit, QType.Q5_K: Q5KSplit, QType.Q6_K: Q6KSplit}
SPLIT_TYPES = (*SPLITS.values(), SplitRows, *FP_SPLITS)


def split_layout(qw: QuantWeight | MixedRows):
    """The split layout of a packed weight (Q8_0, Q4_K, Q5_K or Q6_K; or row blocks of several), on qw's
    device: what a packed model holds, on CPU and GPU alike."""
    if isinstance(qw, MixedRows):
        return SplitRows(tuple(split_layout(p) for p in qw.parts))
    if qw.qtype not in SPLITS:
        raise MemraError(f"no split layout for {qw.qtype.name} weights; they are dequantized at load")
    return SPLITS[qw.qtype].from_quant(qw)
