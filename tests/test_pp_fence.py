"""The PP doors, the stage fence and the placement refusals (memra.pp.fence), with no device."""

from __future__ import annotations

import os
import warnings

import pytest

from memra.errors import MemraError
from memra.pp import fence as F
from memra.pp.fence import BoundaryTransport, DualPpMode, PipelineError, PpDoors, PpDoorWarning, StageFence

DOORS = [
    "MEMRA_PP_STAGES", "MEMRA_PP_SPLITS", "MEMRA_PP_SPLIT", "MEMRA_PP_DEVICES", "MEMRA_PP_SHARD",
    "MEMRA_PP_STREAMS", "MEMRA_PP_OVERLAP", "MEMRA_PP_HOST_BOUNCE", "MEMRA_PEER_PROBE", "MEMRA_BATCH_PP",
    "MEMRA_PRIME_PP", "MEMRA_PRIME_PIPE", "MEMRA_SPEC_PP", "MEMRA_DUAL_PP", "MEMRA_PP_ALLOW_UNSPLIT_BATCH",
    "MEMRA_DUAL_PP_TIMING",
]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for d in DOORS:
        monkeypatch.delenv(d, raising=False)
    F.reset_warnings()
    yield
    F.reset_warnings()


def setenv(monkeypatch, **kv):
    for k, v in kv.items():
        monkeypatch.setenv(k, v)


def no_warning(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("error", PpDoorWarning)
        return fn(*args, **kwargs)


# ---- the fence --------------------------------------------------------------------------------


@pytest.mark.parametrize("raw", [None, "", "0", "1"])
def test_stages_unset_zero_one_is_off_silently(monkeypatch, raw):
    if raw is not None:
        monkeypatch.setenv("MEMRA_PP_STAGES", raw)
    monkeypatch.setenv("MEMRA_PP_SPLIT", "3")  # ignored while the door is off
    assert no_warning(F.pp_fence, 8) is None
    assert F.pp_cuts(8) is None and F.pp2_split(8) is None


@pytest.mark.parametrize("raw", ["two", " 2", "2 ", "-2", "2.0", "0x2", "٢"])
def test_stages_unparseable_warns_once_and_stays_off(monkeypatch, raw):
    monkeypatch.setenv("MEMRA_PP_STAGES", raw)
    with pytest.warns(PpDoorWarning, match="MEMRA_PP_STAGES"):
        assert F.pp_fence(8) is None
    assert no_warning(F.pp_fence, 8) is None  # same (door, value): silent the second time


def test_stages_out_of_range_warns_and_stays_off(monkeypatch):
    monkeypatch.setenv("MEMRA_PP_STAGES", "5")
    with pytest.warns(PpDoorWarning, match=r"outside 2\.\.4"):
        assert F.pp_fence(4) is None
    monkeypatch.setenv("MEMRA_PP_STAGES", "4")  # N == n_layers: one layer per stage is legal
    assert no_warning(F.pp_fence, 4).ranges == ((0, 1), (1, 2), (2, 3), (3, 4))


def test_a_new_bad_value_warns_again(monkeypatch):
    monkeypatch.setenv("MEMRA_PP_STAGES", "x")
    with pytest.warns(PpDoorWarning):
        F.pp_fence(8)
    monkeypatch.setenv("MEMRA_PP_STAGES", "y")
    with pytest.warns(PpDoorWarning, match="'y'"):
        F.pp_fence(8)


@pytest.mark.parametrize("n, cuts", [(2, (5,)), (3, (3, 6)), (4, (2, 5, 7))])
def test_even_default_split(monkeypatch, n, cuts):
    monkeypatch.setenv("MEMRA_PP_STAGES", str(n))
    fence = no_warning(F.pp_fence, 10)
    assert fence.cuts == cuts and fence.n_stages == n
    assert F.pp_cuts(10) == (0, *cuts, 10)
    assert F.pp2_split(10) == (cuts[0] if n == 2 else None)


def test_split_is_the_two_stage_spelling(monkeypatch):
    setenv(monkeypatch, MEMRA_PP_STAGES="2", MEMRA_PP_SPLIT="3")
    assert F.pp_fence(8).ranges == ((0, 3), (3, 8))
    assert F.pp2_split(8) == 3


def test_split_with_more_than_two_stages_is_ambiguous_and_stays_off(monkeypatch):
    setenv(monkeypatch, MEMRA_PP_STAGES="3", MEMRA_PP_SPLIT="3")
    with pytest.warns(PpDoorWarning, match="MEMRA_PP_SPLITS"):
        assert F.pp_fence(9) is None


@pytest.mark.parametrize("raw, why", [("x", "not a layer index"), ("0", "strictly increasing"),
                                      ("8", "strictly increasing"), ("9", "strictly increasing")])
def test_bad_split_stays_off(monkeypatch, raw, why):
    setenv(monkeypatch, MEMRA_PP_STAGES="2", MEMRA_PP_SPLIT=raw)
    with pytest.warns(PpDoorWarning, match=why):
        assert F.pp_fence(8) is None


def test_splits_win_over_split_and_are_trimmed(monkeypatch):
    setenv(monkeypatch, MEMRA_PP_STAGES="3", MEMRA_PP_SPLITS=" 2, 5", MEMRA_PP_SPLIT="4")
    assert no_warning(F.pp_fence, 8).bounds == (0, 2, 5, 8)


@pytest.mark.parametrize("raw", ["", "3", "2,5,6", "2,,5", "2;5", "5,5", "5,3", "0,4", "4,8"])
def test_bad_splits_stay_off(monkeypatch, raw):
    setenv(monkeypatch, MEMRA_PP_STAGES="3", MEMRA_PP_SPLITS=raw)
    with pytest.warns(PpDoorWarning):
        assert F.pp_fence(8) is None


def test_fence_isolating_one_layer(monkeypatch):
    setenv(monkeypatch, MEMRA_PP_STAGES="3", MEMRA_PP_SPLITS="3,4")
    fence = F.pp_fence(8)
    assert fence.ranges == ((0, 3), (3, 4), (4, 8))
    assert [F.stage_of(fence, i) for i in range(8)] == [0, 0, 0, 1, 2, 2, 2, 2]


@pytest.mark.parametrize("cuts", [(4,), (1, 7), (2, 3, 6), (1, 2, 3)])
def test_stage_of_matches_ranges_and_mtp_goes_last(cuts):
    fence = StageFence(8, cuts)
    for s, (a, b) in enumerate(fence.ranges):
        assert all(fence.stage_of(i) == s for i in range(a, b))
    last = fence.n_stages - 1
    assert fence.stage_of(8) == fence.stage_of(9) == last  # MTP layers sit after the trunk
    assert (fence.embed_stage, fence.head_stage) == (0, last)
    with pytest.raises(ValueError):
        fence.stage_of(-1)


@pytest.mark.parametrize("n_layers, cuts", [(8, (0,)), (8, (8,)), (8, (3, 3)), (8, (5, 2)), (0, ())])
def test_stage_fence_rejects_empty_stages(n_layers, cuts):
    with pytest.raises(PipelineError):
        StageFence(n_layers, cuts)
    assert issubclass(PipelineError, MemraError)


# ---- switches ---------------------------------------------------------------------------------

SWITCHES = [  # (door, function, value when unset/invalid)
    ("MEMRA_PP_STREAMS", lambda: not F.pp_streams_off(), True),
    ("MEMRA_PP_SHARD", lambda: not F.pp_shard_off(), True),
    ("MEMRA_PEER_PROBE", F.peer_probe_on, True),
    ("MEMRA_BATCH_PP", F.batch_pp_on, True),
    ("MEMRA_PRIME_PP", F.prime_pp_on, True),
    ("MEMRA_PRIME_PIPE", F.prime_pipe_on, True),
    ("MEMRA_SPEC_PP", F.spec_pp_on, True),
    ("MEMRA_PP_HOST_BOUNCE", F.pp_host_bounce_on, False),
    ("MEMRA_PP_ALLOW_UNSPLIT_BATCH", F.allow_unsplit_batch, False),
    ("MEMRA_DUAL_PP_TIMING", F.dual_pp_timing_on, False),
]


@pytest.mark.parametrize("door, read, default", SWITCHES)
def test_switch_table(monkeypatch, door, read, default):
    assert no_warning(read) is default
    for raw, want in [("0", False), ("1", True), ("", default)]:
        monkeypatch.setenv(door, raw)
        assert no_warning(read) is want, (door, raw)
    monkeypatch.setenv(door, "true")  # looks meaningful, is not: keep the default, say so once
    with pytest.warns(PpDoorWarning, match=door):
        assert read() is default
    assert no_warning(read) is default


def test_dual_pp_mode_resolution():
    assert F.dual_pp_mode_resolve(None) is DualPpMode.AUTO
    assert F.dual_pp_mode_resolve("0") is DualPpMode.OFF
    assert F.dual_pp_mode_resolve("1") is DualPpMode.FORCED
    assert F.dual_pp_mode_resolve("2") is DualPpMode.AUTO
    assert F.dual_pp_mode_resolve("") is DualPpMode.AUTO


def test_dual_pp_mode_from_env(monkeypatch):
    assert F.dual_pp_mode() is DualPpMode.AUTO and F.dual_pp_on()
    monkeypatch.setenv("MEMRA_DUAL_PP", "0")
    assert F.dual_pp_mode() is DualPpMode.OFF and not F.dual_pp_on()
    monkeypatch.setenv("MEMRA_DUAL_PP", "2")
    with pytest.warns(PpDoorWarning, match="MEMRA_DUAL_PP"):
        assert F.dual_pp_mode() is DualPpMode.AUTO


def test_overlap_follows_mode_and_explicit_values_win():
    assert F.pp_overlap_resolve(None, DualPpMode.AUTO)
    assert not F.pp_overlap_resolve(None, DualPpMode.OFF)  # DUAL_PP=0 alone restores the serial path
    assert not F.pp_overlap_resolve(None, DualPpMode.FORCED)  # keeps the single-slot refusal reachable
    for mode in DualPpMode:
        assert F.pp_overlap_resolve("1", mode)
        assert not F.pp_overlap_resolve("0", mode)
        assert not F.pp_overlap_resolve("", mode)


def test_overlap_from_env(monkeypatch):
    assert F.pp_overlap()
    monkeypatch.setenv("MEMRA_DUAL_PP", "0")
    assert not F.pp_overlap()
    monkeypatch.setenv("MEMRA_PP_OVERLAP", "1")
    assert F.pp_overlap()
    monkeypatch.setenv("MEMRA_PP_OVERLAP", "yes")
    with pytest.warns(PpDoorWarning, match="MEMRA_PP_OVERLAP"):
        assert not F.pp_overlap()


# ---- dual waves -------------------------------------------------------------------------------


def test_dual_route_auto_only_in_the_validated_regime():
    A, Fo, O = DualPpMode.AUTO, DualPpMode.FORCED, DualPpMode.OFF
    assert F.dual_pp_route(A, 2, 2, True, False) and F.dual_pp_route(A, 17, 2, True, False)
    assert not F.dual_pp_route(A, 1, 2, True, False)  # one row: no second wave
    assert not F.dual_pp_route(A, 2, 3, True, False)  # PP-3 keeps serving serially
    assert not F.dual_pp_route(A, 2, 2, False, False)  # single-slot boundary
    assert not F.dual_pp_route(A, 2, 2, True, True)  # host bounce
    assert F.dual_pp_route(Fo, 2, 3, False, True)  # forced: let the refusals fire
    assert not F.dual_pp_route(Fo, 1, 2, True, False)
    assert not F.dual_pp_route(O, 8, 2, True, False)


def test_dual_wave_mid_is_ceil_first():
    assert [F.dual_pp_wave_mid(b) for b in (0, 1, 2, 3, 8, 16, 31, 32)] == [None, None, 1, 2, 4, 8, 16, 16]


def test_dual_eligibility_refusals_in_order():
    assert F.dual_pp_eligibility(2, True, False) is None
    assert F.dual_pp_eligibility(3, False, True) == F.DUAL_PP_TWO_STAGES_REFUSAL
    assert F.dual_pp_eligibility(2, False, True) == F.DUAL_PP_SINGLE_SLOT_REFUSAL
    assert F.dual_pp_eligibility(2, True, True) == F.DUAL_PP_HOST_BOUNCE_REFUSAL
    assert "MEMRA_PP_OVERLAP=1" in F.DUAL_PP_SINGLE_SLOT_REFUSAL
    assert "MEMRA_PP_HOST_BOUNCE=1" in F.DUAL_PP_HOST_BOUNCE_REFUSAL


def test_boundary_slots():
    assert [F.boundary_slot(s, True) for s in range(5)] == [0, 1, 0, 1, 0]
    assert [F.boundary_slot(s, False) for s in range(3)] == [0, 0, 0]
    assert F.dual_pp_slot_pair_ok(0, 1) and not F.dual_pp_slot_pair_ok(1, 1)


# ---- placement --------------------------------------------------------------------------------


@pytest.mark.parametrize("env, want", [
    ({}, False),
    ({"MEMRA_PP_STAGES": "2"}, True),  # door open, no placement: all stage streams on the primary
    ({"MEMRA_PP_STAGES": "2", "MEMRA_PP_DEVICES": "0,1"}, False),
    ({"MEMRA_PP_STAGES": "3", "MEMRA_PP_DEVICES": "0, 1,0"}, True),
    ({"MEMRA_PP_DEVICES": "1,1"}, True),  # a placement alone is enough to count
    ({"MEMRA_PP_STAGES": "2", "MEMRA_PP_STREAMS": "0"}, False),
    ({"MEMRA_PP_STAGES": "x"}, False),
])
def test_multi_stream_same_device(monkeypatch, env, want):
    setenv(monkeypatch, **env)
    assert F.pp_multi_stream_same_device() is want


@pytest.mark.parametrize("env, want", [
    ({"MEMRA_PP_STAGES": "2", "MEMRA_PP_DEVICES": "0,1"}, True),
    ({"MEMRA_PP_STAGES": "2", "MEMRA_PP_DEVICES": "1,01"}, False),
    ({"MEMRA_PP_STAGES": "2"}, False),
    ({"MEMRA_PP_DEVICES": "0,1"}, False),
    ({"MEMRA_PP_STAGES": "2", "MEMRA_PP_DEVICES": "0,1", "MEMRA_PP_SHARD": "0"}, False),
    ({"MEMRA_PP_STAGES": "2", "MEMRA_PP_DEVICES": "0,1", "MEMRA_PP_STREAMS": "0"}, False),
])
def test_sharded_cross_device(monkeypatch, env, want):
    setenv(monkeypatch, **env)
    assert F.pp_sharded_cross_device() is want


def test_host_bounce_active_needs_a_sharded_cross_device_placement(monkeypatch):
    assert not F.pp_host_bounce_active(runtime_latched=True)
    setenv(monkeypatch, MEMRA_PP_STAGES="2", MEMRA_PP_DEVICES="0,1")
    assert not F.pp_host_bounce_active()
    assert F.pp_host_bounce_active(runtime_latched=True)
    monkeypatch.setenv("MEMRA_PP_HOST_BOUNCE", "1")
    assert F.pp_host_bounce_active()


def test_refuse_unsplit_matrix(monkeypatch):
    F.refuse_unsplit_if_remote("decode_step_batch", "MEMRA_BATCH_PP=1", F.UnsplitView.from_env())
    setenv(monkeypatch, MEMRA_PP_STAGES="2", MEMRA_PP_DEVICES="0,1")
    with pytest.raises(PipelineError, match=r"decode_step_batch: refused.*MEMRA_BATCH_PP=1.*MEMRA_PP_SHARD=0"):
        F.refuse_unsplit_if_remote("decode_step_batch", "MEMRA_BATCH_PP=1", F.UnsplitView.from_env())
    monkeypatch.setenv("MEMRA_PP_ALLOW_UNSPLIT_BATCH", "1")
    F.refuse_unsplit_if_remote("decode_step_batch", "MEMRA_BATCH_PP=1", F.UnsplitView.from_env())
    # Under host bounce (selected or latched) the override does not apply.
    with pytest.raises(PipelineError, match="cannot override"):
        F.refuse_unsplit_if_remote("verify", "MEMRA_SPEC_PP=1", F.UnsplitView.from_env(runtime_latched=True))
    monkeypatch.setenv("MEMRA_PP_HOST_BOUNCE", "1")
    with pytest.raises(PipelineError, match="MEMRA_PP_HOST_BOUNCE=1"):
        F.refuse_unsplit_if_remote("verify", "MEMRA_SPEC_PP=1", F.UnsplitView.from_env())
    # Weights all home: nothing remote to read, nothing to refuse.
    monkeypatch.setenv("MEMRA_PP_SHARD", "0")
    monkeypatch.delenv("MEMRA_PP_HOST_BOUNCE")
    monkeypatch.delenv("MEMRA_PP_ALLOW_UNSPLIT_BATCH")
    F.refuse_unsplit_if_remote("decode_step_batch", "MEMRA_BATCH_PP=1", F.UnsplitView.from_env())


def test_boundary_transport_selection():
    assert F.boundary_transport(False, False) is BoundaryTransport.LOCAL
    assert F.boundary_transport(False, True) is BoundaryTransport.LOCAL
    assert F.boundary_transport(True, False) is BoundaryTransport.PEER
    assert F.boundary_transport(True, True) is BoundaryTransport.HOST_BOUNCE


def plan(monkeypatch, primary=0, count=8, **env):
    setenv(monkeypatch, **env)
    return F.plan_placement(PpDoors.from_env(), primary, count)


def test_placement_defaults_to_the_primary(monkeypatch):
    p = plan(monkeypatch, primary=1, MEMRA_PP_STAGES="3")
    assert p.devices == (1, 1, 1) and not p.cross_any and p.boundary_cross == (False, False)
    monkeypatch.delenv("MEMRA_PP_STAGES")
    assert plan(monkeypatch).devices == (0, 0)  # doorless bring-up default: two stages


def test_placement_cross_device(monkeypatch):
    p = plan(monkeypatch, MEMRA_PP_STAGES="4", MEMRA_PP_DEVICES="0,1,1,2")
    assert p.n_stages == 4 and p.cross_any and p.sharded_cross_device and p.used_devices == (0, 1, 2)
    assert p.boundary_cross == (True, False, True)
    assert p.transports() == (BoundaryTransport.PEER, BoundaryTransport.LOCAL, BoundaryTransport.PEER)
    assert p.transports(runtime_latched=True)[0] is BoundaryTransport.HOST_BOUNCE


@pytest.mark.parametrize("devices", ["0", "0,x", "0,1,", "a,b", "0;1"])
def test_bad_device_list_is_a_hard_error(monkeypatch, devices):
    with pytest.raises(PipelineError, match="MEMRA_PP_DEVICES"):
        plan(monkeypatch, MEMRA_PP_DEVICES=devices)


def test_stage_count_disagreement_is_a_hard_error(monkeypatch):
    with pytest.raises(PipelineError, match="ambiguous"):
        plan(monkeypatch, MEMRA_PP_STAGES="3", MEMRA_PP_DEVICES="0,1")


def test_missing_device_is_a_hard_error(monkeypatch):
    with pytest.raises(PipelineError, match="only 2 CUDA"):
        plan(monkeypatch, count=2, MEMRA_PP_STAGES="2", MEMRA_PP_DEVICES="0,3")
    with pytest.raises(PipelineError, match="only 1 CUDA"):  # the primary counts as used
        plan(monkeypatch, primary=0, count=1, MEMRA_PP_DEVICES="1,1")


def test_host_bounce_placement_refusals(monkeypatch):
    with pytest.raises(PipelineError, match="MEMRA_PP_SHARD=0"):
        plan(monkeypatch, MEMRA_PP_DEVICES="0,1", MEMRA_PP_HOST_BOUNCE="1", MEMRA_PP_SHARD="0")
    monkeypatch.delenv("MEMRA_PP_SHARD")
    with pytest.raises(PipelineError, match="last stage"):
        plan(monkeypatch, primary=0, MEMRA_PP_DEVICES="1,0,2")
    p = plan(monkeypatch, primary=0, MEMRA_PP_DEVICES="1,0")
    assert p.host_bounce and p.transports() == (BoundaryTransport.HOST_BOUNCE,)


def test_probe_off_needs_host_bounce_on_sharded_placements(monkeypatch):
    with pytest.raises(PipelineError, match="MEMRA_PEER_PROBE=0"):
        plan(monkeypatch, MEMRA_PP_DEVICES="1,0", MEMRA_PEER_PROBE="0")
    assert plan(monkeypatch, MEMRA_PP_HOST_BOUNCE="1").probe_bypassed
    monkeypatch.delenv("MEMRA_PP_HOST_BOUNCE")
    monkeypatch.setenv("MEMRA_PP_SHARD", "0")  # weights home: the probe may be skipped without bounce
    assert not plan(monkeypatch).probe_bypassed


def test_peer_capability(monkeypatch):
    p = plan(monkeypatch, MEMRA_PP_DEVICES="0,1")
    assert F.peer_capable_pairs(p, lambda a, b: True) == ((0, 1), (1, 0))
    with pytest.raises(PipelineError, match="cuda:1 cannot peer-access cuda:0"):
        F.peer_capable_pairs(p, lambda a, b: a == 0)
    p = plan(monkeypatch, MEMRA_PP_DEVICES="1,0", MEMRA_PP_HOST_BOUNCE="1")
    assert F.peer_capable_pairs(p, lambda a, b: a == 0) == ((0, 1),)  # bounce: record what works
    p = plan(monkeypatch, MEMRA_PEER_PROBE="0")

    def never(a, b):
        raise AssertionError("not queried: host bounce without the probe needs no peer")

    assert F.peer_capable_pairs(p, never) == ()


def test_unwired_notice_once(monkeypatch):
    assert not F.warn_unwired_once("decode_step_dc")
    monkeypatch.setenv("MEMRA_PP_STAGES", "2")
    with pytest.warns(PpDoorWarning, match="decode_step_dc"):
        assert F.warn_unwired_once("decode_step_dc")
    assert not no_warning(F.warn_unwired_once, "decode_step_dc")


# ---- the snapshot -----------------------------------------------------------------------------


def test_doors_snapshot_defaults(monkeypatch):
    d = no_warning(PpDoors.from_env)
    assert (d.stages, d.devices, d.dual_pp) == (None, None, DualPpMode.AUTO)
    assert d.shard and d.streams and d.peer_probe and d.batch_pp and d.prime_pp and d.prime_pipe and d.spec_pp
    assert not (d.host_bounce or d.allow_unsplit_batch or d.dual_pp_timing)
    assert d.overlap and d.fence(8) is None
    line = d.summary()
    assert "\n" not in line and line.startswith("pp: stages=off") and "dual=auto" in line


def test_doors_snapshot_reads_every_door(monkeypatch):
    setenv(monkeypatch, MEMRA_PP_STAGES="3", MEMRA_PP_SPLITS="1,2", MEMRA_PP_DEVICES="0,1,2",
           MEMRA_PP_SHARD="0", MEMRA_PP_STREAMS="0", MEMRA_PP_OVERLAP="0", MEMRA_DUAL_PP="1",
           MEMRA_PP_HOST_BOUNCE="1", MEMRA_PEER_PROBE="0", MEMRA_BATCH_PP="0", MEMRA_PRIME_PP="0",
           MEMRA_PRIME_PIPE="0", MEMRA_SPEC_PP="0", MEMRA_PP_ALLOW_UNSPLIT_BATCH="1", MEMRA_DUAL_PP_TIMING="1")
    d = PpDoors.from_env()
    assert d.fence(4).bounds == (0, 1, 2, 4) and d.devices == "0,1,2" and d.dual_pp is DualPpMode.FORCED
    assert not (d.shard or d.streams or d.overlap or d.peer_probe or d.batch_pp or d.prime_pp
                or d.prime_pipe or d.spec_pp)
    assert d.host_bounce and d.allow_unsplit_batch and d.dual_pp_timing
    line = d.summary()
    for part in ("stages=3", "splits=1,2", "devices=0,1,2", "shard=off", "dual=forced", "host_bounce=on",
                 "peer_probe=off", "timing=on"):
        assert part in line


def test_explicit_env_mapping_is_used_instead_of_os_environ(monkeypatch):
    monkeypatch.setenv("MEMRA_PP_STAGES", "2")
    assert F.pp_fence(8, env={}) is None
    assert F.pp_fence(8, env={"MEMRA_PP_STAGES": "4"}).n_stages == 4
    assert PpDoors.from_env({"MEMRA_BATCH_PP": "0"}).batch_pp is False
    assert os.environ["MEMRA_PP_STAGES"] == "2"
