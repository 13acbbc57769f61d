"""The pipeline's door, fence and placement surface in one namespace (`from memra.pp import fence as pf`).

The rules live in modules with one job each, every one a pure function of explicit inputs:
    memra.pp.errors     the two failure styles: PipelineError, and PpDoorWarning through warn_once
    memra.pp.topology   StageFence: which layers each stage owns (`stage_of`)
    memra.pp.doors      every MEMRA_PP_* door parsed and resolved; PpDoors, one snapshot of them all
    memra.pp.dual       dual-wave PP-2 routing, its refusals, the boundary slots
    memra.pp.placement  stage -> device, boundary transports, and the placement refusals
The walk, the gates and the multi-process driver use a dozen of these at once, so they read them here;
nothing is defined in this module, so there is one definition of each rule. New code that needs one
or two names may import the owning module instead.
"""

from memra.pp.doors import (
    DualPpMode,
    Env,
    PpDoors,
    allow_unsplit_batch,
    batch_pp_on,
    dual_pp_mode,
    dual_pp_mode_resolve,
    dual_pp_on,
    dual_pp_timing_on,
    parse_fence,
    peer_probe_on,
    pp2_split,
    pp_cuts,
    pp_fence,
    pp_host_bounce_on,
    pp_overlap,
    pp_overlap_resolve,
    pp_shard_off,
    pp_streams_off,
    prime_pipe_on,
    prime_pp_on,
    spec_pp_on,
    warn_unwired_once,
)
from memra.pp.dual import (
    DUAL_PP_HOST_BOUNCE_REFUSAL,
    DUAL_PP_SINGLE_SLOT_REFUSAL,
    DUAL_PP_STAGE_NAMES,
    DUAL_PP_TWO_STAGES_REFUSAL,
    boundary_slot,
    dual_pp_eligibility,
    dual_pp_route,
    dual_pp_slot_pair_ok,
    dual_pp_wave_mid,
)
from memra.pp.errors import PipelineError, PpDoorWarning, reset_warnings, warn_once
from memra.pp.placement import (
    BoundaryTransport,
    PpPlacement,
    UnsplitView,
    boundary_transport,
    peer_capable_pairs,
    plan_placement,
    pp_host_bounce_active,
    pp_multi_stream_same_device,
    pp_sharded_cross_device,
    refuse_unsplit_if_remote,
)
from memra.pp.topology import StageFence, stage_of

__all__ = [
    "DUAL_PP_HOST_BOUNCE_REFUSAL",
    "DUAL_PP_SINGLE_SLOT_REFUSAL",
    "DUAL_PP_STAGE_NAMES",
    "DUAL_PP_TWO_STAGES_REFUSAL",
    "BoundaryTransport",
    "DualPpMode",
    "Env",
    "PipelineError",
    "PpDoorWarning",
    "PpDoors",
    "PpPlacement",
    "StageFence",
    "UnsplitView",
    "allow_unsplit_batch",
    "batch_pp_on",
    "boundary_slot",
    "boundary_transport",
    "dual_pp_eligibility",
    "dual_pp_mode",
    "dual_pp_mode_resolve",
    "dual_pp_on",
    "dual_pp_route",
    "dual_pp_slot_pair_ok",
    "dual_pp_timing_on",
    "dual_pp_wave_mid",
    "parse_fence",
    "peer_capable_pairs",
    "peer_probe_on",
    "plan_placement",
    "pp2_split",
    "pp_cuts",
    "pp_fence",
    "pp_host_bounce_active",
    "pp_host_bounce_on",
    "pp_multi_stream_same_device",
    "pp_overlap",
    "pp_overlap_resolve",
    "pp_shard_off",
    "pp_sharded_cross_device",
    "pp_streams_off",
    "prime_pipe_on",
    "prime_pp_on",
    "refuse_unsplit_if_remote",
    "reset_warnings",
    "spec_pp_on",
    "stage_of",
    "warn_once",
    "warn_unwired_once",
]
