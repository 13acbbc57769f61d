"""Write edited copies of GGUF fixtures (with the gguf package's writer) for loader tests."""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np


def rewrite_gguf(src: Path, dst: Path, drop: tuple[str, ...] = (), tensors: dict | None = None,
                 meta: dict | None = None, arch: str | None = None, alignment: int | None = None) -> Path:
    """Copy `src` to `dst`, leaving out tensors in `drop`, adding/replacing `tensors`
    (name -> ndarray, or (raw uint8 ndarray, GGMLQuantizationType)), overriding metadata
    (key -> (value, GGUFValueType)), and optionally aligning the data to `alignment` (general.alignment)."""
    reader = gguf.GGUFReader(str(src))
    arch = arch or reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(dst), arch)
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    meta = meta or {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in meta:
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub)
    for key, (value, vtype, *sub) in meta.items():  # (value, type) or, for an array, (value, ARRAY, item type)
        writer.add_key_value(key, value, vtype, sub_type=sub[0] if sub else None)
    tensors = dict(tensors or {})
    for t in reader.tensors:
        if t.name in drop or t.name in tensors:
            continue
        writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    for name, value in tensors.items():
        if isinstance(value, tuple):
            raw, qtype = value
            writer.add_tensor(name, raw, raw_dtype=qtype)
        else:
            writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


# --- raw byte edits, for the corrupted-file battery (tests/test_corrupt_files.py) -------------------
# Byte positions come from gguf.GGUFReader on the pristine file (the format's oracle); the edits then
# write bytes no well-behaved writer would.


@dataclass(frozen=True)
class TensorInfo:
    start: int  # the entry's first byte (its name's length)
    n_dims_at: int
    dims_at: int
    type_at: int
    offset_at: int
    end: int
    data_at: int  # absolute position of the tensor's data
    n_bytes: int
    type_id: int


@dataclass(frozen=True)
class Layout:
    size: int
    kv: dict  # key -> (start, value_at, end); value_at is the byte after the value type
    tensors: dict  # name -> TensorInfo, in directory order
    info_end: int  # end of the tensor directory
    data_start: int


@functools.lru_cache(maxsize=None)
def layout(path: Path) -> Layout:
    reader = gguf.GGUFReader(str(path))
    kv = {}
    for key, f in reader.fields.items():
        if not key.startswith("GGUF."):
            kv[key] = (f.offset, f.offset + 8 + len(key.encode()) + 4, f.offset + sum(p.nbytes for p in f.parts))
    tensors = {}
    for t in reader.tensors:
        f = t.field
        n_dims_at = f.offset + 8 + len(t.name.encode())
        n_dims = len(t.shape)
        type_at = n_dims_at + 4 + 8 * n_dims
        tensors[t.name] = TensorInfo(f.offset, n_dims_at, n_dims_at + 4, type_at, type_at + 4, type_at + 12,
                                     int(t.data_offset), int(t.n_bytes), int(t.tensor_type))
    info_end = max(t.end for t in tensors.values())
    return Layout(path.stat().st_size, kv, tensors, info_end, int(reader.data_offset))


def patched(src: Path, dst: Path, *edits: tuple[int, str, object]) -> Path:
    """Copy `src` with little-endian values packed at byte positions: edits are (position, format, value)."""
    data = bytearray(src.read_bytes())
    for at, fmt, value in edits:
        struct.pack_into("<" + fmt, data, at, value)
    dst.write_bytes(bytes(data))
    return dst


def with_raw_kv(src: Path, dst: Path, key: str, vtype: int, value: bytes, alignment: int = 32) -> Path:
    """Copy `src` with one more key/value pair, given as its type and raw value bytes, appended to the
    metadata; the tensor data moves to the next `alignment` boundary (offsets are relative to it)."""
    lay, data = layout(src), src.read_bytes()
    first_info = min(t.start for t in lay.tensors.values())
    pair = struct.pack("<Q", len(key.encode())) + key.encode() + struct.pack("<I", vtype) + value
    head = bytearray(data[:first_info] + pair + data[first_info:lay.info_end])
    struct.pack_into("<Q", head, 16, struct.unpack_from("<Q", data, 16)[0] + 1)
    head += bytes(-len(head) % alignment)
    dst.write_bytes(bytes(head) + data[lay.data_start:])
    return dst
