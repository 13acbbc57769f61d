"""Dual-wave PP-2 decode: which batched calls take the two-wave body, why it refuses a placement,
where the waves split, and which boundary slot each transfer uses.

Mirrors the reference's dual-wave routing, checked before any token or cache advances. The refusal
texts are read by the gates and tests, so they must not drift; MEMRA_DUAL_PP itself is parsed in
memra.pp.doors.
"""

from __future__ import annotations

from memra.pp.doors import DualPpMode


def dual_pp_route(mode: DualPpMode, batch: int, stages: int, double_slot: bool, host_bounce: bool) -> bool:
    """Whether a batched decode call goes to the dual-wave body. One row never does (no second
    wave). FORCED sends every B>=2 call there so its refusals fire; AUTO only the validated regime."""
    if batch < 2:
        return False
    if mode is DualPpMode.OFF:
        return False
    if mode is DualPpMode.FORCED:
        return True
    return stages == 2 and double_slot and not host_bounce


DUAL_PP_TWO_STAGES_REFUSAL = "dual-wave decode refused: it needs exactly two PP stages"
DUAL_PP_SINGLE_SLOT_REFUSAL = (
    "dual-wave decode refused: the PP boundary has a single slot; set MEMRA_PP_OVERLAP=1 so both "
    "alternating boundary slots are prepared"
)
DUAL_PP_HOST_BOUNCE_REFUSAL = (
    "dual-wave decode refused: MEMRA_PP_HOST_BOUNCE=1 is not validated for it; unset MEMRA_DUAL_PP "
    "or use the peer transport"
)


def dual_pp_eligibility(stages: int, double_slot: bool, host_bounce: bool) -> str | None:
    """The refusal text if the dual-wave body cannot run on this placement, else None. Checked in
    the reference's order (stage count, slots, transport) before any token or cache advances."""
    if stages != 2:
        return DUAL_PP_TWO_STAGES_REFUSAL
    if not double_slot:
        return DUAL_PP_SINGLE_SLOT_REFUSAL
    if host_bounce:
        return DUAL_PP_HOST_BOUNCE_REFUSAL
    return None


def dual_pp_wave_mid(batch: int) -> int | None:
    """Where wave B starts: ceil(batch/2), so wave A takes the larger half. None for one row."""
    return (batch + 1) // 2 if batch >= 2 else None


DUAL_PP_STAGE_NAMES = ("wave_a_stage0", "wave_a_stage1", "wave_b_stage0", "wave_b_stage1")


def boundary_slot(step: int, overlap: bool) -> int:
    """The boundary slot a TX uses: alternate per boundary step under overlap, else always slot 0."""
    return step % 2 if overlap else 0


def dual_pp_slot_pair_ok(slot_a: int, slot_b: int) -> bool:
    """Both waves of one pair must use different slots; a collision is refused (and counted)."""
    return slot_a != slot_b
