"""A JSON object read from a checkpoint file (config.json, model.safetensors.index.json), which is
untrusted input: unreadable, not UTF-8, not JSON, nested past the parser's stack, or not an object all
fail as one line naming the file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from memra.config.fields import kind
from memra.errors import MemraError


def read_json_object(path: Path, error: type[MemraError], fix: str) -> dict[str, Any]:
    """The top-level object of `path`; anything else raises `error` naming the file, what is wrong, and `fix`."""
    try:
        text = path.read_bytes().decode("utf-8-sig")  # a leading BOM is harmless
    except OSError as e:
        raise error(f"{path}: cannot read ({e.strerror or e}); {fix}") from None
    except UnicodeDecodeError as e:
        raise error(f"{path}: not UTF-8 text (bad byte at offset {e.start}); {fix}") from None
    try:
        raw = json.loads(text)
    except RecursionError:
        raise error(f"{path}: not valid JSON (nested too deeply); {fix}") from None
    except ValueError as e:  # json.JSONDecodeError, and an integer literal too long to convert
        raise error(f"{path}: not valid JSON ({' '.join(str(e).split())}); {fix}") from None
    if not isinstance(raw, dict):
        raise error(f"{path}: expected a JSON object at the top level, found {kind(raw)}; {fix}")
    return raw
