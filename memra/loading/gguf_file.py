"""A GGUF file's metadata and tensor directory, read sequentially from a memory map, and checked.

gguf.GGUFReader builds a numpy view for every element of every array, which costs ~15 s on a real
Qwen vocabulary (248k tokens) before a single weight is read. Walking the same bytes once takes well
under a second. The gguf package stays the authority on the format's constants (quantization types,
block sizes), writes our GGUF files, and is the oracle this reader is tested against
(tests/test_loading.py compares every key and tensor entry with GGUFReader's on all fixtures).

The header is untrusted input, so every count, length, type and offset is checked before it is used
(a count of 2^60 fails at once instead of looping; a nested array cannot exhaust the stack), and the
tensor directory must satisfy llama.cpp's own rules (gguf.cpp): a power-of-two alignment, 1..4 dims,
known types with whole blocks per row, no duplicate names or keys, and, in directory order, each
tensor's offset equal to the sum of the sizes before it, each padded to the alignment. That last rule
is what catches a moved offset or a changed type id, which would otherwise read a neighbour's bytes.
We add one rule of our own: nothing but padding may follow the last tensor (so a type id changed on
the last tensor, to a smaller type, is caught too).
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from memra.errors import CheckpointError

DEFAULT_ALIGNMENT = 32
MAX_ALIGNMENT = 1 << 20  # llama.cpp takes any power of two; none above 2^20 is plausible
MAX_ARRAY_DEPTH = 8  # llama.cpp reads no nested arrays at all; gguf-py writes them, so allow a few levels
GGML_MAX_DIMS = 4
INT64_MAX = (1 << 63) - 1

# GGUF value types (the spec's numbering) that are fixed-size numbers, as struct / numpy format codes.
_NUMBER_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9
# The fewest bytes one value of a type can take (a string: its length; an array: its item type and count),
# which bounds how many of them the bytes left in the file can hold.
_MIN_BYTES = {**{k: struct.calcsize(v) for k, v in _NUMBER_FORMATS.items()}, _GGUF_STRING: 8, _GGUF_ARRAY: 12}
_MIN_KV_BYTES = 8 + 4 + 1  # key length, value type, a one-byte value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8  # name length, n_dims, one dim, type, offset


class GgufFormatError(ValueError):
    """The header breaks the GGUF format; the message says where (which key or tensor) and how."""


class MetadataCursor:
    """Reads GGUF values one after another from the key/value section at the start of the file."""

    def __init__(self, buffer: Any, order: str, pos: int):
        self.buffer, self.order, self.pos = buffer, order, pos

    def need(self, n: int, what: str) -> None:
        if n > len(self.buffer) - self.pos:
            raise GgufFormatError(f"{what} needs {n} bytes at offset {self.pos}, past the end of the file "
                                  f"({len(self.buffer)} bytes; truncated?)")

    def number(self, code: str, what: str = "a number") -> Any:
        size = struct.calcsize(code)
        self.need(size, what)
        (value,) = struct.unpack_from(self.order + code, self.buffer, self.pos)
        self.pos += size
        return value

    def count(self, item_bytes: int, what: str) -> int:
        """A u64 count of items of at least `item_bytes` each, bounded by the bytes left in the file."""
        n = self.number("Q", what)
        if n * item_bytes > len(self.buffer) - self.pos:
            raise GgufFormatError(f"{what} is {n}, more than the {len(self.buffer) - self.pos} bytes left in the "
                                  "file can hold (truncated or corrupt)")
        return n

    def string(self, what: str) -> str:
        size = self.count(1, f"the length of {what}")
        raw = bytes(self.buffer[self.pos:self.pos + size])
        self.pos += size
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise GgufFormatError(f"{what} is not valid UTF-8 (bad byte at {e.start} of {size})") from None

    def value(self, kind: int, what: str, depth: int = 0) -> Any:
        if kind in _NUMBER_FORMATS:
            return self.number(_NUMBER_FORMATS[kind], what)
        if kind == _GGUF_STRING:
            return self.string(what)
        if kind != _GGUF_ARRAY:
            raise GgufFormatError(f"{what} has unknown GGUF value type {kind}")
        if depth >= MAX_ARRAY_DEPTH:
            raise GgufFormatError(f"{what} holds arrays nested deeper than {MAX_ARRAY_DEPTH} levels")
        item_kind = self.number("I", what)
        if item_kind not in _MIN_BYTES:
            raise GgufFormatError(f"{what} is an array of unknown GGUF value type {item_kind}")
        count = self.count(_MIN_BYTES[item_kind], f"the item count of {what}")
        if item_kind in _NUMBER_FORMATS:  # one bulk read instead of `count` small ones
            dtype = np.dtype(self.order + _NUMBER_FORMATS[item_kind])
            items = np.frombuffer(self.buffer, dtype, count, self.pos).tolist()
            self.pos += count * dtype.itemsize
            return items
        return [self.value(item_kind, what, depth + 1) for _ in range(count)]


def read_metadata(buffer: Any) -> tuple[dict[str, Any], MetadataCursor, int]:
    """Header and key/value section of a GGUF buffer (magic already checked) -> (all pairs, a cursor at
    the tensor directory, the tensor count). Raises GgufFormatError (a ValueError) on corrupt or
    truncated bytes, naming the key at fault."""
    cur = MetadataCursor(buffer, "<", pos=4)
    cur.need(20, "the GGUF header")
    cur.order = "<" if struct.unpack_from("<I", buffer, 4)[0] & 0xFFFF else ">"  # v2/v3, either byte order
    version = cur.number("I", "the version")
    if version not in (2, 3):
        raise GgufFormatError(f"GGUF version {version} is not supported (memra reads versions 2 and 3)")
    n_tensors = cur.count(_MIN_TENSOR_INFO_BYTES, "the tensor count")
    meta: dict[str, Any] = {}
    for i in range(cur.count(_MIN_KV_BYTES, "the key/value count")):
        key = cur.string(f"the key of metadata pair {i}")
        if key in meta:
            raise GgufFormatError(f"metadata key {key!r} appears twice")
        meta[key] = cur.value(cur.number("I", f"the type of key {key!r}"), f"the value of key {key!r}")
    return meta, cur, n_tensors


def alignment(meta: dict[str, Any]) -> int:
    """general.alignment: a power of two (llama.cpp's rule), at most MAX_ALIGNMENT."""
    align = meta.get("general.alignment", DEFAULT_ALIGNMENT)
    if isinstance(align, bool) or not isinstance(align, int) or not 0 < align <= MAX_ALIGNMENT or align & (align - 1):
        raise GgufFormatError(f"general.alignment = {align!r} is not a power of two in 1..{MAX_ALIGNMENT} "
                              "(llama.cpp refuses such a file too)")
    return align


@dataclass(frozen=True)
class TensorEntry:
    name: str
    ne: tuple[int, ...]  # GGUF dims, fastest first
    type_id: int  # ggml type id (gguf.GGMLQuantizationType value)
    offset: int  # absolute byte offset in the file
    n_bytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """The torch (row-major) shape: the dims reversed."""
        return tuple(reversed(self.ne))


def _tensor_info(cur: MetadataCursor, i: int) -> tuple[str, tuple[int, ...], int, int, int]:
    """One directory entry -> (name, ne, type id, relative offset, byte size), each field checked."""
    name = cur.string(f"the name of tensor {i}")
    what = f"tensor {name!r}"
    n_dims = cur.number("I", f"the dims count of {what}")
    if not 1 <= n_dims <= GGML_MAX_DIMS:
        raise GgufFormatError(f"{what} has {n_dims} dims; GGUF allows 1..{GGML_MAX_DIMS}")
    ne = tuple(cur.number("Q", f"the dims of {what}") for _ in range(n_dims))
    if not all(1 <= d <= INT64_MAX for d in ne) or math.prod(ne) > INT64_MAX:
        raise GgufFormatError(f"{what} has dims {list(ne)}; each must be at least 1 and their product below 2^63")
    type_id = cur.number("I", f"the type of {what}")
    try:
        qtype = gguf.GGMLQuantizationType(type_id)
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise GgufFormatError(f"{what} has unknown ggml type id {type_id}") from None
    if ne[0] % block:
        raise GgufFormatError(f"{what} of type {qtype.name} has {ne[0]} values per row, not a multiple of its "
                              f"block size {block}")
    rel = cur.number("Q", f"the data offset of {what}")
    return name, ne, type_id, rel, math.prod(ne) // block * type_size


def _describe(name: str, ne: tuple[int, ...], type_id: int) -> str:
    return f"{name!r} ({gguf.GGMLQuantizationType(type_id).name}, dims {list(ne)})"


class GgufFile:
    def __init__(self, path: str | Path):
        self.path = str(path)
        try:
            with open(path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e:  # ValueError: an empty file cannot be mapped
            raise CheckpointError(f"{path}: cannot read ({e})") from None
        try:
            self.metadata, self.tensors = self._parse()
        except GgufFormatError as e:
            raise CheckpointError(f"{path}: corrupt or truncated GGUF file: {e}; re-download or re-convert "
                                  "it") from None

    def _parse(self) -> tuple[dict[str, Any], dict[str, TensorEntry]]:
        buf = self._map
        if buf[:4] != b"GGUF":
            raise CheckpointError(f"{self.path}: not a GGUF file (bad magic {bytes(buf[:4])!r})")
        meta, cur, n_tensors = read_metadata(buf)
        align = alignment(meta)
        infos = [_tensor_info(cur, i) for i in range(n_tensors)]
        data_start = -(-cur.pos // align) * align
        tensors: dict[str, TensorEntry] = {}
        expected, before = 0, "the data section starts"  # llama.cpp's rule: back to back in directory order
        for name, ne, type_id, rel, n_bytes in infos:
            if name in tensors:
                raise GgufFormatError(f"tensor name {name!r} appears twice in the directory")
            if rel != expected:
                raise GgufFormatError(f"tensor {name!r} has data offset {rel}, but {before} at {expected} (padded to "
                                      f"{align} bytes): one of these two directory entries was changed")
            if data_start + rel + n_bytes > len(buf):
                raise GgufFormatError(f"tensor {name!r} runs past the end of the file (truncated download?)")
            tensors[name] = TensorEntry(name, ne, type_id, data_start + rel, n_bytes)
            expected += -(-n_bytes // align) * align
            before = f"{_describe(name, ne, type_id)} before it ends"
        if len(buf) > data_start + expected:  # (vocabulary-only files end at the directory, unpadded)
            last = f"the last is {_describe(*infos[-1][:3])}" if infos else "it lists none"
            raise GgufFormatError(f"{len(buf) - data_start - expected} bytes follow the tensor data the directory "
                                  f"describes ({last}); was a tensor's type, dims or count changed?")
        return meta, tensors

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes exactly as stored (a copy, so the map can be closed). The pages the copy read
        are then dropped from this process's resident set: a model loads tensor by tensor, and mapped pages
        left resident would hold the whole file in memory beside the weights made from it (peak RSS 2x the
        file instead of ~1x)."""
        e = self.tensors[name]
        out = np.frombuffer(self._map, np.uint8, e.n_bytes, e.offset).copy()
        page = mmap.PAGESIZE
        lo, hi = -(-e.offset // page) * page, (e.offset + e.n_bytes) // page * page  # whole pages inside it only
        if hi > lo and hasattr(mmap, "MADV_DONTNEED"):
            self._map.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
        return out
