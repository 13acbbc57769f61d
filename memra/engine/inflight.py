"""The engine step whose tokens are still on the device.

A step launches its forwards and its sampling and returns without waiting for them. The next step
launches its decode from those tokens on the device (`decode_ids`), and only then waits for them
(`InFlight.fetch`) to send events and end the sequences that finished. So the GPU has the next
step queued while the host reads, sends and schedules, and the host's work per step hides under
the GPU's instead of adding to it.

A sequence that ended at step N (its end token, a stop string) is found while step N+1 already
runs with its row: that row's token is dropped and its cache freed. Other rows cannot notice it:
every decode row is computed as it would be alone (E1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from memra.engine.sampler import PendingPick, Picked
from memra.engine.seq_state import SeqState
from memra.upload import upload_values


@dataclass
class InFlight:
    rows: list[SeqState]  # in the order of pick.tokens
    pick: PendingPick

    def fetch(self) -> list[tuple[SeqState, Picked]]:
        return list(zip(self.rows, self.pick.fetch()))


def decode_ids(rows: list[SeqState], inflight: InFlight | None, device: torch.device) -> torch.Tensor | list[int]:
    """Each row's last token, the input of its next decode: from the step in flight where it is there
    (a gather on the device), else the host's record. -> int64 [B] on the device, or a host list when
    nothing is in flight."""
    where = {id(s): j for j, s in enumerate(inflight.rows)} if inflight is not None else {}
    src = [where.get(id(s)) for s in rows]
    if all(j is None for j in src):
        return [s.out[-1] for s in rows]
    if src == list(range(len(inflight.rows))):  # the usual step: the same rows in the same order
        return inflight.pick.tokens
    ids = upload_values([s.out[-1] if j is None else 0 for s, j in zip(rows, src)], torch.long, device)
    dst = [i for i, j in enumerate(src) if j is not None]
    picked = inflight.pick.tokens.index_select(0, upload_values([src[i] for i in dst], torch.long, device))
    return ids.index_copy_(0, upload_values(dst, torch.long, device), picked)
