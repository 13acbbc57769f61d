"""The `tokenizer.*` metadata of a GGUF file, read as plain Python values (memra.tokenizer.gguf_vocab builds
the tokenizer from it)."""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memra.errors import TokenizerError

if TYPE_CHECKING:
    import gguf


def _wanted(key: str) -> bool:
    return key.startswith("tokenizer.") or key == "general.name"


def read_tokenizer_metadata(reader: "gguf.GGUFReader", source: str) -> dict[str, Any]:
    """The `tokenizer.*` keys (and `general.name`) of an open GGUF file, as plain Python values."""
    fields = getattr(reader, "fields", None)
    if fields is None:
        raise TokenizerError(f"{source}: expected an open gguf.GGUFReader, got {type(reader).__name__}")
    meta: dict[str, Any] = {}
    for key, field in fields.items():
        if _wanted(key):
            try:
                meta[key] = field.contents()
            except Exception as e:  # a malformed field fails inside the gguf package
                raise TokenizerError(
                    f"{source}: GGUF key {key!r} cannot be read ({e}); the file may be corrupt"
                ) from None
    return meta


def read_tokenizer_metadata_file(path: str | Path) -> dict[str, Any]:
    """What `read_tokenizer_metadata(gguf.GGUFReader(path), ...)` returns, read straight from the file.

    gguf.GGUFReader makes a numpy view of every element of every array, which takes ~15 s for a
    150k-token vocabulary; walking the same bytes sequentially (memra.loading.gguf_file) takes well
    under a second.
    """
    from memra.loading.gguf_file import read_metadata

    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
            if buffer[:4] != b"GGUF":
                raise TokenizerError(f"{path}: not a GGUF file (it does not start with 'GGUF')")
            meta = read_metadata(buffer)[0]
            return {k: v for k, v in meta.items() if _wanted(k)}
    except OSError as e:
        raise TokenizerError(f"{path}: cannot read ({e.strerror or e})") from None
    except (struct.error, ValueError) as e:  # ValueError includes UnicodeDecodeError and an empty file
        raise TokenizerError(f"{path}: corrupt or truncated GGUF metadata ({e})") from None
