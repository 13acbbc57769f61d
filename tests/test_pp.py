"""Pipeline parallelism in one process: the split walks are bit-identical to the unsplit ones.

The pp battery (memra.gate.pp_battery) runs on every fixture architecture with 2, 3 and 4 stages,
even and explicit fences (including ones that isolate a single layer), dual waves Auto / Forced /
Off, and the host-bounce transport; refusals leave every cache position unmoved; the peer probe
catches every corrupted copy. Stages run on CPU threads here (and CUDA streams on a GPU).
"""

from __future__ import annotations

import pytest
import torch

from conftest import HF_ARCHS, hf_dir
from memra import counters
from memra.decode_plan import decode_plan
from memra.gate.pp_battery import run_pp_battery
from memra.pp import fence as pf
from memra.pp import probe, probe_policy
from memra.pp.walk import active_runtime

FAST = dict(batches=(1, 3), steps=3, reps=1, plen=6)


def battery(model, stages: int, **doors) -> tuple[bool, list[str]]:
    lines: list[str] = []
    ok = run_pp_battery(model.with_doors(**doors), stages=stages, out=lines.append, **FAST)
    return ok, lines


@pytest.mark.parametrize("arch", HF_ARCHS)
def test_pp2_gate_all_green_on_every_architecture(arch, load_model):
    ok, lines = battery(load_model(hf_dir(arch)), 2)
    assert ok, "\n".join(lines)
    assert lines[-1].startswith("ALL GREEN")
    assert any(line.startswith("dual pp negative PASS") for line in lines)


@pytest.mark.parametrize("arch,stages,splits", [
    ("qwen3", 3, None),  # 3 layers: every stage one layer
    ("qwen3_moe", 3, None),
    ("qwen3_5", 3, "1,5"),  # a first stage holding only layer 0
    ("qwen3_next", 4, None),  # even fence over 6 layers
    ("qwen3_5_moe", 4, "2,3,5"),  # stage 1 isolates layer 2
])
def test_pp_gate_three_and_four_stages(arch, stages, splits, load_model):
    ok, lines = battery(load_model(hf_dir(arch)), stages, MEMRA_PP_SPLITS=splits)
    assert ok, "\n".join(lines)
    if splits:
        assert f"fence=[0, {splits.replace(',', ', ')}, 6]" in lines[0]


@pytest.mark.parametrize("mode", ["0", "1", "auto"])
def test_dual_modes(mode, load_model):
    """Off: serial split. Auto: waves only over a peer boundary, so serial on one device. Forced:
    two waves in flight on the stage threads, overlap counted, same bits. (Forced does not turn on
    the double-slot boundary by itself: its single-slot refusal must stay reachable, so that run
    asks for MEMRA_PP_OVERLAP=1 explicitly, as the seed's gate does.)"""
    model = load_model(hf_dir("qwen3_5"))
    before = counters.snapshot()
    ok, lines = battery(model, 2, MEMRA_DUAL_PP=None if mode == "auto" else mode,
                        MEMRA_PP_OVERLAP="1" if mode == "1" else None)
    assert ok, "\n".join(lines)
    overlaps = counters.delta(before)["dual_pp_overlaps"]
    assert (overlaps > 0) if mode == "1" else (overlaps == 0)
    timed = counters.delta(before)["dual_pp_stage_samples_wave_b_stage1"]
    assert timed == 0  # MEMRA_DUAL_PP_TIMING off: no samples
    assert any("DUAL_PP_OVERLAPS" in line for line in lines) == (mode == "1")


def test_host_bounce_transport_is_exact(load_model):
    """Host bounce only replaces cross-device boundaries; to run its code path on one device the
    boundary is switched to it explicitly (the runtime probe's latch does the same)."""
    model = load_model(hf_dir("qwen3_next")).with_doors(MEMRA_PP_STAGES="2", MEMRA_DUAL_PP="0")
    rt = active_runtime(model)
    rt.set_transport(0, pf.BoundaryTransport.HOST_BOUNCE)
    ok, lines = battery(model, 2, MEMRA_DUAL_PP="0")  # the same view: the battery's split arm is this runtime
    rt.set_transport(0, pf.BoundaryTransport.LOCAL)
    assert ok, "\n".join(lines)
    assert "transports=host_bounce" in lines[0]


def test_canary_fails_the_pp_gate(load_model):
    ok, lines = battery(load_model(hf_dir("llama")), 2, MEMRA_GATE_CANARY="1")
    assert not ok
    assert any(line.startswith("arm1") and line.endswith("FAIL") for line in lines)


def test_unsplit_arm_refusal_and_bad_placements(load_model):
    base = load_model(hf_dir("llama"))
    with pytest.raises(pf.PipelineError, match="names CUDA devices"):  # the placement is checked at load
        base.with_doors(MEMRA_PP_STAGES="2", MEMRA_PP_DEVICES="0,1")
    model = base.with_doors(MEMRA_PP_STAGES="2", MEMRA_DECODE_PLAN="bucket", MEMRA_PRIME_PP="1")
    c = model.new_cache(16)
    model.prime([1, 2, 3], c)
    with pytest.raises(Exception, match="no stage split"):
        model.decode_step_batch([4], [c])
    assert c.pos == 3


def test_prime_pipeline_matches_serial_and_unsplit(load_model):
    base = load_model(hf_dir("qwen3_5"))
    prompt = [(7 * i) % base.cfg.vocab_size for i in range(150)]  # three 64-token pieces
    results = {}
    for name, doors in {"unsplit": dict(MEMRA_PP_STAGES=None), "serial": dict(MEMRA_PP_STAGES="2", MEMRA_PRIME_PIPE="0"),
                        "pipe": dict(MEMRA_PP_STAGES="2")}.items():
        model = base.with_doors(**doors)
        decode_plan(model)  # its on-model check (an fp32 model's rows stack on CPU) primes sequences of its own
        before = counters.snapshot()
        c = active_runtime(model).new_cache(256) if doors["MEMRA_PP_STAGES"] else model.new_cache(256)
        logits = model.prime(prompt, c, all_logits=True)
        nxt = model.decode_step(3, c)
        results[name] = (logits, nxt, counters.delta(before))
    for name in ("serial", "pipe"):
        assert torch.equal(results[name][0], results["unsplit"][0]), name
        assert torch.equal(results[name][1], results["unsplit"][1]), name
        assert results[name][2]["prime_split_chunks"] == 3
    assert results["pipe"][2]["prime_pipe_overlaps"] > 0
    assert results["serial"][2]["prime_pipe_overlaps"] == 0


class Corrupting:
    """A transport that flips one byte of every payload it delivers, at a varying position."""

    def __init__(self, inner, seed: int = 0):
        self.inner, self.kind, self.n = inner, inner.kind, seed

    def send(self, payload, slot):
        self.inner.send(payload, slot)

    def receive(self, slot, n):
        got = self.inner.receive(slot, n)
        self.n += 1
        i = (self.n * 7919) % n
        got[i] ^= 0x10
        return got


def test_probe_catches_every_corrupted_copy(load_model):
    rt = active_runtime(load_model(hf_dir("qwen3")).with_doors(MEMRA_PP_STAGES="2"))
    assert probe.probe_boundary(rt, 0).verdict is probe_policy.ProbeVerdict.CLEAN
    clean = rt.boundaries[0].transport
    try:
        for trial in range(20):
            rt.boundaries[0].transport = Corrupting(clean, seed=trial)
            decision = probe.probe_boundary(rt, 0)
            assert decision.verdict is probe_policy.ProbeVerdict.REFUSE_NATIVE_PEER, trial
            assert decision.mismatches >= 6  # both fixed-pattern directions and all four ladder rungs
        rt.set_transport(0, pf.BoundaryTransport.HOST_BOUNCE)
        rt.boundaries[0].transport = Corrupting(rt.boundaries[0].transport)
        assert probe.probe_boundary(rt, 0).verdict is probe_policy.ProbeVerdict.PROCEED_WITH_HOST_BOUNCE
    finally:
        rt.set_transport(0, pf.BoundaryTransport.LOCAL)


def test_runtime_reprobe_latches_to_validated_host_bounce(load_model):
    """A peer boundary that starts corrupting mid-run: the due re-probe catches it and the boundary
    moves to host bounce for good; decoding then continues bit-identical to the unsplit model."""
    base = load_model(hf_dir("qwen3"))
    model = base.with_doors(MEMRA_PP_STAGES="2", MEMRA_DUAL_PP="0")
    rt = active_runtime(model)
    rt.set_transport(0, pf.BoundaryTransport.PEER)
    rt.boundaries[0].transport = Corrupting(rt.boundaries[0].transport)
    rt.reprobe = probe_policy.ReprobeState(next_probe_copy=(0, 1 << 40, 1 << 40, 1 << 40))  # rung 0 due now
    status = probe.service_runtime_probe(rt, scheduler_idle=False)
    assert status is probe_policy.RuntimeProbeStatus.DEGRADED_TO_HOST_BOUNCE
    assert rt.latch.native_failed and rt.latch.host_bounce
    assert rt.boundaries[0].transport.kind is pf.BoundaryTransport.HOST_BOUNCE
    c = rt.new_cache(32)
    model.prime([5, 6, 7], c)
    split = model.decode_step(8, c)
    rt.set_transport(0, pf.BoundaryTransport.LOCAL)
    rt.latch = probe_policy.TransportLatch()
    ref_c = base.new_cache(32)
    base.prime([5, 6, 7], ref_c)
    assert torch.equal(split, base.decode_step(8, ref_c))


def test_deferred_readback_and_stage_owned_caches(load_model):
    model = load_model(hf_dir("qwen3_next")).with_doors(MEMRA_PP_STAGES="3")
    rt = active_runtime(model)
    c = rt.new_cache(32)
    layer_dev = rt.layer_devices()
    assert set(layer_dev) == set(range(model.cfg.n_layers + model.cfg.n_mtp))
    model.prime([1, 2, 3, 4], c)
    logits = model.decode_step(5, c)
    assert torch.equal(rt.defer(logits.clone()).wait(), logits.cpu())


def test_dual_pp_timing_records_every_wave_stage(load_model):
    model = load_model(hf_dir("qwen3")).with_doors(MEMRA_PP_STAGES="2", MEMRA_DUAL_PP="1", MEMRA_PP_OVERLAP="1",
                                                    MEMRA_DUAL_PP_TIMING="1")
    caches = [active_runtime(model).new_cache(16) for _ in range(3)]
    for i, c in enumerate(caches):
        model.prime([1, 2 + i], c)
    before = counters.snapshot()
    model.decode_step_batch([3, 4, 5], caches)
    d = counters.delta(before)
    for name in ("wave_a_stage0", "wave_b_stage0", "wave_a_stage1", "wave_b_stage1"):
        assert d[f"dual_pp_stage_samples_{name}"] == 1 and d[f"dual_pp_stage_ns_{name}"] > 0


def test_streams_off_keeps_every_stage_home():
    """MEMRA_PP_STREAMS=0 is the single-stream rollback: weights and caches stay on the primary
    (fence.pp_sharded_cross_device), so every stage must run there too, whatever MEMRA_PP_DEVICES
    says; with streams on each stage takes its placement's device. (torch.device objects need no GPU.)"""
    from memra.pp.runtime import stage_devices

    cuda0, cuda1 = torch.device("cuda", 0), torch.device("cuda", 1)
    assert stage_devices(cuda0, (0, 1), streams=True) == [cuda0, cuda1]
    assert stage_devices(cuda0, (1, 0), streams=True) == [cuda1, cuda0]
    assert stage_devices(cuda0, (0, 1), streams=False) == [cuda0, cuda0]
    assert stage_devices(cuda1, (0, 1, 2, 3), streams=False) == [cuda1] * 4
    assert stage_devices(torch.device("cpu"), (0, 1), streams=True) == [torch.device("cpu")] * 2
    assert not pf.pp_sharded_cross_device({"MEMRA_PP_STAGES": "2", "MEMRA_PP_DEVICES": "0,1", "MEMRA_PP_STREAMS": "0"})
    assert pf.pp_sharded_cross_device({"MEMRA_PP_STAGES": "2", "MEMRA_PP_DEVICES": "0,1"})
