"""Pipeline parallelism: the model's decoder layers split into N stages, each on its own device.

This package holds the parts that need no device: `fence` (the MEMRA_PP_* doors, the stage map and
every placement refusal) and `probe_policy` (when and how the peer byte-integrity probe runs and
what a corrupted copy means). Both are pure functions over explicit inputs, so the rules can be
tested without a GPU and the runtime only has to wire them up.
"""

from memra.pp.fence import (
    BoundaryTransport,
    DualPpMode,
    PipelineError,
    PpDoors,
    PpDoorWarning,
    PpPlacement,
    StageFence,
    UnsplitView,
    boundary_transport,
    dual_pp_eligibility,
    dual_pp_route,
    dual_pp_wave_mid,
    plan_placement,
    pp_cuts,
    pp_fence,
    refuse_unsplit_if_remote,
    stage_of,
)

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
