"""Copies between host and device that do not wait for the whole stream.

`t.to("cuda")` from ordinary (pageable) host memory is a synchronous copy: PyTorch waits for the
stream to drain before it returns. On the step path that wait is a full stop. A decode graph
launched first has to finish (~9 ms on an 8B model) before the prefill that follows it can issue its
next kernel. A prefill that uploads its block table, token ids and chunk bounds layer by layer stops
once per upload. The host then never runs ahead of the GPU, and every launch's cost is added to the
step instead of hidden under the kernels already queued.

`upload` stages the values in pinned memory and copies with non_blocking=True. The copy is queued on
the current stream, after the work already there, so what it feeds reads the new values in stream
order. PyTorch's pinned-memory allocator keeps the staging block until the copy has run, so the
host tensor may go out of scope at once. The bytes that arrive are the same; only the host's waiting
changes. Off CUDA it is the plain `.to(device)`.

The other way is the same trap. `t.tolist()` on a CUDA tensor waits for everything queued on the
stream, including work launched *after* t was computed: an engine that launches step N+1 before it
reads step N's tokens would wait for step N+1 as well. `start_download` queues the copy into pinned
memory at once and records an event after it; `Download.wait()` waits for that event only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


def upload(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on `device`, copied without waiting for the device (CUDA) or as .to() elsewhere."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def upload_values(values: Sequence, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """torch.tensor(values, dtype=dtype, device=device), without waiting for the device."""
    return upload(torch.tensor(values, dtype=dtype), device)


def upload_parts(parts: Sequence[Sequence], dtype: torch.dtype, device: torch.device | str) -> list[torch.Tensor]:
    """Several lists in one upload, each a view starting on a 16-byte boundary of it. Triton compiles
    a kernel per pointer alignment: a part at an offset set by the lengths before it would be aligned
    in some steps and not in others, and the first step of a new kind would stall for a compile."""
    per = max(1, 16 // torch.empty(0, dtype=dtype).element_size())
    flat, at = [], []
    for part in parts:
        flat += [0] * (-len(flat) % per)
        at.append(len(flat))
        flat += list(part)
    whole = upload_values(flat, dtype, device)
    return [whole[a : a + len(part)] for a, part in zip(at, parts)]


@dataclass
class Download:
    """A device tensor's values on their way to the host: `host` is filled once `ready` has passed."""

    host: torch.Tensor
    ready: "torch.cuda.Event | None"  # None: the copy was synchronous (off CUDA)

    def wait(self) -> list:
        """The values as a list, after waiting for this copy only (the wait releases the GIL)."""
        if self.ready is not None:
            self.ready.synchronize()
        return self.host.tolist()


def start_download(t: torch.Tensor) -> Download:
    """Queue t's copy to pinned host memory on the current stream, after the work that computes t."""
    if t.device.type != "cuda":
        return Download(t.detach().to("cpu", copy=True), None)
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return Download(host, ready)
