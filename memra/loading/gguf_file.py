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
from memra.loading.gguf_vocab import _MetadataCursor

DEFAULT_ALIGNMENT = 32


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
        order = "<" if struct.unpack_from("<I", buf, 4)[0] & 0xFFFF else ">"
        cur = _MetadataCursor(buf, order, pos=4)
        version = cur.number("I")
        if version not in (2, 3):
            raise CheckpointError(f"{self.path}: GGUF version {version} is not supported (2 and 3 are)")
        n_tensors, n_kv = cur.number("Q"), cur.number("Q")
        meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            meta[key] = cur.value(cur.number("I"))
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
