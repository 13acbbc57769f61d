"""The peer byte-integrity probe, on real tensors (its policy lives in memra.pp.probe_policy).

At bring-up every cross-device boundary carries a fixed 16 KiB pattern both ways through its
transport, then the production-slot ladder (1, 8, 16 and PRIME_CHUNK_MAX_TOKENS rows of the hidden
width) through the boundary's real slots and its real tx/rx path. Any mismatched byte refuses native
peer transport, or is reported and passed over when host bounce already carries the traffic.
While serving, `service_runtime_probe` re-runs one rung on the copy-count schedule and, on a
failure, latches the boundary to a validated host bounce for the rest of the process.
"""

from __future__ import annotations

import sys
import time

import numpy as np
import torch

from memra import counters
from memra.pp import probe_policy as policy
from memra.pp.fence import BoundaryTransport, PipelineError
from memra.pp.runtime import BoundarySlot, PpRuntime


def _as_tensor(data: bytes, device) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy()).to(device)


def _one_way(transport, data: bytes, src: torch.device, dst: torch.device, capacity: int) -> bytes:
    """Copy `data` from src to dst through a scratch slot of this transport kind; return what arrived."""
    slot = BoundarySlot()
    slot.buf = torch.zeros(len(data), dtype=torch.uint8, device=dst)
    if transport.kind is BoundaryTransport.HOST_BOUNCE:
        slot.host = torch.empty(max(capacity, len(data)), dtype=torch.uint8, pin_memory=src.type == "cuda")
    transport.send(_as_tensor(data, src), slot)
    if src.type == "cuda":
        torch.cuda.synchronize(src)
    got = transport.receive(slot, len(data))
    return got.cpu().numpy().tobytes()


@torch.inference_mode()
def probe_boundary(rt: PpRuntime, b: int) -> policy.ProbeDecision:
    """The bring-up probe of boundary b: the fixed pattern both ways, then the ladder through the
    production slots, each pass logged with its status (PASS / BOUNCE). Returns the decision (the
    caller refuses on REFUSE_NATIVE_PEER)."""
    bd = rt.boundaries[b]
    src, dst = rt.stages[b].device, rt.stages[b + 1].device
    host_bounce = bd.transport.kind is BoundaryTransport.HOST_BOUNCE
    started, fixed = time.perf_counter(), 0
    for (a, z) in ((src, dst), (dst, src)):
        pattern = policy.peer_probe_pattern(policy.PEER_PROBE_FIXED_BYTES, b, a.index or 0, z.index or 0)
        fixed += policy.mismatch_count(pattern, _one_way(bd.transport, pattern, a, z, rt.host_capacity))
    _log(probe_line("peer byte-integrity probe", b, src, dst, copies=2, mismatches=fixed,
                    detail=f"bytes={policy.PEER_PROBE_FIXED_BYTES}", started=started))
    started = time.perf_counter()
    rungs = policy.ladder(rt.model.cfg.stream_width, _row_bytes(rt) // rt.model.cfg.stream_width)
    ladder = run_ladder(rt, b, widths=None)
    _log(probe_line("production-slot probe", b, src, dst, copies=len(rungs), mismatches=ladder,
                    detail=f"widths_tokens={[r.tokens for r in rungs]}", started=started))
    counters.bump("pp_peer_probes")
    return policy.decide(fixed + ladder, host_bounce)


def probe_line(what: str, b: int, src, dst, copies: int, mismatches: int, detail: str, started: float) -> str:
    """One probe pass as the boot log reports it: `[pp] <what> PASS|BOUNCE: boundary=.. ...`."""
    status = policy.probe_pass_status(copies, 0, mismatches)
    return (f"[pp] {what} {status}: boundary={b} {src}->{dst} {detail} copies={copies} mismatches={mismatches} "
            f"elapsed_ms={(time.perf_counter() - started) * 1e3:.3f}")


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _row_bytes(rt: PpRuntime) -> int:
    return rt.model.cfg.stream_width * torch.empty((), dtype=rt.model.dtype).element_size()


@torch.inference_mode()
def run_ladder(rt: PpRuntime, b: int, widths: tuple[int, ...] | None) -> int:
    """Send ladder rungs through boundary b's production slots (real tx/rx); count mismatched bytes."""
    src, dst = rt.stages[b], rt.stages[b + 1]
    mismatches = 0
    for rung in policy.ladder(rt.model.cfg.stream_width, _row_bytes(rt) // rt.model.cfg.stream_width):
        if widths is not None and rung.width_index not in widths:
            continue
        pattern = policy.peer_probe_pattern(rung.n_bytes, b, src.device.index or 0, dst.device.index or 0)
        with src.scope():
            rt.tx_slot(b, _as_tensor(pattern, src.device), rung.slot)
        with dst.scope():
            got = rt.rx(b, rung.slot)
        if dst.stream is not None:
            dst.stream.synchronize()
        mismatches += policy.mismatch_count(pattern, got.cpu().numpy().tobytes())
    return mismatches


@torch.inference_mode()
def bring_up(rt: PpRuntime) -> None:
    """Probe every cross-device boundary (the seed's startup policy decides whether it may be skipped)."""
    cross = [bd.index for bd in rt.boundaries if bd.cross]
    if not cross:
        return
    if not rt.doors.peer_probe:  # accepted by plan_placement only with host bounce selected
        counters.bump("pp_peer_probe_bypassed")
        _log("[pp] SECURITY RED: peer probe bypassed (MEMRA_PEER_PROBE=0 on a cross-device placement); "
             "host bounce is the only transport")
        return
    for b in cross:
        decision = probe_boundary(rt, b)
        if decision.verdict is policy.ProbeVerdict.REFUSE_NATIVE_PEER:
            raise PipelineError(f"PP start refused: the peer byte-integrity probe of boundary {b} "
                                f"({rt.stages[b].device} -> {rt.stages[b + 1].device}) found {decision.message}; "
                                "set MEMRA_PP_HOST_BOUNCE=1 to stage boundaries through host memory")


@torch.inference_mode()
def service_runtime_probe(rt: PpRuntime, scheduler_idle: bool, probe_allowed: bool = True) -> policy.RuntimeProbeStatus:
    """At a scheduling boundary: run the due re-probe rung (if any) on every native peer boundary.
    A failure latches those boundaries to host bounce once that path has been armed and checked."""
    peer = [bd for bd in rt.boundaries if bd.transport.kind is BoundaryTransport.PEER]
    gate = policy.reprobe_gate(rt.doors.peer_probe, bool(peer), policy.host_bounce_active(False, rt.latch),
                               rt.latch.native_failed, geometry_ready=True)
    if gate is not None:
        return gate
    with rt.probe_lock:
        state, ticket = policy.schedule_reprobe(rt.reprobe, counters.snapshot()["pp_peer_boundary_copies"],
                                                scheduler_idle, probe_allowed)
        rt.reprobe = state
        if isinstance(ticket, policy.RuntimeProbeStatus):
            if ticket is policy.RuntimeProbeStatus.DEFERRED:
                counters.bump("pp_peer_runtime_probe_deferred")
            return ticket
        t0 = time.perf_counter_ns()
        bad = sum(run_ladder(rt, bd.index, widths=(ticket.width_index,)) for bd in peer)
        rt.reprobe, _ = policy.finish_reprobe(rt.reprobe, ticket, time.perf_counter_ns() - t0, bad == 0)
        counters.bump("pp_peer_runtime_probes")
        if bad == 0:
            rt.reprobe = policy.clear_integrity_degraded(rt.reprobe)
            return policy.RuntimeProbeStatus.PASSED
        counters.bump("pp_peer_runtime_probe_failures")

        def arm_and_validate() -> None:
            for bd in peer:
                old = bd.transport
                rt.set_transport(bd.index, BoundaryTransport.HOST_BOUNCE)
                if run_ladder(rt, bd.index, widths=(0, 1, 2)):
                    bd.transport = old
                    raise PipelineError(f"host-bounce staging of boundary {bd.index} failed its own check")

        rt.latch, err = policy.latch_runtime_host_bounce(rt.latch, arm_and_validate)
        if err is not None:
            raise PipelineError(f"runtime peer probe failed and host bounce could not be armed: {err}") from err
        return policy.RuntimeProbeStatus.DEGRADED_TO_HOST_BOUNCE
