"""The peer byte-integrity probe's policy (memra.pp.probe_policy), with no device."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from memra.cache import PRIME_CHUNK_MAX_TOKENS
from memra.pp import probe_pattern
from memra.pp import probe_policy as P
from memra.pp.fence import PipelineError
from memra.pp.probe_policy import (
    PeerProbeStartupPolicy,
    ProbeVerdict,
    ReprobeState,
    RuntimeProbeStatus,
    TransportLatch,
)

EVERY = P.PEER_RUNTIME_PROBE_INTERVAL_COPIES
BUDGET = P.PEER_RUNTIME_PROBE_BUDGET_NS


# ---- the pattern ------------------------------------------------------------------------------


def xorshift_bytes(n, boundary, src, dst):
    """An independent transcription of the reference generator, for cross-checking."""
    m = (1 << 64) - 1

    def rotl(x, r):
        return ((x << r) | (x >> (64 - r))) & m

    s = 0xD1B54A32D192ED03 ^ rotl(n, 7) ^ rotl(boundary, 19) ^ rotl(src, 31) ^ rotl(dst, 43)
    out = []
    for _ in range(n):
        s = (s ^ (s << 13)) & m
        s ^= s >> 7
        s = (s ^ (s << 17)) & m
        out.append(s & 0xFF)
    return bytes(out)


def test_pattern_is_deterministic_and_matches_the_generator():
    a = P.peer_probe_pattern(P.PEER_PROBE_FIXED_BYTES, 2, 0, 1)
    assert len(a) == 16 * 1024 and a == P.peer_probe_pattern(P.PEER_PROBE_FIXED_BYTES, 2, 0, 1)
    assert a == xorshift_bytes(16 * 1024, 2, 0, 1)
    assert len(set(a)) == 256  # uses the whole byte range, so a stuck bit cannot agree by chance
    assert P.peer_probe_pattern(0, 0, 0, 0) == b""


def test_pattern_differs_per_size_boundary_and_direction():
    base = P.peer_probe_pattern(4096, 0, 0, 1)
    for other in (P.peer_probe_pattern(4096, 1, 0, 1), P.peer_probe_pattern(4096, 0, 1, 0),
                  P.peer_probe_pattern(4097, 0, 0, 1)[:4096]):
        assert P.mismatch_count(base, other) > 3000


@pytest.mark.parametrize("n", [probe_pattern._FAST_MIN_BYTES, probe_pattern._FAST_MIN_BYTES + 1,
                               5 * probe_pattern._LANES + 3])
def test_lane_generator_equals_the_serial_one(n):
    assert P.peer_probe_pattern(n, 1, 2, 3) == xorshift_bytes(n, 1, 2, 3)


def test_pattern_survives_an_f32_view():
    # The runtime uploads the bytes as f32 rows; a view (not a float conversion) keeps NaN payloads.
    a = P.peer_probe_pattern(P.PEER_PROBE_FIXED_BYTES, 2, 0, 1)
    assert torch.frombuffer(bytearray(a), dtype=torch.float32).numpy().tobytes() == a


def test_poison_differs_at_every_byte():
    a = P.peer_probe_pattern(1024, 0, 0, 1)
    assert P.mismatch_count(a, P.poison_of(a)) == 1024


# ---- verdicts ---------------------------------------------------------------------------------


def test_corrupted_readback_refuses_native_unless_host_bounce_is_selected():
    assert P.PEER_PROBE_TOKEN_WIDTHS == (1, 8, 16, PRIME_CHUNK_MAX_TOKENS)
    assert P.PEER_PROBE_TOKEN_WIDTHS[3] * 4096 * 4 == 64 * 1024 * 1024
    expected = P.peer_probe_pattern(P.PEER_PROBE_FIXED_BYTES, 2, 0, 1)
    bad = bytearray(expected)
    for off in (0, 8191, P.PEER_PROBE_FIXED_BYTES - 1):
        bad[off] ^= 0x5A
    bad = bytes(bad)
    assert P.mismatch_count(expected, bad) == 3
    refuse = P.peer_probe_decision(expected, bad, host_bounce=False)
    assert refuse.verdict is ProbeVerdict.REFUSE_NATIVE_PEER and refuse.message == "3 mismatched byte(s)"
    bounce = P.peer_probe_decision(expected, bad, host_bounce=True)
    assert (bounce.verdict, bounce.mismatches) == (ProbeVerdict.PROCEED_WITH_HOST_BOUNCE, 3)
    for hb in (False, True):
        assert P.peer_probe_decision(expected, expected, hb).verdict is ProbeVerdict.CLEAN


def test_short_readback_counts_missing_bytes():
    a = P.peer_probe_pattern(100, 0, 0, 1)
    assert P.mismatch_count(a, a[:90]) == 10
    assert P.mismatch_count(a[:90], a) == 10
    assert P.mismatch_count(a, np.frombuffer(a, dtype=np.uint8).copy()) == 0


def test_unavailable_pair_and_pass_status():
    assert P.unavailable_pair_verdict(True) is ProbeVerdict.PROCEED_WITH_HOST_BOUNCE
    assert P.unavailable_pair_verdict(False) is ProbeVerdict.REFUSE_NATIVE_PEER
    assert P.probe_pass_status(copies=4, skipped=0, mismatches=0) == "PASS"
    assert P.probe_pass_status(copies=4, skipped=1, mismatches=0) == "PARTIAL"
    assert P.probe_pass_status(copies=0, skipped=2, mismatches=0) == "SKIP"
    assert P.probe_pass_status(copies=4, skipped=1, mismatches=5) == "BOUNCE"


def test_probe_off_refusal_matrix_is_fail_closed_only_for_sharded_native_peer():
    for probe_on in (False, True):
        for sharded in (False, True):
            for hb in (False, True):
                if (probe_on, sharded, hb) == (False, True, False):
                    with pytest.raises(PipelineError) as err:
                        P.peer_probe_startup_policy(probe_on, sharded, hb)
                    assert str(err.value) == P.PEER_PROBE_REQUIRED_REFUSAL
                    continue
                bypass = (probe_on, sharded, hb) == (False, True, True)
                want = PeerProbeStartupPolicy.BYPASSED_WITH_HOST_BOUNCE if bypass else PeerProbeStartupPolicy.ALLOWED
                assert P.peer_probe_startup_policy(probe_on, sharded, hb) is want, (probe_on, sharded, hb)
    assert "MEMRA_PEER_PROBE=0" in P.PEER_PROBE_REQUIRED_REFUSAL
    assert "MEMRA_PP_HOST_BOUNCE!=1" in P.PEER_PROBE_REQUIRED_REFUSAL


# ---- geometry ---------------------------------------------------------------------------------


def test_ladder_sizes_rows_from_the_hidden_width():
    rungs = P.ladder(4096)
    assert [r.tokens for r in rungs] == [1, 8, 16, PRIME_CHUNK_MAX_TOKENS]
    assert [r.n_bytes for r in rungs] == [16 << 10, 128 << 10, 256 << 10, 64 << 20]
    assert [r.slot for r in rungs] == [0, 1, 0, 1]  # both boundary slots exercised
    assert P.ladder(1024, elem_bytes=2)[0].n_bytes == 2048
    with pytest.raises(PipelineError):
        P.ladder(1 << 60)


def test_host_bounce_capacity_is_one_max_prime_chunk():
    assert P.host_bounce_capacity(4096) == (4096 * PRIME_CHUNK_MAX_TOKENS, 64 * 1024 * 1024)
    with pytest.raises(PipelineError, match="n_embd"):
        P.host_bounce_capacity(0)
    with pytest.raises(PipelineError, match="overflows"):
        P.host_bounce_capacity((1 << 64) - 1)


# ---- the re-probe schedule --------------------------------------------------------------------


def test_cheap_deadlines_stay_live_while_expensive_work_waits_for_idle():
    assert P.PEER_RUNTIME_PROBE_CYCLE_COPIES == 4 * EVERY
    nxt = (EVERY, 2 * EVERY, 3 * EVERY, 4 * EVERY)
    cost = (1_000_000, 2_000_000, 3_000_000, 0)
    assert P.reprobe_candidate(EVERY - 1, nxt, cost, False) is None
    assert P.reprobe_candidate(EVERY, nxt, cost, False) == (0, 1)
    nxt = (5 * EVERY, 6 * EVERY, 7 * EVERY, 4 * EVERY)  # the cheap three ran; the max rung is due
    assert P.reprobe_candidate(4 * EVERY, nxt, cost, False) is None  # never on a busy boundary
    assert P.reprobe_candidate(5 * EVERY, nxt, cost, False) == (0, 1)  # cheap rung not blocked by it
    assert P.reprobe_candidate(5 * EVERY, nxt, cost, True) == (3, PRIME_CHUNK_MAX_TOKENS)  # idle: oldest


def test_any_rung_measured_over_budget_becomes_idle_only():
    never = (1 << 64) - 1
    nxt = (never, EVERY, never, never)
    cost = (0, BUDGET + 1, 0, 0)
    assert P.reprobe_candidate(EVERY, nxt, cost, False) is None
    assert P.reprobe_candidate(EVERY, nxt, cost, True) == (1, 8)
    assert not P.reprobe_idle_only(1, BUDGET) and P.reprobe_idle_only(1, BUDGET + 1)


def test_equal_deadlines_pick_the_narrowest_width():
    assert P.reprobe_candidate(EVERY, (EVERY,) * 4, (0,) * 4, True) == (0, 1)


def test_late_reprobe_advances_once_instead_of_bursting():
    assert P.reprobe_next_copy(EVERY, EVERY) == EVERY + 4 * EVERY
    assert P.reprobe_next_copy(EVERY, 20 * EVERY) == 21 * EVERY
    assert P.reprobe_next_copy(EVERY, 0) == 5 * EVERY  # early call: one cycle on
    assert P.reprobe_next_copy((1 << 64) - 2, (1 << 64) - 1) == (1 << 64) - 1  # saturates


def test_schedule_defers_without_consuming_the_deadline():
    s = ReprobeState()
    assert s.next_probe_copy == (EVERY, 2 * EVERY, 3 * EVERY, 4 * EVERY)
    assert P.schedule_reprobe(s, EVERY - 1, False, True) == (s, RuntimeProbeStatus.NOT_RUN)
    assert P.schedule_reprobe(s, EVERY, False, False) == (s, RuntimeProbeStatus.DEFERRED)
    s2, ticket = P.schedule_reprobe(s, EVERY, False, True)
    assert (ticket.width_index, ticket.tokens, ticket.probe_index, ticket.label) == (0, 1, 0, "runtime-busy-1tok")
    assert s2.next_probe_copy[0] == 5 * EVERY and s2.probes == 1
    assert ticket.n_bytes(4096 * 4) == 16384
    assert P.schedule_reprobe(s2, EVERY, False, True)[1] is RuntimeProbeStatus.NOT_RUN


def test_finish_records_cost_failures_and_the_budget_crossing():
    s, ticket = P.schedule_reprobe(ReprobeState(), 2 * EVERY, False, True)
    s, crossed = P.finish_reprobe(s, ticket, BUDGET + 1, passed=True)
    assert crossed and s.max_cost_ns[0] == BUDGET + 1 and s.failures == 0
    s, crossed = P.finish_reprobe(s, ticket, BUDGET + 5, passed=True)
    assert not crossed  # already idle-only: say it once
    s, crossed = P.finish_reprobe(s, ticket, 10, passed=False)
    assert not crossed and s.failures == 1 and s.max_cost_ns[0] == BUDGET + 5
    last = P.ReprobeTicket(3, PRIME_CHUNK_MAX_TOKENS, 0, 0, True)
    assert not P.finish_reprobe(ReprobeState(), last, BUDGET + 1, passed=True)[1]  # idle-only anyway


def test_deferral_metric_counts_intervals_and_publishes_the_bound():
    bound = P.PEER_RUNTIME_PROBE_DEFERRAL_BOUND_INTERVALS
    assert bound * EVERY == P.PEER_RUNTIME_PROBE_CYCLE_COPIES
    s = P.record_deferral(ReprobeState(), 1, False)
    assert s.deferred_total == 1 and not s.integrity_degraded
    s = P.record_deferral(s, bound - 1, True)
    assert s.deferred_total == bound and s.integrity_degraded
    assert P.record_deferral(s, 1, False).integrity_degraded  # stays until a probe clears it
    assert not P.clear_integrity_degraded(s).integrity_degraded


def test_reprobe_gate():
    assert P.reprobe_gate(False, True, False, False, True) is RuntimeProbeStatus.NOT_RUN
    assert P.reprobe_gate(True, False, False, False, True) is RuntimeProbeStatus.NOT_RUN
    assert P.reprobe_gate(True, True, True, True, True) is RuntimeProbeStatus.NOT_RUN  # bounce is live
    with pytest.raises(PipelineError, match="latched off"):
        P.reprobe_gate(True, True, False, True, True)
    assert P.reprobe_gate(True, True, False, False, False) is RuntimeProbeStatus.NOT_RUN
    assert P.reprobe_gate(True, True, False, False, True) is None
    assert RuntimeProbeStatus.PASSED.ran and RuntimeProbeStatus.DEGRADED_TO_HOST_BOUNCE.ran
    assert not RuntimeProbeStatus.DEFERRED.ran and not RuntimeProbeStatus.NOT_RUN.ran


# ---- the latch --------------------------------------------------------------------------------


def test_failure_latches_native_off_before_publishing_validated_bounce():
    seen = []

    def arm():
        seen.append("armed")

    latch, err = P.latch_runtime_host_bounce(TransportLatch(), arm)
    assert err is None and seen == ["armed"]
    assert latch == TransportLatch(native_failed=True, host_bounce=True)
    assert P.latch_refusal(latch) is None and P.host_bounce_active(False, latch)

    def broken():
        raise RuntimeError("injected staging mismatch")

    latch, err = P.latch_runtime_host_bounce(TransportLatch(), broken)
    assert str(err) == "injected staging mismatch"
    assert latch == TransportLatch(native_failed=True, host_bounce=False)
    assert "refusing" in P.latch_refusal(latch) and not P.host_bounce_active(False, latch)
    assert P.latch_refusal(TransportLatch()) is None and P.host_bounce_active(True, TransportLatch())


def test_probe_pass_is_logged_with_its_status():
    """The boot log line each probe pass prints (memra.pp.probe.probe_line): PASS when clean, BOUNCE
    when corruption was seen (and host bounce carries the traffic)."""
    import time

    from memra.pp.probe import probe_line

    t0 = time.perf_counter()
    clean = probe_line("production-slot probe", 0, "cuda:0", "cuda:1", copies=4, mismatches=0,
                       detail="widths_tokens=[1, 8, 16, 4096]", started=t0)
    assert clean.startswith("[pp] production-slot probe PASS: boundary=0 cuda:0->cuda:1 widths_tokens=[1, 8, 16, 4096]")
    assert "copies=4 mismatches=0 elapsed_ms=" in clean
    assert "probe BOUNCE: boundary=1" in probe_line("peer byte-integrity probe", 1, "cuda:1", "cuda:2", copies=2,
                                                    mismatches=7, detail="bytes=16384", started=t0)
