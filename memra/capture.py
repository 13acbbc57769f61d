"""What a captured step must never do: ask the host for a value that lives on the device.

A CUDA graph records launches; it cannot record the host waiting for a result. An op that needs a
device value on the host to proceed (which experts were chosen: `unique`, `nonzero`; a scalar read:
`.item()`, `bool(t)`; a boolean-mask index, whose output size is data) synchronizes the stream, and
inside a capture CUDA refuses it (cudaErrorStreamCaptureUnsupported): the step fails at the first
capture, on the GPU only. Step-3.5's MoE reached the per-expert reference loop that way.

`no_host_sync()` makes the same fault fail anywhere, CPU included: while it is active, the ops that
make the host wait raise HostSyncError naming the op. memra.graphs runs every static step's first,
eager run under it (on a GPU before the capture; on CPU, where the static step is run eagerly by the
tests, every time), so a path that would break a capture breaks the CPU suite first.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from memra.errors import MemraError

_aten = torch.ops.aten

# The ATen ops whose result the host must read before it can go on (the output's size or a Python value).
HOST_SYNC_OPS = frozenset({
    _aten._local_scalar_dense.default,  # .item(), int(t), float(t), bool(t)
    _aten.is_nonzero.default,
    _aten.equal.default,  # torch.equal: a Python bool
    _aten.nonzero.default,  # also boolean-mask indexing and masked_select
    _aten.masked_select.default,
    _aten._unique2.default,
    _aten.unique_dim.default,
    _aten.unique_consecutive.default,
    _aten.repeat_interleave.Tensor,  # repeats from a tensor: the output size is data
})


class HostSyncError(MemraError):
    """A step that is (or will be) captured asked the host for a device value."""


class _NoHostSync(TorchDispatchMode):
    def __init__(self, what: str):
        super().__init__()
        self.what = what

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in HOST_SYNC_OPS:
            raise HostSyncError(f"{self.what} calls {func.name()}, which waits for the device: a captured step "
                                f"cannot (give this path a device-side plan, or keep it out of graphs)")
        return func(*args, **(kwargs or {}))


def no_host_sync(what: str = "a captured step") -> _NoHostSync:
    """A context in which every op that makes the host wait for the device raises HostSyncError."""
    return _NoHostSync(what)
