"""Sharded weights: each layer's tensors live on the device of the stage that runs it.

Embedding with stage 0, final norm and lm_head (and the MTP blocks) with the last stage. A tied
lm_head that must live on another device than the embedding becomes its own copy there. With every
stage on one device (CPU, or several streams on one GPU) nothing moves.
"""

from __future__ import annotations

import torch

from memra.kernels.split import SPLIT_TYPES
from memra.pp.runtime import PpRuntime


def _move(obj, device: torch.device, seen: set[int]) -> None:
    """Move every tensor (and packed weight) reachable through obj's attributes (and lists of them) to `device`."""
    if id(obj) in seen:
        return
    seen.add(id(obj))
    for name, value in list(vars(obj).items()):
        if isinstance(value, (torch.Tensor, *SPLIT_TYPES)):  # a packed weight is frozen: replaced, not entered
            if value.device != device:
                setattr(obj, name, value.to(device))
        elif isinstance(value, (list, tuple)):
            for item in value:
                if hasattr(item, "__dict__"):
                    _move(item, device, seen)
        elif hasattr(value, "__dict__") and not isinstance(value, type):
            _move(value, device, seen)


def _indexed(device: torch.device) -> torch.device:
    """`cuda` as the device it means now (`cuda:N`), so one GPU named two ways is one device."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def shard_weights(model, rt: PpRuntime) -> None:
    devices = {_indexed(st.device) for st in rt.stages}
    if devices == {_indexed(model.device)}:
        return
    for s, st in enumerate(rt.stages):
        a, b = st.layers
        for block in model.blocks[a:b]:
            _move(block, st.device, set())
    last = rt.stages[-1].device
    for mtp in model.mtp:
        _move(mtp, last, set())
    if not model.is_view:  # a loaded model's unsharded tensors go (their memory with them), and with_settings
        model._weights = None  # with them; a view's belong to the model it views, which keeps them anyway
    tied = model.lm_head is model.embed
    model.embed = model.embed.to(rt.stages[0].device)
    model.lm_head = (model.embed if tied else model.lm_head).to(last)
    model.final_norm = model.final_norm.to(last)
