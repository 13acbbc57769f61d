"""llm.update_weights: new values for some or all of a loaded model's weights, copied into place.

    prepared = prepare(model, weights)   # every refusal here, on the caller's thread; nothing changes
    apply(model, prepared)               # copies into the model's own tensors; weights_version + 1

`weights` is a mapping or an iterable of (name, tensor) in the checkpoint's own names, or a path to a
safetensors file or a directory of them. The stored tensors go through the loader's own name mapping
(memra.loading.hf / gguf) and conversion (memra.loading.checkpoint.place_weights), so an updated weight has,
bit for bit, the value a fresh memra.load of a checkpoint holding the new tensors gives it; with the same
kernels, every output then equals the fresh model's (tests/test_update_weights.py).

Only the parts whose stored tensors changed are rebuilt (the globals, a layer, an MTP block), each whole:
a fused weight (q | k | v, gate | up, the experts) takes the new tensors and the current value of the
others: the latest update of each name, which is why this module keeps a copy of every tensor it was
given (`model.weight_overlay`, host memory in the given dtype), else the file's.

Refused in one line, before anything changes: a name the checkpoint does not have, or one memra does not
read; a tensor that is not floating point, or of another shape than the stored one; a non-finite value in
a weight kept in fp32; a model whose weights are packed (GGUF quants, FP8 / NVFP4 kept packed) where an
update lands, or sharded over a pipeline, or built without a checkpoint (random:). The copies go into the
same storage (`Tensor.copy_`), so captured CUDA graphs and every view of the model stay valid.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import torch

from memra import counters
from memra.errors import MemraError
from memra.weights.overlay import OverlaySource

_FLOATS = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Prepared:
    """An update ready to land: canonical key -> its new value (placed as the model holds it)."""

    tensors: dict[str, torch.Tensor]
    given: dict[str, torch.Tensor]  # the stored names' new tensors (kept for later partial updates)


def read_update(weights) -> dict[str, torch.Tensor]:
    """The update as {stored name: tensor}: a mapping, (name, tensor) pairs, or a safetensors path."""
    if isinstance(weights, (str, Path)):
        return _read_path(Path(weights))
    items = weights.items() if isinstance(weights, Mapping) else weights
    out: dict[str, torch.Tensor] = {}
    try:
        for name, t in items:
            if not isinstance(name, str) or not isinstance(t, torch.Tensor):
                raise MemraError(f"update_weights takes (name, tensor) pairs; got ({type(name).__name__}, "
                                 f"{type(t).__name__})")
            out[name] = t.detach()
    except (TypeError, ValueError):
        raise MemraError("update_weights takes a mapping or (name, tensor) pairs, or a safetensors path") from None
    if not out:
        raise MemraError("update_weights got no tensors")
    return out


def _read_path(p: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(f for f in p.glob("*.safetensors") if f.name != "reference.safetensors") if p.is_dir() else [p]
    if not p.exists() or not files:
        raise MemraError(f"update_weights: {p} is not a safetensors file or a directory holding one")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            out.update(load_file(str(f)))
        except Exception as e:  # safetensors raises its own types for bad headers
            raise MemraError(f"update_weights: cannot read {f} ({str(e).splitlines()[0]})") from None
    return out


def _part_of(name: str) -> tuple[str, int]:
    """Which loader part reads a stored name: ("layer", i), ("mtp", j) or ("globals", 0)."""
    if m := re.search(r"(?:^|\.)layers\.(\d+)\.", name):
        return ("mtp", int(m.group(1))) if name.startswith("mtp.") else ("layer", int(m.group(1)))
    if m := re.match(r"blk\.(\d+)\.", name):  # GGUF
        return "layer", int(m.group(1))
    return ("mtp", 0) if name.startswith("mtp.") else ("globals", 0)


def check_tensor(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if t.dtype not in _FLOATS:
        raise MemraError(f"update_weights: {name} is {t.dtype}; weights are floating point (float32, bfloat16, "
                         "float16, float64)")
    if tuple(t.shape) != tuple(shape):
        raise MemraError(f"update_weights: {name} has shape {list(t.shape)}, the checkpoint's is {list(shape)}")


def open_source(model):
    """(names mapper, its file source) of the checkpoint `model` was loaded from, unpacked."""
    from memra.loading.checkpoint import RANDOM_PREFIX, open_checkpoint

    if not model.source or model.source.startswith(RANDOM_PREFIX):
        raise MemraError("update_weights needs a model loaded from a checkpoint (this one has random weights)")
    if getattr(model, "_weights", None) is None:
        raise MemraError("update_weights: this model's weights are sharded over a pipeline's devices; "
                         "load it unsplit to update them in place")
    _, names, _, _ = open_checkpoint(model.source)
    return names, names.src


def mapped_parts(model, names, wanted: set[tuple[str, int]]):
    """(prefix, tensors) of each wanted part, as the loader maps it from names.src."""
    parts = [("globals", 0, "", names.globals)]
    parts += [("layer", i, f"layers.{i}.", names.layer) for i in range(model.cfg.n_layers)]
    parts += [("mtp", j, f"mtp.{j}.", names.mtp) for j in range(model.cfg.n_mtp)]
    for kind, idx, prefix, fn in parts:
        if (kind, idx) in wanted:
            yield prefix, (fn() if kind == "globals" else fn(idx))


def prepare(model, weights) -> Prepared:
    """Read, check and convert an update without touching the model (module docstring)."""
    from memra.loading.checkpoint import place_weights
    from memra.loading.tensor_checks import nonfinite

    given = read_update(weights)
    names, base = open_source(model)
    for name, t in given.items():
        if not base.has(name):
            raise MemraError(f"update_weights: unknown weight {name!r} (the checkpoint {model.source} has no "
                             "tensor of that name)")
        check_tensor(name, t, base.shape(name))
    overlay = {**getattr(model, "weight_overlay", {}), **given}
    names.src = src = OverlaySource(base, overlay)
    wanted = {_part_of(n) for n in given}
    new: dict[str, torch.Tensor] = {}
    read: set[str] = set()
    with src.recording() as journal:
        for prefix, tensors in mapped_parts(model, names, wanted):
            new.update(place_weights(prefix, tensors, model.device, model.dtype))
    read.update(journal)
    if unread := sorted(set(given) - read):
        raise MemraError(f"update_weights: {unread[0]} is in the checkpoint but memra does not read it")
    held = model._weights
    for key, t in new.items():
        cur = held.get(key)
        if not isinstance(cur, torch.Tensor) or not isinstance(t, torch.Tensor):
            raise MemraError(f"update_weights: the model holds {key} packed ({type(cur).__name__}); load it with "
                             "packed_weights=False to update it in place")
        if cur.shape != t.shape or cur.dtype != t.dtype:
            raise MemraError(f"update_weights: {key} would become {list(t.shape)} {t.dtype}, the model holds "
                             f"{list(cur.shape)} {cur.dtype}")
    fp32 = {k: t for k, t in new.items() if t.dtype == torch.float32}
    if bad := nonfinite(fp32 if model.dtype != torch.float32 else new):
        raise MemraError(f"update_weights: {bad[0]} holds NaN or Inf")
    return Prepared(new, given)


@torch.no_grad()
def apply(model, prepared: Prepared) -> int:
    """Copy a prepared update into the model's tensors (the same storage). -> the new weights version.
    The caller holds the model still (no step runs): memra.engine.weight_swap on a server."""
    held = model._weights
    for key, t in prepared.tensors.items():
        held[key].copy_(t)
    # a new dict, never one changed in place: prepare() may read the old one on another thread meanwhile
    model.weight_overlay = {**getattr(model, "weight_overlay", {}),
                            **{k: t.to("cpu", copy=True) for k, t in prepared.given.items()}}
    model.weights_version = getattr(model, "weights_version", 0) + 1
    counters.bump("weight_updates")
    counters.bump("weights_updated", len(prepared.tensors))
    return model.weights_version
