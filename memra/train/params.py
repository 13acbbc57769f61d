"""The trainer's parameters: the checkpoint's own tensors (its names, fp32 master copies), and the canonical
weights derived from them through the loader's mapping and conversion (memra.loading.hf / gguf,
memra.loading.checkpoint.place_weights) with autograd on: the same code a load and llm.update_weights run, so
the derived weights equal, bit for bit, the sampler's once it has received the parameters.
"""

from __future__ import annotations

import torch

from memra.errors import MemraError
from memra.loading.sources import TensorSource
from memra.weights.overlay import OverlaySource
from memra.weights.update import mapped_parts, open_source


class ParamSource(TensorSource):
    """The checkpoint's names and shapes, read from the trainer's parameters."""

    def __init__(self, base: TensorSource, params: dict[str, torch.Tensor]):
        self.base, self.params, self.path = base, params, "the trainer's parameters"

    def names(self) -> set[str]:
        return self.base.names()

    def has(self, name: str) -> bool:
        return self.base.has(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.base.shape(name)

    def type_name(self, name: str) -> str:
        return str(self.params[name].dtype)

    def __getattr__(self, attr: str):  # a format's extras (GGUF's qtype): the file's answer
        return getattr(self.base, attr)

    def _read(self, name: str) -> torch.Tensor:
        if name not in self.params:
            raise MemraError(f"the trainer has no parameter {name!r} (the mapping read a tensor it did not)")
        return self.params[name]


def parts(model) -> set[tuple[str, int]]:
    """What the training forward reads: the globals and every decoder layer (not the MTP blocks)."""
    return {("globals", 0)} | {("layer", i) for i in range(model.cfg.n_layers)}


def read_checkpoint(model) -> dict[str, torch.Tensor]:
    """The stored tensors the forward's weights come from, as the sampler holds them now (the file, and every
    update it received since), fp32 on the model's device."""
    names, base = open_source(model)
    names.src = src = OverlaySource(base, getattr(model, "weight_overlay", {}))
    with src.recording() as read:
        for _ in mapped_parts(model, names, parts(model)):
            pass
    return {n: src.get(n).to(device=model.device, dtype=torch.float32, copy=True) for n in dict.fromkeys(read)}


def derive(model, params: dict[str, torch.Tensor], dtype: torch.dtype | None = None, opened=None
           ) -> dict[str, torch.Tensor]:
    """Canonical weights from `params` (autograd through the mapping), placed as the model places them; dtype:
    the model's (the sampler's weights) or another (float64: the gradient reference). `opened`: open_source's
    answer, where the caller keeps it."""
    from memra.loading.checkpoint import place_weights

    names, base = opened or open_source(model)
    names.src = ParamSource(base, params)
    out: dict[str, torch.Tensor] = {}
    for prefix, tensors in mapped_parts(model, names, parts(model)):
        placed = place_weights(prefix, tensors, model.device, dtype or model.dtype)
        if dtype is not None:  # the reference keeps everything in its dtype
            placed = {k: t.to(dtype) for k, t in placed.items()}
        out.update(placed)
    for k, t in out.items():
        if not isinstance(t, torch.Tensor):
            raise MemraError(f"the training forward needs float weights; the model holds {k} packed (load it with "
                             "packed_weights=False)")
    return out
