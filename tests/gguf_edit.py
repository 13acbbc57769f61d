"""Write edited copies of GGUF fixtures (with the gguf package's writer) for loader tests."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np


def rewrite_gguf(src: Path, dst: Path, drop: tuple[str, ...] = (), tensors: dict | None = None,
                 meta: dict | None = None, arch: str | None = None) -> Path:
    """Copy `src` to `dst`, leaving out tensors in `drop`, adding/replacing `tensors`
    (name -> ndarray, or (raw uint8 ndarray, GGMLQuantizationType)), and overriding metadata
    (key -> (value, GGUFValueType))."""
    reader = gguf.GGUFReader(str(src))
    arch = arch or reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(dst), arch)
    meta = meta or {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in meta:
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub)
    for key, (value, vtype) in meta.items():
        writer.add_key_value(key, value, vtype)
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
