"""Handing freed host memory back to the system.

glibc keeps blocks that a process frees in its malloc arenas for reuse, and the resident size (RSS) the
system reports still counts them. Loading a model frees about as much as it keeps (file reads, decoded
and converted copies), so a CPU model looked larger than its weights: 202 MiB resident after loading a
111 MB Q4_K_M GGUF whose weights hold 117 MiB, 155 MiB after glibc's malloc_trim. Called once, when a
CPU load is done. Not after a forward: the next steps would fault its pages back in (measured: the
first 32 tokens after a trim ran 10-25% slower). Elsewhere (no glibc) it does nothing.
"""

from __future__ import annotations

import ctypes


def return_freed_memory() -> None:
    """glibc's malloc_trim(0): give the arenas' free pages back to the system."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not Linux with glibc
        pass
