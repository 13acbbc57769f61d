"""Every MEMRA_* environment door in one place: parsed, validated, explained.

Doors are read per call (not cached at import), so a gate can A/B them in one process. A value that
cannot be parsed is an error naming the door and the accepted values — never silently ignored.
"""

from __future__ import annotations

import os

from memra.errors import MemraError

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def flag(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    v = raw.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise MemraError(f"{name}={raw!r} is not a boolean; use 1/0 (or true/false, on/off)")


def integer(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise MemraError(f"{name}={raw!r} is not an integer") from None


def exact_mode() -> bool:
    """MEMRA_EXACT (default 1): run the exact path. 0 = the fast path whose bits may depend on the
    batch and on how a prompt is chunked (for measured comparisons only)."""
    return flag("MEMRA_EXACT", True)


def gdn_kernel() -> bool:
    """MEMRA_GDN_KERNEL (default 1): GDN's chunked prefill as the two-launch Triton kernel on CUDA
    (memra.kernels.gdn_triton). 0 = the reference's torch chunk loop, ~15x slower on an H200."""
    return flag("MEMRA_GDN_KERNEL", True)


def sample_kernel() -> bool:
    """MEMRA_SAMPLE_KERNEL (default 1): a batch's seeded sampling as one Triton launch on CUDA
    (memra.kernels.sample_triton). 0 = device_sample row by row, ~15 launches per row."""
    return flag("MEMRA_SAMPLE_KERNEL", True)


def api_key() -> str | None:
    """MEMRA_API_KEY (default unset): the key `memra serve` requires when neither --api-key nor
    --api-key-file gives one; an environment variable stays out of the process list."""
    return os.environ.get("MEMRA_API_KEY") or None
