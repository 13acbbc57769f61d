"""The peer byte-integrity probe's policy: how much to copy, when to copy it, and what a bad copy means.

A peer copy between two GPUs can return wrong bytes on some hosts (a broken P2P path), and wrong
boundary bytes would silently break exactness. The reference runtime therefore copies a known
pattern across every cross-device boundary, both ways: a fixed 16 KiB pass at boot, a ladder of
production-sized rows (1/8/16/4096 tokens of the hidden width) through the real boundary slots,
and a low-rate re-probe while serving. This module is that policy with the device work removed:
every function takes its state explicitly and returns the new state, so the runtime holds one
state object under its own lock and these rules stay testable without a GPU. The bytes themselves
come from memra.pp.probe_pattern; refusals are memra.pp.errors.PipelineError, so this policy needs
nothing from the doors or the placement (memra.pp.placement asks it whether the probe may be skipped).

The one-way rule: a failed runtime probe turns native peer transport off for good, and only then
— after the host-staged path has been armed and checked — publishes host bounce as the transport.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from memra.cache import PRIME_CHUNK_MAX_TOKENS
from memra.pp.errors import PipelineError
from memra.pp.probe_pattern import mismatch_count, peer_probe_pattern, poison_of  # noqa: F401 - memra.pp.probe reads them here

PEER_PROBE_FIXED_BYTES = 16 * 1024
PEER_PROBE_TOKEN_WIDTHS: tuple[int, ...] = (1, 8, 16, PRIME_CHUNK_MAX_TOKENS)
BOUNDARY_ELEM_BYTES = 4  # the boundary carries f32 rows
# Boundary copies between runtime re-probes. Fixed, not a door: it is a safety cadence.
PEER_RUNTIME_PROBE_INTERVAL_COPIES = 8 * 1024
PEER_RUNTIME_PROBE_CYCLE_COPIES = PEER_RUNTIME_PROBE_INTERVAL_COPIES * len(PEER_PROBE_TOKEN_WIDTHS)
# Runnable intervals a re-probe may be held back (live speculative state) before coverage is
# reported degraded: one full rotation of the widths.
PEER_RUNTIME_PROBE_DEFERRAL_BOUND_INTERVALS = len(PEER_PROBE_TOKEN_WIDTHS)
# A rung measured above this wall cost leaves the interactive path and runs only when idle.
PEER_RUNTIME_PROBE_BUDGET_NS = 5_000_000
_U64_MAX = (1 << 64) - 1  # sizes and deadlines are u64 in the reference; beyond it is an error

PEER_PROBE_REQUIRED_REFUSAL = (
    "PP start refused: MEMRA_PEER_PROBE=0 cannot authorize native peer transport on a sharded "
    "cross-device placement while MEMRA_PP_HOST_BOUNCE!=1; leave MEMRA_PEER_PROBE on, or set "
    "MEMRA_PP_HOST_BOUNCE=1"
)


# ---------------------------------------------------------------------------------------------
# Startup: may the probe be skipped?
# ---------------------------------------------------------------------------------------------


class PeerProbeStartupPolicy(enum.Enum):
    ALLOWED = "allowed"
    BYPASSED_WITH_HOST_BOUNCE = "bypassed_with_host_bounce"  # logged loudly and counted


def peer_probe_startup_policy(probe_on: bool, sharded_cross_device: bool, host_bounce: bool) -> PeerProbeStartupPolicy:
    """Turning the probe off is refused only where it would leave native peer transport carrying
    sharded cross-device traffic unchecked; with host bounce it is allowed but flagged."""
    if not probe_on and sharded_cross_device:
        if not host_bounce:
            raise PipelineError(PEER_PROBE_REQUIRED_REFUSAL)
        return PeerProbeStartupPolicy.BYPASSED_WITH_HOST_BOUNCE
    return PeerProbeStartupPolicy.ALLOWED


# ---------------------------------------------------------------------------------------------
# The verdict on a copy (its bytes: memra.pp.probe_pattern)
# ---------------------------------------------------------------------------------------------


class ProbeVerdict(enum.Enum):
    CLEAN = "clean"
    PROCEED_WITH_HOST_BOUNCE = "proceed_with_host_bounce"  # corrupt, but host bounce was selected
    REFUSE_NATIVE_PEER = "refuse_native_peer"  # corrupt, and native peer is the transport


@dataclass(frozen=True)
class ProbeDecision:
    verdict: ProbeVerdict
    mismatches: int

    @property
    def message(self) -> str:
        return f"{self.mismatches} mismatched byte(s)"


def decide(mismatches: int, host_bounce: bool) -> ProbeDecision:
    """Any mismatch refuses native peer transport, unless host bounce already carries the traffic,
    in which case the corruption is reported and the host-staged path proceeds."""
    if mismatches == 0:
        return ProbeDecision(ProbeVerdict.CLEAN, 0)
    if host_bounce:
        return ProbeDecision(ProbeVerdict.PROCEED_WITH_HOST_BOUNCE, mismatches)
    return ProbeDecision(ProbeVerdict.REFUSE_NATIVE_PEER, mismatches)


def peer_probe_decision(expected: bytes, readback: bytes, host_bounce: bool) -> ProbeDecision:
    return decide(mismatch_count(expected, readback), host_bounce)


def unavailable_pair_verdict(host_bounce: bool) -> ProbeVerdict:
    """A pair whose copy cannot run (no peer capability, or the copy itself errored): skipped under
    host bounce (it remains the fail-safe), fatal otherwise."""
    return ProbeVerdict.PROCEED_WITH_HOST_BOUNCE if host_bounce else ProbeVerdict.REFUSE_NATIVE_PEER


def probe_pass_status(copies: int, skipped: int, mismatches: int) -> str:
    """The one-word summary of a probe pass: BOUNCE (corruption seen under host bounce), PARTIAL
    (some copies skipped), SKIP (all skipped), PASS."""
    if mismatches > 0:
        return "BOUNCE"
    if skipped > 0:
        return "PARTIAL" if copies > 0 else "SKIP"
    return "PASS"


# ---------------------------------------------------------------------------------------------
# Geometry: the production-slot ladder and the host-bounce staging size
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LadderRung:
    width_index: int
    tokens: int
    elems: int
    n_bytes: int

    @property
    def slot(self) -> int:
        """Rungs alternate between the boundary's two slots, so both are exercised."""
        return self.width_index % 2


def ladder(n_embd: int, elem_bytes: int = BOUNDARY_ELEM_BYTES) -> tuple[LadderRung, ...]:
    """The production-slot ladder for one directed copy: [tokens, n_embd] rows at each width."""
    rungs = []
    for i, tokens in enumerate(PEER_PROBE_TOKEN_WIDTHS):
        elems = n_embd * tokens
        n_bytes = elems * elem_bytes
        if n_bytes > _U64_MAX:
            raise PipelineError(f"PP probe size overflows for n_embd={n_embd} tokens={tokens}")
        rungs.append(LadderRung(i, tokens, elems, n_bytes))
    return tuple(rungs)


def host_bounce_capacity(n_embd: int, elem_bytes: int = BOUNDARY_ELEM_BYTES) -> tuple[int, int]:
    """(elements, bytes) of one pinned host-bounce slot: the largest prime chunk of hidden rows."""
    if n_embd <= 0:
        raise PipelineError("MEMRA_PP_HOST_BOUNCE needs the model's hidden width (n_embd > 0)")
    elems = n_embd * PRIME_CHUNK_MAX_TOKENS
    n_bytes = elems * elem_bytes
    if n_bytes > _U64_MAX:
        raise PipelineError(f"host-bounce staging size overflows for n_embd={n_embd}")
    return elems, n_bytes


# ---------------------------------------------------------------------------------------------
# Runtime re-probe schedule
# ---------------------------------------------------------------------------------------------


class RuntimeProbeStatus(enum.Enum):
    NOT_RUN = "not_run"
    DEFERRED = "deferred"
    PASSED = "passed"
    DEGRADED_TO_HOST_BOUNCE = "degraded_to_host_bounce"

    @property
    def ran(self) -> bool:
        return self in (RuntimeProbeStatus.PASSED, RuntimeProbeStatus.DEGRADED_TO_HOST_BOUNCE)


def _initial_deadlines() -> tuple[int, ...]:
    # Staggered: width i first falls due after (i+1) intervals, so one rung runs per interval.
    return tuple((i + 1) * PEER_RUNTIME_PROBE_INTERVAL_COPIES for i in range(len(PEER_PROBE_TOKEN_WIDTHS)))


@dataclass(frozen=True)
class ReprobeState:
    """Per-width copy-count deadlines and worst measured wall cost, plus the probe metrics."""

    next_probe_copy: tuple[int, ...] = field(default_factory=_initial_deadlines)
    max_cost_ns: tuple[int, ...] = (0,) * len(PEER_PROBE_TOKEN_WIDTHS)
    probes: int = 0
    failures: int = 0
    deferred_total: int = 0
    integrity_degraded: bool = False


def reprobe_idle_only(width_index: int, measured_cost_ns: int) -> bool:
    """The largest rung always waits for an idle scheduler; so does any rung measured over budget."""
    return width_index == len(PEER_PROBE_TOKEN_WIDTHS) - 1 or measured_cost_ns > PEER_RUNTIME_PROBE_BUDGET_NS


def reprobe_candidate(copies: int, next_probe_copy: tuple[int, ...], measured_cost_ns: tuple[int, ...],
                      scheduler_idle: bool) -> tuple[int, int] | None:
    """(width_index, tokens) of the oldest due deadline that may run now, or None. An overdue
    idle-only rung is skipped, not waited on, so the cheap rungs keep their cadence while busy;
    on equal deadlines the narrower width wins."""
    best: tuple[int, int] | None = None
    for i, due in enumerate(next_probe_copy):
        if copies < due or (not scheduler_idle and reprobe_idle_only(i, measured_cost_ns[i])):
            continue
        if best is None or due < best[1]:
            best = (i, due)
    return None if best is None else (best[0], PEER_PROBE_TOKEN_WIDTHS[best[0]])


def reprobe_next_copy(due: int, copies: int) -> int:
    """Move a deadline to the first cycle after `copies`: missed opportunities collapse into one
    probe rather than a burst of catch-up probes."""
    cycles = max(copies - due, 0) // PEER_RUNTIME_PROBE_CYCLE_COPIES + 1
    return min(due + PEER_RUNTIME_PROBE_CYCLE_COPIES * cycles, _U64_MAX)


def reprobe_gate(peer_probe: bool, cross_any: bool, host_bounce_active: bool, native_failed: bool,
                 geometry_ready: bool) -> RuntimeProbeStatus | None:
    """NOT_RUN when there is nothing to re-probe (probe off, one device, host bounce live, or the
    boot ladder has not sized the rows yet); raises once native peer is latched off without a
    validated fallback; None means: go on to schedule."""
    if not peer_probe or not cross_any or host_bounce_active:
        return RuntimeProbeStatus.NOT_RUN
    if native_failed:
        raise PipelineError("PP runtime peer byte-integrity probe failed earlier; native peer transport "
                            "is latched off")
    return None if geometry_ready else RuntimeProbeStatus.NOT_RUN


@dataclass(frozen=True)
class ReprobeTicket:
    """One scheduled re-probe: which rung, and the copy count it was scheduled at."""

    width_index: int
    tokens: int
    probe_index: int
    copies: int
    scheduler_idle: bool

    @property
    def label(self) -> str:
        return f"runtime-{'idle' if self.scheduler_idle else 'busy'}-{self.tokens}tok"

    def n_bytes(self, row_bytes: int) -> int:
        n = row_bytes * self.tokens
        if n > _U64_MAX:
            raise PipelineError(f"PP runtime probe size overflows for row_bytes={row_bytes} tokens={self.tokens}")
        return n


def schedule_reprobe(state: ReprobeState, copies: int, scheduler_idle: bool,
                     probe_allowed: bool) -> tuple[ReprobeState, ReprobeTicket | RuntimeProbeStatus]:
    """Pick the rung to probe at this scheduler boundary. When a runnable rung is held back
    (`probe_allowed` False: live speculative state still reads through the peer mapping), report
    DEFERRED and leave the deadline and probe count untouched so the rung stays due."""
    cand = reprobe_candidate(copies, state.next_probe_copy, state.max_cost_ns, scheduler_idle)
    if cand is None:
        return state, RuntimeProbeStatus.NOT_RUN
    if not probe_allowed:
        return state, RuntimeProbeStatus.DEFERRED
    i, tokens = cand
    deadlines = list(state.next_probe_copy)
    deadlines[i] = reprobe_next_copy(deadlines[i], copies)
    ticket = ReprobeTicket(i, tokens, state.probes, copies, scheduler_idle)
    return replace(state, next_probe_copy=tuple(deadlines), probes=state.probes + 1), ticket


def finish_reprobe(state: ReprobeState, ticket: ReprobeTicket, elapsed_ns: int,
                   passed: bool) -> tuple[ReprobeState, bool]:
    """Record a finished re-probe: its cost (worst seen per width) and, if it failed, the failure.
    The flag is True when a passing rung first crossed the budget (log once: it is idle-only now)."""
    i = ticket.width_index
    prev = state.max_cost_ns[i]
    costs = list(state.max_cost_ns)
    costs[i] = max(prev, elapsed_ns)
    new = replace(state, max_cost_ns=tuple(costs), failures=state.failures + (0 if passed else 1))
    crossed = (passed and i != len(PEER_PROBE_TOKEN_WIDTHS) - 1
               and prev <= PEER_RUNTIME_PROBE_BUDGET_NS < elapsed_ns)
    return new, crossed


def record_deferral(state: ReprobeState, intervals: int, bound_reached: bool) -> ReprobeState:
    """Count newly observed held-back intervals; once the bound is reached coverage is reported
    degraded until the next completed probe or validated failover clears it."""
    return replace(state, deferred_total=state.deferred_total + intervals,
                   integrity_degraded=state.integrity_degraded or bound_reached)


def clear_integrity_degraded(state: ReprobeState) -> ReprobeState:
    return replace(state, integrity_degraded=False)


# ---------------------------------------------------------------------------------------------
# The one-way latch from native peer to validated host bounce
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TransportLatch:
    """native_failed: a runtime probe failed, native peer is off for the rest of the process.
    host_bounce: the host-staged path was armed and validated and is now the live transport.
    Neither ever goes back to False."""

    native_failed: bool = False
    host_bounce: bool = False


def latch_runtime_host_bounce(latch: TransportLatch,
                              arm_and_validate: Callable[[], None]) -> tuple[TransportLatch, Exception | None]:
    """Fail closed first (native off), then arm and check the host-staged path, and only if that
    succeeds publish it. Returns the new latch and the arming error (None on success); the caller
    must stop serving on an error, since no transport is left."""
    failed = replace(latch, native_failed=True)
    try:
        arm_and_validate()
    except Exception as err:  # noqa: BLE001 - any arming failure leaves native off, bounce unpublished
        return failed, err
    return replace(failed, host_bounce=True), None


def latch_refusal(latch: TransportLatch) -> str | None:
    """Why a new boundary transport may not be set up: native peer failed and no validated host
    bounce replaced it."""
    if latch.native_failed and not latch.host_bounce:
        return ("PP runtime peer byte-integrity probe failed earlier and host-bounce staging could not be "
                "armed; refusing to reuse native peer transport")
    return None


def host_bounce_active(selected_at_start: bool, latch: TransportLatch) -> bool:
    return selected_at_start or latch.host_bounce
