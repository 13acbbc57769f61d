"""A checkpoint's tensors with some of them replaced: what the loader's name mapping reads during an update.

    OverlaySource(file_source, {name: tensor})  -> the same interface as the file (memra.loading.sources)

The mapping (memra.loading.hf.HfNames, memra.loading.gguf.GgufNames) fuses several stored tensors into one
canonical weight (q | k | v rows, gate | up, experts). An update of some of them rebuilds the fused weight
from the new ones and the current value of the others: the latest update of each name (held here), else
the file's.
"""

from __future__ import annotations

import torch

from memra.loading.sources import TensorSource


class OverlaySource(TensorSource):
    def __init__(self, base: TensorSource, overlay: dict[str, torch.Tensor]):
        self.base, self.overlay, self.path = base, overlay, base.path

    def names(self) -> set[str]:
        return self.base.names()

    def has(self, name: str) -> bool:
        return self.base.has(name)

    def file_of(self, name: str) -> str:
        return "the update" if name in self.overlay else self.base.file_of(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.base.shape(name)

    def type_name(self, name: str) -> str:
        return str(self.overlay[name].dtype) if name in self.overlay else self.base.type_name(name)

    def _read(self, name: str) -> torch.Tensor:
        return self.overlay[name] if name in self.overlay else self.base._read(name)

    def __getattr__(self, attr: str):
        # what a format's source adds (GGUF's qtype / packed, FP8's is_quantized): the file's answer for a
        # name the update leaves alone; an updated name is plain floats (update.py refuses a packed target)
        return getattr(self.base, attr)
