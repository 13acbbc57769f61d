"""Pipeline parallelism: the model's decoder layers split into N stages, each on its own device.

The parts that need no device are pure functions over explicit inputs, so the rules can be tested
without a GPU and the runtime only has to wire them up:
    errors, topology, doors, dual, placement   the MEMRA_PP_* doors, the stage map, the dual-wave
                                              routing and every placement refusal (one namespace:
                                              memra.pp.fence)
    probe_pattern, probe_policy               the peer byte-integrity probe's bytes, and when it runs
                                              and what a corrupted copy means
The device side: runtime (streams, slots, transports), probe, walk, and dist* (multi-process stages).
"""

from memra.pp.doors import DualPpMode, PpDoors, pp_cuts, pp_fence
from memra.pp.dual import dual_pp_eligibility, dual_pp_route, dual_pp_wave_mid
from memra.pp.errors import PipelineError, PpDoorWarning
from memra.pp.placement import (BoundaryTransport, PpPlacement, UnsplitView, boundary_transport, plan_placement,
                                refuse_unsplit_if_remote)
from memra.pp.topology import StageFence, stage_of

__all__ = [
    "BoundaryTransport",
    "DualPpMode",
    "PipelineError",
    "PpDoors",
    "PpDoorWarning",
    "PpPlacement",
    "StageFence",
    "UnsplitView",
    "boundary_transport",
    "dual_pp_eligibility",
    "dual_pp_route",
    "dual_pp_wave_mid",
    "plan_placement",
    "pp_cuts",
    "pp_fence",
    "refuse_unsplit_if_remote",
    "stage_of",
]
