"""Process-wide liveness counters: the only module-level mutable state in memra.

Each counts work that actually ran on a path a gate is checking, so a gate can prove its path was
exercised (a gate that passes because nothing ran is a defect). They only ever increase; read them
with `snapshot()` before and after. Exported later on /metrics.
"""

from __future__ import annotations

import threading

_lock = threading.Lock()
_counts = {
    "decode_batch_rows": 0,  # rows decoded through decode_step_batch[_sampled]
    "device_sampled_rows": 0,  # rows whose next token was chosen on the device
    "lean_parked_rows": 0,  # sampled rows whose logits were parked in cache.last_logits_dev
    "prime_pieces": 0,  # prefill forwards run by prime (exact path: 64-aligned pieces)
}


def bump(name: str, n: int = 1) -> None:
    with _lock:
        _counts[name] += n


def snapshot() -> dict[str, int]:
    with _lock:
        return dict(_counts)


def delta(before: dict[str, int]) -> dict[str, int]:
    now = snapshot()
    return {k: now[k] - before.get(k, 0) for k in now}
