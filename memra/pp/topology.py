"""The stage map: which decoder layers each pipeline stage owns (the reference's fence vector and
`stage_of`). Pure data; the doors that ask for a fence are parsed in memra.pp.doors."""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass

from memra.pp.errors import PipelineError


@dataclass(frozen=True)
class StageFence:
    """N stages over `n_layers` decoder layers, cut before each layer index in `cuts`.

    Stage s runs layers [bounds[s], bounds[s+1]). The embedding lives with stage 0; the final norm
    and lm_head live with the last stage, and so do MTP layers (index >= n_layers), which sit after
    the trunk.
    """

    n_layers: int
    cuts: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "cuts", tuple(int(c) for c in self.cuts))
        if self.n_layers < 1:
            raise PipelineError(f"a stage fence needs at least one layer, got n_layers={self.n_layers}")
        bounds = self.bounds
        if any(a >= b for a, b in zip(bounds, bounds[1:])):
            raise PipelineError(
                f"stage fence {list(bounds)} is not strictly increasing over 0..{self.n_layers}: "
                "every stage needs at least one layer"
            )

    @property
    def bounds(self) -> tuple[int, ...]:
        """(0, c1, .., cN-1, n_layers): the reference's fence vector."""
        return (0, *self.cuts, self.n_layers)

    @property
    def n_stages(self) -> int:
        return len(self.cuts) + 1

    @property
    def ranges(self) -> tuple[tuple[int, int], ...]:
        b = self.bounds
        return tuple((b[s], b[s + 1]) for s in range(self.n_stages))

    @property
    def embed_stage(self) -> int:
        return 0

    @property
    def head_stage(self) -> int:
        return self.n_stages - 1

    def stage_of(self, layer: int) -> int:
        """The stage owning `layer`; a cut index is the first layer of the next stage."""
        if layer < 0:
            raise ValueError(f"layer index must be >= 0, got {layer}")
        # bisect_right counts the cuts at or before `layer`; past the trunk that is every cut,
        # which is the last stage — where MTP layers belong.
        return bisect_right(self.cuts, layer)


def stage_of(fence: StageFence, layer: int) -> int:
    """The stage that owns `layer` under `fence` (MTP layers past the trunk: the last stage)."""
    return fence.stage_of(layer)
