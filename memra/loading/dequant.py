"""GGML quantized tensors to float32, in plain torch, on whatever device the bytes live on.

A GGUF file stores each tensor row by row; a row is a run of fixed-size *blocks*, each holding
`block_size` values in `type_size` bytes (`gguf.GGML_QUANT_SIZES`). A quantized block carries its own
scale(s) as fp16 plus the packed small integers; plain F32/F16/BF16 are blocks of one value. To
dequantize we view the bytes as `[n_blocks, type_size]`, unpack every block at once with shifts and
masks, and multiply by the scales. Nothing loops over blocks in Python, so the same code is fast on
CPU and CUDA; large tensors are only cut into chunks of a million or more values, to bound scratch
memory.

Exactness contract: the result is bit-identical to `gguf.quants.dequantize` (the reference numpy
implementation from llama.cpp's gguf package), NaN payloads included. Every function below follows:
  * fp16 scales are widened to fp32 *before* any arithmetic, and all arithmetic is in fp32;
  * the order of the fp32 operations is the reference's. E.g. Q4_K computes `(d * sc) * q - (dmin * m)`
    and not `d * (sc * q)`: both are "right" on paper but round differently;
  * every add/sub/mul rounds on its own: torch runs each as its own kernel, never fused into an FMA
    (inside, an add/sub is `a + alpha * b` with alpha = +-1, which is exact).
Integer work (unpacking, subtracting zero-points) is exact, so how it is done does not matter.
On CUDA, arithmetic on a NaN yields the GPU's canonical NaN, so there only NaN payloads can differ.

Byte order: GGUF is little-endian, and so is every machine torch runs on in practice; multi-byte
fields are read by reinterpreting bytes (`view`), as the reference does.
"""

from __future__ import annotations

import math
from typing import Callable

import gguf
import torch

from memra.errors import CheckpointError

QType = gguf.GGMLQuantizationType

QK_K = 256  # values per super-block of the K-quants (Q2_K..Q6_K)

# Values decoded per step. Chunking bounds the scratch memory (a few chunk-sized temporaries), so a
# large embedding table does not need several times its own size while it is decoded. On CPU small
# chunks also keep those temporaries in cache; on a GPU big chunks keep the kernels big.
_CHUNK_VALUES_CPU = 1 << 20
_CHUNK_VALUES_GPU = 1 << 26


# ---------------------------------------------------------------------------------------------------
# Small helpers
# ---------------------------------------------------------------------------------------------------


def _f16_to_f32(h: torch.Tensor) -> torch.Tensor:
    """fp16 values, given as their int16 bit patterns, widened to float32 exactly as numpy does.

    torch's conversion is exact for every number but replaces each NaN by one canonical NaN, while
    numpy keeps a NaN's sign and payload: fp32 bits = sign | all-ones exponent | mantissa << 13.
    So convert with torch, then rebuild the (rare) NaNs from their bits: shifting the sign-extended
    int16 left by 13 puts the mantissa and the 5 exponent bits in place and leaves copies of the sign
    in bits 28-31; OR-ing 0x70000000 sets the rest of the 8-bit exponent.
    """
    out = h.view(torch.float16).float()
    nan = out.isnan()
    if nan.any():  # only in corrupt (or deliberately odd) data, so skip the work otherwise
        nan_bits = (h.to(torch.int32) << 13) | 0x70000000
        out = torch.where(nan, nan_bits.view(torch.float32), out)
    return out


def _f16_field(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 field at byte `at` of every block, widened to fp32.

    blocks: uint8 [n, type_size] -> float32 [n, 1]. The two bytes are copied out first because the
    field is generally not 2-byte aligned in memory (e.g. type_size 22 for Q5_0).
    """
    return _f16_to_f32(blocks[:, at:at + 2].contiguous().view(torch.int16))


def _fields(x: torch.Tensor, width: int) -> torch.Tensor:
    """Split every byte into its 8 // width bit fields, lowest bits first.

    x: uint8 [..., k] -> uint8 [..., 8 // width, k], where out[..., i, j] is field i of byte j
    (bits i*width .. i*width + width - 1). GGML packs the *first* group of values into the lowest bits
    of a run of bytes, the next group into the next bits of the same bytes, and so on, so flattening
    the last two dims gives the values in order.
    """
    shifts = torch.arange(0, 8, width, dtype=torch.uint8, device=x.device).view(-1, 1)
    return (x.unsqueeze(-2) >> shifts) & ((1 << width) - 1)


def _offset(op: Callable[..., torch.Tensor], scaled: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """`op(scaled, offset)` for op = torch.add or torch.sub, written into `scaled` (a temporary).

    When both operands are NaN, x86 -- and so numpy -- returns the payload of the left one, but
    torch's CPU kernels return the right one's. `offset` is one value per (sub-)block, so checking it
    is cheap, and it is only NaN in corrupt data; then take the left NaN explicitly.
    """
    if offset.isnan().any():
        return torch.where(scaled.isnan(), scaled, op(scaled, offset))
    return op(scaled, offset, out=scaled)


# ---------------------------------------------------------------------------------------------------
# Plain floats: blocks of one value. Each maps blocks uint8 [n, type_size] -> float32 [n, 1].
# ---------------------------------------------------------------------------------------------------


def _f32(blocks: torch.Tensor) -> torch.Tensor:
    # 4 bytes: the fp32 itself. Cloned so the result never aliases the caller's buffer.
    return blocks.view(torch.float32).clone()


def _f16(blocks: torch.Tensor) -> torch.Tensor:
    # 2 bytes: an fp16.
    return _f16_to_f32(blocks.view(torch.int16))


def _bf16(blocks: torch.Tensor) -> torch.Tensor:
    # 2 bytes: a bf16, i.e. the top half of an fp32. torch widens it by that 16-bit shift, NaN
    # payloads included, which is also what the reference does.
    return blocks.view(torch.bfloat16).float()


# ---------------------------------------------------------------------------------------------------
# Legacy 32-value blocks: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1
# Each maps blocks uint8 [n, type_size] -> float32 [n, 32].
# ---------------------------------------------------------------------------------------------------


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    # 34 bytes: d (fp16) | 32 x int8 q.          value = q * d
    d = _f16_field(blocks, 0)  # [n, 1]
    q = blocks[:, 2:].view(torch.int8).float()  # [n, 32]
    return q.mul_(d)


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    # 18 bytes: d (fp16) | 16 bytes of 4-bit q (value j in the low nibble of byte j, value j+16 in
    # the high nibble). q is stored offset by 8.          value = d * (q - 8)
    n = blocks.shape[0]
    d = _f16_field(blocks, 0)
    q = _fields(blocks[:, 2:], 4).reshape(n, 32)
    return q.float().sub_(8).mul_(d)


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    # 20 bytes: d (fp16) | m (fp16, the block minimum) | 16 bytes of 4-bit q, packed as in Q4_0.
    # value = d * q + m
    n = blocks.shape[0]
    d, m = _f16_field(blocks, 0), _f16_field(blocks, 2)
    q = _fields(blocks[:, 4:], 4).reshape(n, 32)
    return _offset(torch.add, q.float().mul_(d), m)


def _q5_low_high(low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """The 5-bit values of a Q5_0 / Q5_1 block: uint8 [n, 16] nibbles + [n, 4] high bits -> [n, 32].

    The 4 high-bit bytes are a little-endian uint32 whose bit j is the 5th bit of value j, i.e. bit
    j % 8 of byte j // 8 -- hence the transpose (byte-major, then bit).
    """
    n = low.shape[0]
    nibbles = _fields(low, 4).reshape(n, 32)
    top = _fields(high, 1).transpose(1, 2).reshape(n, 32)
    return nibbles | (top << 4)


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    # 22 bytes: d (fp16) | qh (4 bytes, 5th bits) | 16 bytes of low nibbles (as Q4_0).
    # q is stored offset by 16.          value = d * (q - 16)
    d = _f16_field(blocks, 0)
    q = _q5_low_high(blocks[:, 6:], blocks[:, 2:6])
    return q.float().sub_(16).mul_(d)


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    # 24 bytes: d (fp16) | m (fp16) | qh (4 bytes) | 16 bytes of low nibbles.
    # value = d * q + m
    d, m = _f16_field(blocks, 0), _f16_field(blocks, 2)
    q = _q5_low_high(blocks[:, 8:], blocks[:, 4:8])
    return _offset(torch.add, q.float().mul_(d), m)


# ---------------------------------------------------------------------------------------------------
# K-quants: 256-value super-blocks made of 16 sub-blocks of 16 (Q2_K, Q3_K, Q6_K) or 8 of 32
# (Q4_K, Q5_K), each sub-block with its own small integer scale (and min) that multiplies the
# super-block's fp16 d (and dmin).
# Each maps blocks uint8 [n, type_size] -> float32 [n, 256].
# ---------------------------------------------------------------------------------------------------


def _q2_k(blocks: torch.Tensor) -> torch.Tensor:
    # 84 bytes: scales (16 bytes: low nibble = scale, high nibble = min of each 16-value sub-block)
    #         | qs (64 bytes of 2-bit q) | d (fp16) | dmin (fp16).
    # qs is two halves of 32 bytes; each half holds 128 values as four 2-bit planes of 32.
    # value = (d * scale) * q - (dmin * min)
    n = blocks.shape[0]
    scales = blocks[:, 0:16]
    d, dmin = _f16_field(blocks, 80), _f16_field(blocks, 82)
    dl = (d * (scales & 0xF).float()).unsqueeze(-1)  # [n, 16, 1]
    ml = (dmin * (scales >> 4).float()).unsqueeze(-1)  # [n, 16, 1]
    q = _fields(blocks[:, 16:80].reshape(n, 2, 32), 2).reshape(n, 16, 16)  # [half, plane, 32] flattened
    return _offset(torch.sub, q.float().mul_(dl), ml).view(n, QK_K)


def _q3_k(blocks: torch.Tensor) -> torch.Tensor:
    # 110 bytes: hmask (32 bytes: the 3rd bit of every value, as eight 1-bit planes of 32)
    #          | qs (64 bytes: the low 2 bits, laid out as in Q2_K)
    #          | scales (12 bytes: sixteen 6-bit signed scales, see below) | d (fp16).
    # A value is stored as its low 2 bits plus a high bit that is *set* when the value is >= 0:
    # q = low - 4 * (1 - high), in [-4, 3].          value = (d * (scale - 32)) * q
    n = blocks.shape[0]
    d = _f16_field(blocks, 108)
    packed = blocks[:, 96:108]
    # Scale i: its low 4 bits are nibble i // 8 of byte i % 8; its high 2 bits are 2-bit field i // 4
    # of byte 8 + i % 4. Stored offset by 32.
    low = _fields(packed[:, 0:8], 4).reshape(n, 16)
    high = _fields(packed[:, 8:12], 2).reshape(n, 16)
    scale = ((low | (high << 4)).float() - 32).unsqueeze(-1)  # [n, 16, 1]
    dl = d.unsqueeze(-1) * scale  # [n, 16, 1]
    low_bits = _fields(blocks[:, 32:96].reshape(n, 2, 32), 2).reshape(n, 16, 16)
    high_bit = _fields(blocks[:, 0:32], 1).reshape(n, 16, 16)
    q = (low_bits | (high_bit << 2)).float().sub_(4)  # = low - 4 * (1 - high)
    return q.mul_(dl).view(n, QK_K)


def _k_scale_min(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eight 6-bit scales and mins of a Q4_K / Q5_K block: uint8 [n, 12] -> ([n, 8], [n, 8]).

    Bytes 0-3 hold scales 0-3 in their low 6 bits, bytes 4-7 hold mins 0-3 likewise. Scales and mins
    4-7 take their low 4 bits from bytes 8-11 (scale: low nibble, min: high nibble) and their top
    2 bits from the spare top 2 bits of bytes 0-3 (scales) and 4-7 (mins).
    """
    a, b, c = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scale = torch.cat([a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)], dim=1)
    mins = torch.cat([b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)], dim=1)
    return scale, mins


def _k_scale_offset(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The header Q4_K and Q5_K share: d (fp16) | dmin (fp16) | 12 bytes of 6-bit scales and mins.
    -> per sub-block (d * scale, dmin * min), each [n, 8, 1] fp32."""
    d, dmin = _f16_field(blocks, 0), _f16_field(blocks, 2)
    scale, mins = _k_scale_min(blocks[:, 4:16])
    return (d * scale.float()).unsqueeze(-1), (dmin * mins.float()).unsqueeze(-1)


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    # 144 bytes: d (fp16) | dmin (fp16) | scales+mins (12 bytes, 6-bit each) | qs (128 bytes of 4-bit q).
    # qs is four runs of 32 bytes; each run holds two 32-value sub-blocks (low nibbles, then high).
    # value = (d * scale) * q - (dmin * min)
    n = blocks.shape[0]
    dl, ml = _k_scale_offset(blocks)
    q = _fields(blocks[:, 16:144].reshape(n, 4, 32), 4).reshape(n, 8, 32)
    return _offset(torch.sub, q.float().mul_(dl), ml).view(n, QK_K)


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    # 176 bytes: d (fp16) | dmin (fp16) | scales+mins (12 bytes, as Q4_K)
    #          | qh (32 bytes: the 5th bit, eight 1-bit planes of 32, one per sub-block)
    #          | qs (128 bytes: low 4 bits, as Q4_K).
    # value = (d * scale) * q - (dmin * min)
    n = blocks.shape[0]
    dl, ml = _k_scale_offset(blocks)
    q = q5_k_quants(blocks).view(n, 8, 32)
    return _offset(torch.sub, q.float().mul_(dl), ml).view(n, QK_K)


def q5_k_quants(blocks: torch.Tensor) -> torch.Tensor:
    """Q5_K blocks uint8 [n, 176] -> each value's 5-bit q, uint8 [n, 256] (memra.kernels.split keeps it)."""
    n = blocks.shape[0]
    low = _fields(blocks[:, 48:176].reshape(n, 4, 32), 4).reshape(n, QK_K)
    high = _fields(blocks[:, 16:48], 1).reshape(n, QK_K)  # eight 1-bit planes of 32
    return low | (high << 4)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    # 210 bytes: ql (128 bytes: low 4 bits) | qh (64 bytes: high 2 bits)
    #          | scales (16 x int8, one per 16-value sub-block) | d (fp16).
    # Each 128-value half uses 64 bytes of ql (two nibble planes of 64) and 32 bytes of qh (four
    # 2-bit planes of 32). q is stored offset by 32.          value = (d * scale) * (q - 32)
    n = blocks.shape[0]
    d = _f16_field(blocks, 208)
    scale = blocks[:, 192:208].view(torch.int8).float()  # [n, 16]
    dl = (d * scale).unsqueeze(-1)  # [n, 16, 1]
    q = q6_k_quants(blocks).float().sub_(32).view(n, 16, 16)
    return q.mul_(dl).view(n, QK_K)


def q6_k_quants(blocks: torch.Tensor) -> torch.Tensor:
    """Q6_K blocks uint8 [n, 210] -> each value's stored 6-bit q (offset by 32), uint8 [n, 256]."""
    n = blocks.shape[0]
    low = _fields(blocks[:, 0:128].reshape(n, 2, 64), 4).reshape(n, QK_K)
    high = _fields(blocks[:, 128:192].reshape(n, 2, 32), 2).reshape(n, QK_K)
    return low | (high << 4)


# ---------------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------------

# type -> function decoding uint8 [n, type_size] blocks into float32 [n, block_size] values
_DECODERS = {
    QType.F32: _f32,
    QType.F16: _f16,
    QType.BF16: _bf16,
    QType.Q8_0: _q8_0,
    QType.Q4_0: _q4_0,
    QType.Q4_1: _q4_1,
    QType.Q5_0: _q5_0,
    QType.Q5_1: _q5_1,
    QType.Q2_K: _q2_k,
    QType.Q3_K: _q3_k,
    QType.Q4_K: _q4_k,
    QType.Q5_K: _q5_k,
    QType.Q6_K: _q6_k,
}

SUPPORTED: frozenset[QType] = frozenset(_DECODERS)

# Byte positions, within one block, of the fp16 fields that scale a block (d, and dmin / m where the type
# has one), as the decoders above read them. A non-finite scale turns its whole block into NaN / Inf, so
# checking these few bytes per block finds a corrupt quantized tensor without decoding it.
SCALE_FIELDS: dict[QType, tuple[int, ...]] = {
    QType.Q8_0: (0,), QType.Q4_0: (0,), QType.Q5_0: (0,), QType.Q4_1: (0, 2), QType.Q5_1: (0, 2),
    QType.Q2_K: (80, 82), QType.Q3_K: (108,), QType.Q4_K: (0, 2), QType.Q5_K: (0, 2), QType.Q6_K: (208,),
}


def first_bad_scale(raw: torch.Tensor, qtype: QType) -> int | None:
    """The index of the first block of `raw` (a quantized tensor's bytes) with a NaN / Inf scale, or None.

    An fp16 is non-finite when its 5 exponent bits are all ones: bits 2-6 of its high byte (little-endian:
    the field's second byte). Only that byte of each field is read; OR-ing in the other bits (0x83) makes a
    bad byte 0xFF, so one max per field answers "any bad?" without a mask as long as the tensor.
    """
    qtype = _as_qtype(qtype)
    fields = SCALE_FIELDS.get(qtype)
    if not fields:
        return None
    blocks = raw.reshape(-1).view(torch.uint8).view(-1, gguf.GGML_QUANT_SIZES[qtype][1])
    high = [blocks[:, at + 1] for at in fields]
    if blocks.shape[0] == 0 or all(int((h | 0x83).amax()) != 0xFF for h in high):
        return None
    bad = torch.stack([(h & 0x7C) == 0x7C for h in high]).any(0)  # the rare path: find the block
    return int(bad.nonzero()[0, 0])


def _as_qtype(qtype: QType | int) -> QType:
    try:
        return QType(qtype)
    except ValueError:
        raise CheckpointError(f"unknown GGML tensor type id {qtype!r}") from None


def row_bytes(qtype: QType, n_cols: int) -> int:
    """Bytes that one row of `n_cols` values takes in a GGUF file (works for any GGML type)."""
    qtype = _as_qtype(qtype)
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    if n_cols % block_size:
        raise CheckpointError(
            f"a {qtype.name} row must hold a multiple of {block_size} values, but this one has {n_cols}"
        )
    return n_cols // block_size * type_size


def dequantize(raw: torch.Tensor, qtype: QType, shape: tuple[int, ...]) -> torch.Tensor:
    """Decode a GGUF tensor's bytes into float32 of `shape`, on `raw.device`.

    raw: the tensor's bytes exactly as stored in the file (uint8; any other dtype is read as its
    bytes). shape: the logical torch shape, row-major, so shape[-1] is ggml's ne[0]. The result is
    a new tensor (never a view of `raw`) and is bit-identical to `gguf.quants.dequantize`.
    """
    qtype = _as_qtype(qtype)
    if qtype not in SUPPORTED:
        names = ", ".join(sorted(t.name for t in SUPPORTED))
        raise CheckpointError(f"cannot dequantize GGML type {qtype.name}; supported types: {names}")

    shape = tuple(int(s) for s in shape)
    n_cols = shape[-1] if shape else 1
    n_rows = math.prod(shape[:-1])
    expected = n_rows * row_bytes(qtype, n_cols)
    flat = raw.contiguous().reshape(-1).view(torch.uint8)  # [n_bytes]
    if flat.numel() != expected:
        raise CheckpointError(
            f"{qtype.name} tensor of shape {list(shape)} needs {expected} bytes, found {flat.numel()}"
        )

    if flat.storage_offset() % 4:
        flat = flat.clone()  # reinterpreting bytes as fp16/fp32 needs aligned memory

    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    decode = _DECODERS[qtype]
    blocks = flat.view(-1, type_size)  # [n_blocks, type_size]
    chunk_values = _CHUNK_VALUES_CPU if flat.device.type == "cpu" else _CHUNK_VALUES_GPU
    n_blocks, step = blocks.shape[0], max(1, chunk_values // block_size)
    if n_blocks <= step:
        return decode(blocks).view(shape)
    out = torch.empty(n_blocks, block_size, dtype=torch.float32, device=flat.device)
    for start in range(0, n_blocks, step):
        out[start:start + step] = decode(blocks[start:start + step])
    return out.view(shape)
