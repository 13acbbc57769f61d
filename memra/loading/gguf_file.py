"""A GGUF file's metadata and tensor directory, read sequentially from a memory map.

gguf.GGUFReader builds a numpy view for every element of every array, which costs ~15 s on a real
Qwen vocabulary (248k tokens) before a single weight is read. Walking the same bytes once takes well
under a second. The gguf package stays the authority on the format's constants (quantization types,
block sizes), writes our GGUF files, and is the oracle this reader is tested against
(tests/test_loading.py compares every key and tensor entry with GGUFReader's on all fixtures).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from memra.errors import CheckpointError

DEFAULT_ALIGNMENT = 32

# GGUF value types (the spec's numbering) that are fixed-size numbers, as struct / numpy format codes.
_NUMBER_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


class MetadataCursor:
    """Reads GGUF values one after another from the key/value section at the start of the file."""

    def __init__(self, buffer: Any, order: str, pos: int):
        self.buffer, self.order, self.pos = buffer, order, pos

    def number(self, code: str) -> Any:
        (value,) = struct.unpack_from(self.order + code, self.buffer, self.pos)
        self.pos += struct.calcsize(code)
        return value

    def string(self) -> str:
        size = self.number("Q")
        raw = bytes(self.buffer[self.pos:self.pos + size])
        if len(raw) != size:
            raise struct.error("a string runs past the end of the file")
        self.pos += size
        return raw.decode("utf-8")

    def value(self, kind: int) -> Any:
        if kind in _NUMBER_FORMATS:
            return self.number(_NUMBER_FORMATS[kind])
        if kind == _GGUF_STRING:
            return self.string()
        if kind == _GGUF_ARRAY:
            item_kind, count = self.number("I"), self.number("Q")
            if item_kind in _NUMBER_FORMATS:  # one bulk read instead of `count` small ones
                dtype = np.dtype(self.order + _NUMBER_FORMATS[item_kind])
                items = np.frombuffer(self.buffer, dtype, count, self.pos).tolist()
                self.pos += count * dtype.itemsize
                return items
            return [self.value(item_kind) for _ in range(count)]
        raise ValueError(f"unknown GGUF value type {kind}")



def read_metadata(buffer: Any) -> tuple[dict[str, Any], MetadataCursor, int]:
    """Header and key/value section of a GGUF buffer (magic already checked) -> (all pairs, a cursor at
    the tensor directory, the tensor count). Raises struct.error / ValueError on corrupt or truncated bytes."""
    order = "<" if struct.unpack_from("<I", buffer, 4)[0] & 0xFFFF else ">"  # v2/v3, either byte order
    cur = MetadataCursor(buffer, order, pos=4)
    version = cur.number("I")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not supported (2 and 3 are); reconvert with a current llama.cpp")
    n_tensors = cur.number("Q")
    meta: dict[str, Any] = {}
    for _ in range(cur.number("Q")):
        key = cur.string()
        meta[key] = cur.value(cur.number("I"))
    return meta, cur, n_tensors


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
        except (struct.error, ValueError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: corrupt or truncated GGUF file ({e})") from None

    def _parse(self) -> tuple[dict[str, Any], dict[str, TensorEntry]]:
        buf = self._map
        if buf[:4] != b"GGUF":
            raise CheckpointError(f"{self.path}: not a GGUF file (bad magic {bytes(buf[:4])!r})")
        meta, cur, n_tensors = read_metadata(buf)
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            ne = tuple(cur.number("Q") for _ in range(cur.number("I")))
            infos.append((name, ne, cur.number("I"), cur.number("Q")))
        align = int(meta.get("general.alignment", DEFAULT_ALIGNMENT))
        data_start = -(-cur.pos // align) * align
        tensors = {}
        for name, ne, type_id, rel in infos:
            n_bytes = _n_bytes(ne, type_id, name, self.path)
            entry = TensorEntry(name, ne, type_id, data_start + rel, n_bytes)
            if entry.offset + n_bytes > len(buf):
                raise CheckpointError(f"{self.path}: tensor {name!r} runs past the end of the file (truncated download?)")
            tensors[name] = entry
        return meta, tensors

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes exactly as stored (a copy, so the map can be closed)."""
        e = self.tensors[name]
        return np.frombuffer(self._map, np.uint8, e.n_bytes, e.offset).copy()


def _n_bytes(ne: tuple[int, ...], type_id: int, name: str, path: str) -> int:
    try:
        block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(type_id)]
    except (ValueError, KeyError):
        raise CheckpointError(f"{path}: tensor {name!r} has unknown ggml type id {type_id}") from None
    n = int(np.prod(ne, dtype=np.int64)) if ne else 1
    if n % block:
        raise CheckpointError(f"{path}: tensor {name!r} has {n} values, not a whole number of {block}-value blocks")
    return n // block * type_size
