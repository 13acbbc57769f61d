"""How the pipeline fails: the two styles the reference chose, shared by every memra.pp module.

  * a door value that cannot be used leaves pipeline parallelism OFF and warns once per
    (door, value) — `PpDoorWarning` through `warn_once`: a typo must never silently produce a
    different split than the one asked for;
  * a placement or schedule that cannot be honoured raises `PipelineError` — running anyway would
    fake a gate.

Kept apart from the door parser so the pure policies (the probe's, the stage map) can refuse without
importing the doors.
"""

from __future__ import annotations

import threading
import warnings

from memra.errors import MemraError


class PipelineError(MemraError):
    """A pipeline-parallel placement or schedule that memra refuses to run."""


class PpDoorWarning(UserWarning):
    """A MEMRA_PP_* door value that was ignored (the door keeps its safe setting)."""


# One warning per (door, value): the reference warns once per process; keying on the value too
# means a second, different typo in the same process is still reported.
_warned: set[tuple[str, str]] = set()
_warned_lock = threading.Lock()


def warn_once(door: str, value: str, message: str) -> bool:
    """Emit `message` as a PpDoorWarning unless (door, value) already warned. True if emitted."""
    with _warned_lock:
        if (door, value) in _warned:
            return False
        _warned.add((door, value))
    warnings.warn(message, PpDoorWarning, stacklevel=3)
    return True


def reset_warnings() -> None:
    """Forget which (door, value) pairs have warned (tests only)."""
    with _warned_lock:
        _warned.clear()
