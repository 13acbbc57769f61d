"""The pipeline-parallel doors, the stage fence and every placement refusal, as pure functions.

Mirrors the reference runtime's door layer (its `pp_cuts`, `stage_of`, the `*_on()` switches, the
dual-wave routing and the unsplit-walk guard). Every function takes the environment as an explicit
mapping: memra passes the doors its model was loaded with (memra.settings.Settings.pp_env), so a gate
A/Bs a door by building a second view of the model, not by changing the environment.

Two failure styles, chosen where the reference chose them:
  * a door value that cannot be used leaves pipeline parallelism OFF and warns once per
    (door, value) — a typo must never silently produce a different split than the one asked for;
  * a placement that cannot be honoured (ambiguous stage count, bad device list, missing device,
    host bounce on an unsafe placement) raises `PipelineError` — running anyway would fake a gate.
"""

from __future__ import annotations

import enum
import re
import threading
import warnings
from bisect import bisect_right
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from memra.errors import MemraError
from memra.settings import process_env

Env = Mapping[str, str]


class PipelineError(MemraError):
    """A pipeline-parallel placement or schedule that memra refuses to run."""


class PpDoorWarning(UserWarning):
    """A MEMRA_PP_* door value that was ignored (the door keeps its safe setting)."""


def _env(env: Env | None) -> Env:
    """`env`, or the process environment where a caller passes none (memra's own callers pass the
    pipeline doors their model was loaded with: Settings.pp_env)."""
    return process_env() if env is None else env


_USIZE = re.compile(r"\+?[0-9]+")  # what the reference's unsigned parse accepts: no spaces, no sign


def _usize(raw: str) -> int | None:
    return int(raw) if _USIZE.fullmatch(raw) else None


# One warning per (door, value): the reference warns once per process; keying on the value too
# means a second, different typo in the same process is still reported.
_warned: set[tuple[str, str]] = set()
_warned_lock = threading.Lock()


def warn_once(door: str, value: str, message: str) -> bool:
    """Emit `message` as a PpDoorWarning unless (door, value) already warned. True if emitted."""
    with _warned_lock:
        if (door, value) in _warned:
            return False
        _warned.add((door, value))
    warnings.warn(message, PpDoorWarning, stacklevel=3)
    return True


def reset_warnings() -> None:
    """Forget which (door, value) pairs have warned (tests only)."""
    with _warned_lock:
        _warned.clear()


# ---------------------------------------------------------------------------------------------
# The stage fence
# ---------------------------------------------------------------------------------------------


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


def parse_fence(n_layers: int, stages: str | None, splits: str | None, split: str | None) -> StageFence | None:
    """The fence the raw door strings ask for, or None (door OFF, with a one-time warning if a
    value was unusable). Precedence as in the reference: SPLITS, then SPLIT (N=2 only), then the
    even split cut_s = s * n_layers // N. Empty/0/1 stages means OFF without a warning."""
    if stages is None or stages in ("", "0", "1"):
        return None
    n = _usize(stages)
    if n is None:
        warn_once("MEMRA_PP_STAGES", stages, f"MEMRA_PP_STAGES={stages!r} is not a stage count; "
                  "pipeline parallelism stays off")
        return None
    if not 2 <= n <= n_layers:
        warn_once("MEMRA_PP_STAGES", stages, f"MEMRA_PP_STAGES={n} is outside 2..{n_layers} (the model's "
                  "decoder layers); pipeline parallelism stays off")
        return None
    if splits is not None:  # set-but-empty counts as set (and invalid), as in the reference
        parts = [_usize(p.strip()) for p in splits.split(",")]
        if len(parts) != n - 1 or any(p is None for p in parts):
            warn_once("MEMRA_PP_SPLITS", splits, f"MEMRA_PP_SPLITS={splits!r} must be {n - 1} comma-separated "
                      f"layer indices for MEMRA_PP_STAGES={n}; pipeline parallelism stays off")
            return None
        cuts = tuple(p for p in parts if p is not None)
    elif split is not None:
        if n != 2:
            # One cut for N>2 stages is ambiguous; guessing the rest would fake the gate's config.
            warn_once("MEMRA_PP_SPLIT", split, f"MEMRA_PP_SPLIT={split!r} names one cut but "
                      f"MEMRA_PP_STAGES={n} needs {n - 1}; use MEMRA_PP_SPLITS. Pipeline parallelism stays off")
            return None
        c = _usize(split)
        if c is None:
            warn_once("MEMRA_PP_SPLIT", split, f"MEMRA_PP_SPLIT={split!r} is not a layer index; "
                      "pipeline parallelism stays off")
            return None
        cuts = (c,)
    else:
        cuts = tuple(s * n_layers // n for s in range(1, n))
    bounds = (0, *cuts, n_layers)
    if any(a >= b for a, b in zip(bounds, bounds[1:])):
        warn_once("stage fence", f"{bounds}", f"stage fence {list(bounds)} is not strictly increasing over "
                  f"0..{n_layers} (every stage needs a layer); pipeline parallelism stays off")
        return None
    return StageFence(n_layers, cuts)


def pp_fence(n_layers: int, env: Env | None = None) -> StageFence | None:
    """The stage fence iff the PP door is open (MEMRA_PP_STAGES=N, 2 <= N <= n_layers) with a
    usable cut list. `n_layers` is the trunk (MTP layers excluded). Read per call."""
    e = _env(env)
    return parse_fence(n_layers, e.get("MEMRA_PP_STAGES"), e.get("MEMRA_PP_SPLITS"), e.get("MEMRA_PP_SPLIT"))


def pp_cuts(n_layers: int, env: Env | None = None) -> tuple[int, ...] | None:
    """The reference's fence vector (0, c1, .., n_layers), or None when the door is off."""
    fence = pp_fence(n_layers, env)
    return None if fence is None else fence.bounds


def pp2_split(n_layers: int, env: Env | None = None) -> int | None:
    """The single cut iff the door is open with exactly two stages (the 2-stage view)."""
    fence = pp_fence(n_layers, env)
    return fence.cuts[0] if fence is not None and fence.n_stages == 2 else None


# ---------------------------------------------------------------------------------------------
# On/off switches. Each resolves exactly as the reference compares strings ("0" turns a
# default-on door off, "1" turns a default-off door on); any other non-empty value keeps the
# default but warns once, because `true`/`off` look meaningful and are not.
# ---------------------------------------------------------------------------------------------


def _switch(env: Env | None, name: str, default: bool) -> bool:
    raw = _env(env).get(name)
    if raw == "0":
        return False
    if raw == "1":
        return True
    if raw:
        warn_once(name, raw, f"{name}={raw!r} is not 0 or 1; it stays {'on' if default else 'off'} (its default)")
    return default


def pp_streams_off(env: Env | None = None) -> bool:
    """MEMRA_PP_STREAMS=0: the single-stream rollback (no per-stage streams, devices or sharding)."""
    return not _switch(env, "MEMRA_PP_STREAMS", True)


def pp_shard_off(env: Env | None = None) -> bool:
    """MEMRA_PP_SHARD=0: every weight stays on the primary device; remote stages read it over peer."""
    return not _switch(env, "MEMRA_PP_SHARD", True)


def pp_host_bounce_on(env: Env | None = None) -> bool:
    """MEMRA_PP_HOST_BOUNCE=1: cross-device boundaries go device→pinned host→device, not peer copy."""
    return _switch(env, "MEMRA_PP_HOST_BOUNCE", False)


def peer_probe_on(env: Env | None = None) -> bool:
    """MEMRA_PEER_PROBE (default on): the boot-time peer byte-integrity probe. 0 is diagnostics-only."""
    return _switch(env, "MEMRA_PEER_PROBE", True)


def batch_pp_on(env: Env | None = None) -> bool:
    """MEMRA_BATCH_PP (default on): the batched decode step takes its stage split. 0 = unsplit body."""
    return _switch(env, "MEMRA_BATCH_PP", True)


def prime_pp_on(env: Env | None = None) -> bool:
    """MEMRA_PRIME_PP (default on): the chunked prime walks per stage. 0 = the unsplit reference walk
    (deliberately NOT refused on remote weights: it is the prime gate's reference arm)."""
    return _switch(env, "MEMRA_PRIME_PP", True)


def prime_pipe_on(env: Env | None = None) -> bool:
    """MEMRA_PRIME_PIPE (default on): PP-2 prime chunks overlap across stages. 0 = serial chunks."""
    return _switch(env, "MEMRA_PRIME_PIPE", True)


def spec_pp_on(env: Env | None = None) -> bool:
    """MEMRA_SPEC_PP (default on): the verify forward takes its stage split. 0 = unsplit verify."""
    return _switch(env, "MEMRA_SPEC_PP", True)


def allow_unsplit_batch(env: Env | None = None) -> bool:
    """MEMRA_PP_ALLOW_UNSPLIT_BATCH=1: measurement override for `refuse_unsplit_if_remote`."""
    return _switch(env, "MEMRA_PP_ALLOW_UNSPLIT_BATCH", False)


def dual_pp_timing_on(env: Env | None = None) -> bool:
    """MEMRA_DUAL_PP_TIMING=1: diagnostic per-wave stage timing. The reference latches this once per
    process; the runtime should read it once at startup and keep the answer."""
    return _switch(env, "MEMRA_DUAL_PP_TIMING", False)


# ---------------------------------------------------------------------------------------------
# Dual-wave PP-2 decode and the boundary slots
# ---------------------------------------------------------------------------------------------


class DualPpMode(enum.Enum):
    """MEMRA_DUAL_PP. OFF (0): the serial rollback. FORCED (1): every B>=2 call goes to the dual
    body, which refuses loudly where it cannot run. AUTO (unset, the default): dual only in the
    validated regime (PP-2, double-slot boundary, peer transport, B>=2), serial everywhere else."""

    OFF = "off"
    FORCED = "forced"
    AUTO = "auto"


def dual_pp_mode_resolve(raw: str | None) -> DualPpMode:
    """Pure resolution: "0" → OFF, "1" → FORCED, anything else → AUTO (never a silent fourth state)."""
    if raw == "0":
        return DualPpMode.OFF
    if raw == "1":
        return DualPpMode.FORCED
    return DualPpMode.AUTO


def dual_pp_mode(env: Env | None = None) -> DualPpMode:
    raw = _env(env).get("MEMRA_DUAL_PP")
    if raw not in (None, "", "0", "1"):
        warn_once("MEMRA_DUAL_PP", raw, f"MEMRA_DUAL_PP={raw!r} is not 0 or 1; using the default (auto)")
    return dual_pp_mode_resolve(raw)


def dual_pp_on(env: Env | None = None) -> bool:
    return dual_pp_mode(env) is not DualPpMode.OFF


def pp_overlap_resolve(raw: str | None, mode: DualPpMode) -> bool:
    """MEMRA_PP_OVERLAP: "1" → alternate the two boundary slots; any other set value → one slot;
    unset follows the mode (AUTO → on; OFF → off so MEMRA_DUAL_PP=0 alone restores the serial
    path; FORCED → off so its single-slot refusal stays reachable)."""
    if raw is not None:
        return raw == "1"
    return mode is DualPpMode.AUTO


def pp_overlap(env: Env | None = None) -> bool:
    raw = _env(env).get("MEMRA_PP_OVERLAP")
    if raw not in (None, "0", "1"):
        warn_once("MEMRA_PP_OVERLAP", raw, f"MEMRA_PP_OVERLAP={raw!r} is not 0 or 1; it is treated as 0")
    return pp_overlap_resolve(raw, dual_pp_mode(env))


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


# ---------------------------------------------------------------------------------------------
# Placement
# ---------------------------------------------------------------------------------------------


def _stages_env_open(e: Env) -> bool:
    n = _usize(e.get("MEMRA_PP_STAGES", ""))
    return n is not None and n >= 2


def _devices_raw(e: Env) -> str | None:
    raw = e.get("MEMRA_PP_DEVICES")
    return raw if raw else None


def _distinct_devices(raw: str) -> tuple[int, int]:
    """(entries, distinct entries) of a device list; "1" and "01" are one device."""
    items = [p.strip() for p in raw.split(",")]
    keys = {(_usize(p) if _usize(p) is not None else p) for p in items}
    return len(items), len(keys)


def pp_multi_stream_same_device(env: Env | None = None) -> bool:
    """Two or more stage streams would share one device (no placement, or a repeated device).
    The deferred-readback arm is refused there: it raced on one device and no flag fixed it."""
    e = _env(env)
    devices = _devices_raw(e)
    if (not _stages_env_open(e) and devices is None) or pp_streams_off(e):
        return False
    if devices is None:
        return True
    n, distinct = _distinct_devices(devices)
    return distinct < n


def pp_sharded_cross_device(env: Env | None = None) -> bool:
    """The door is open, the placement spans 2+ devices and weights are sharded per stage — so some
    layers' weights live away from the primary device. (STREAMS=0 puts everything home too.)"""
    e = _env(env)
    if not _stages_env_open(e) or pp_shard_off(e) or pp_streams_off(e):
        return False
    devices = _devices_raw(e)
    return devices is not None and _distinct_devices(devices)[1] >= 2


def pp_host_bounce_active(env: Env | None = None, runtime_latched: bool = False) -> bool:
    """Host bounce is the live transport of a sharded cross-device placement, either selected at
    startup or latched by a failed runtime probe (see probe_policy.TransportLatch)."""
    return (pp_host_bounce_on(env) or runtime_latched) and pp_sharded_cross_device(env)


@dataclass(frozen=True)
class UnsplitView:
    """What the unsplit-walk guard needs to know about the placement."""

    sharded_cross_device: bool
    host_bounce_active: bool
    allow_unsplit_batch: bool

    @classmethod
    def from_env(cls, env: Env | None = None, runtime_latched: bool = False) -> UnsplitView:
        return cls(pp_sharded_cross_device(env), pp_host_bounce_active(env, runtime_latched),
                   allow_unsplit_batch(env))


def refuse_unsplit_if_remote(path: str, alt: str, view: UnsplitView) -> None:
    """Refuse a step body that would walk the whole trunk on one stream while some layers' weights
    live on another device (every step would read them over peer: correct bits, ~28x slower, so
    no exactness gate catches it). `path` names the refusing body, `alt` the working alternative.
    Under host bounce there is no override: the peer path is presumed broken."""
    if view.host_bounce_active:
        raise PipelineError(
            f"{path}: refused with MEMRA_PP_HOST_BOUNCE=1 on a sharded cross-device placement — this "
            f"body has no stage split and would read remote weights over the peer path, which host "
            f"bounce does not cover. Use {alt}. MEMRA_PP_ALLOW_UNSPLIT_BATCH cannot override this."
        )
    if view.sharded_cross_device and not view.allow_unsplit_batch:
        raise PipelineError(
            f"{path}: refused with the PP door open across 2+ devices — this body has no stage split, "
            f"so it would read every remote stage's weights over the peer path each step (same bits, "
            f"measured 14-28x slower). Fixes: {alt}; or MEMRA_PP_SHARD=0 (all weights on the primary); "
            f"or close the PP door. MEMRA_PP_ALLOW_UNSPLIT_BATCH=1 overrides, for measurement only."
        )


class BoundaryTransport(enum.Enum):
    LOCAL = "local"  # both stages on one device: device-to-device copy
    PEER = "peer"  # cross-device: native peer copy (the default)
    HOST_BOUNCE = "host_bounce"  # cross-device through pinned host memory


def boundary_transport(cross: bool, host_bounce: bool) -> BoundaryTransport:
    """Peer by default; host bounce only ever replaces a cross-device boundary."""
    if not cross:
        return BoundaryTransport.LOCAL
    return BoundaryTransport.HOST_BOUNCE if host_bounce else BoundaryTransport.PEER


@dataclass(frozen=True)
class PpPlacement:
    """Stage → device, and the transport facts derived from it (the runtime's build inputs)."""

    devices: tuple[int, ...]
    primary_dev: int
    shard: bool
    host_bounce: bool
    peer_probe: bool
    probe_bypassed: bool  # MEMRA_PEER_PROBE=0 accepted only because host bounce is the transport

    @property
    def n_stages(self) -> int:
        return len(self.devices)

    @property
    def cross_any(self) -> bool:
        return any(d != self.devices[0] for d in self.devices)

    @property
    def sharded_cross_device(self) -> bool:
        return self.cross_any and self.shard

    @property
    def used_devices(self) -> tuple[int, ...]:
        return tuple(sorted({*self.devices, self.primary_dev}))

    @property
    def boundary_cross(self) -> tuple[bool, ...]:
        return tuple(a != b for a, b in zip(self.devices, self.devices[1:]))

    def transports(self, runtime_latched: bool = False) -> tuple[BoundaryTransport, ...]:
        bounce = self.host_bounce or runtime_latched
        return tuple(boundary_transport(c, bounce) for c in self.boundary_cross)


def plan_placement(doors: PpDoors, primary_dev: int, device_count: int) -> PpPlacement:
    """Resolve MEMRA_PP_DEVICES / MEMRA_PP_STAGES into a placement, raising PipelineError in the
    reference's order: unparseable device list, stage-count disagreement, host bounce on an
    unsafe placement, probe bypass without host bounce, a device that does not exist.
    Without a device list every stage sits on the primary (N from STAGES, else 2)."""
    from memra.pp.probe_policy import PeerProbeStartupPolicy, peer_probe_startup_policy

    if doors.devices is not None:
        parts = [_usize(p.strip()) for p in doors.devices.split(",")]
        if len(parts) < 2 or any(p is None for p in parts):
            raise PipelineError(f"MEMRA_PP_DEVICES={doors.devices!r} is not a device list; "
                                "want one CUDA index per stage, e.g. 0,1 or 0,1,2,3")
        devices = tuple(p for p in parts if p is not None)
    else:
        n = _usize(doors.stages or "")
        devices = (primary_dev,) * (n if n is not None and n >= 2 else 2)
    n_env = _usize(doors.stages or "")
    if n_env is not None and n_env >= 2 and n_env != len(devices):
        raise PipelineError(f"MEMRA_PP_DEVICES lists {len(devices)} devices but MEMRA_PP_STAGES={n_env}; "
                            "refusing an ambiguous placement (make them agree, or unset one)")
    cross_any = any(d != devices[0] for d in devices)
    if doors.host_bounce and cross_any:
        if not doors.shard:
            raise PipelineError("MEMRA_PP_HOST_BOUNCE=1 refuses MEMRA_PP_SHARD=0: the boundary would "
                                "bounce but remote stages would still read primary-device weights over peer")
        if devices[-1] != primary_dev:
            raise PipelineError(f"MEMRA_PP_HOST_BOUNCE=1 needs the primary device (cuda:{primary_dev}) on the "
                                f"last stage, which holds the head; placement is {list(devices)}")
    policy = peer_probe_startup_policy(doors.peer_probe, cross_any and doors.shard, doors.host_bounce)
    used = sorted({*devices, primary_dev})
    if len(used) > 1 and any(d >= device_count for d in used):
        raise PipelineError(f"MEMRA_PP_DEVICES={list(devices)} but only {device_count} CUDA device(s) are present")
    return PpPlacement(devices, primary_dev, doors.shard, doors.host_bounce, doors.peer_probe,
                       policy is PeerProbeStartupPolicy.BYPASSED_WITH_HOST_BOUNCE)


def peer_capable_pairs(placement: PpPlacement, can_access: Callable[[int, int], bool]) -> tuple[tuple[int, int], ...]:
    """Directed device pairs with peer access, queried only where the reference queries (native
    transport, or host bounce with the probe on). Without host bounce a missing pair is fatal:
    silently staging through the host is not what was asked for."""
    used = placement.used_devices
    if len(used) < 2 or (placement.host_bounce and not placement.peer_probe):
        return ()
    pairs = []
    for a in used:
        for b in used:
            if a == b:
                continue
            if can_access(a, b):
                pairs.append((a, b))
            elif not placement.host_bounce:
                raise PipelineError(f"cuda:{a} cannot peer-access cuda:{b}; cross-device PP needs peer access "
                                    "(or MEMRA_PP_HOST_BOUNCE=1 for the host-staged path)")
    return tuple(pairs)


def warn_unwired_once(path: str, env: Env | None = None) -> bool:
    """One notice when the door is set but the executing body has no stage split (it runs unsplit)."""
    raw = _env(env).get("MEMRA_PP_STAGES")
    if raw in (None, "", "0", "1"):
        return False
    return warn_once("unwired", path, f"MEMRA_PP_STAGES is set but {path} has no stage split; running unsplit")


# ---------------------------------------------------------------------------------------------
# One snapshot of every door
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PpDoors:
    """Every PP door at one instant. Raw strings are kept where resolution needs more context
    (the fence needs n_layers); switches are resolved. Build per step where a gate A/Bs doors."""

    stages: str | None
    splits: str | None
    split: str | None
    devices: str | None  # empty counts as unset, as in the reference
    shard: bool
    streams: bool
    overlap_raw: str | None
    dual_pp: DualPpMode
    host_bounce: bool
    peer_probe: bool
    batch_pp: bool
    prime_pp: bool
    prime_pipe: bool
    spec_pp: bool
    allow_unsplit_batch: bool
    dual_pp_timing: bool

    @classmethod
    def from_env(cls, env: Env | None = None) -> PpDoors:
        e = _env(env)
        return cls(
            stages=e.get("MEMRA_PP_STAGES"),
            splits=e.get("MEMRA_PP_SPLITS"),
            split=e.get("MEMRA_PP_SPLIT"),
            devices=_devices_raw(e),
            shard=not pp_shard_off(e),
            streams=not pp_streams_off(e),
            overlap_raw=e.get("MEMRA_PP_OVERLAP"),
            dual_pp=dual_pp_mode(e),
            host_bounce=pp_host_bounce_on(e),
            peer_probe=peer_probe_on(e),
            batch_pp=batch_pp_on(e),
            prime_pp=prime_pp_on(e),
            prime_pipe=prime_pipe_on(e),
            spec_pp=spec_pp_on(e),
            allow_unsplit_batch=allow_unsplit_batch(e),
            dual_pp_timing=dual_pp_timing_on(e),
        )

    @property
    def overlap(self) -> bool:
        return pp_overlap_resolve(self.overlap_raw, self.dual_pp)

    def fence(self, n_layers: int) -> StageFence | None:
        return parse_fence(n_layers, self.stages, self.splits, self.split)

    def summary(self) -> str:
        """One line naming every door's effective value (for logs and `memra inspect`)."""
        def b(v: bool) -> str:
            return "on" if v else "off"

        overlap_src = "" if self.overlap_raw is not None else "(follows dual)"
        return (
            f"pp: stages={self.stages or 'off'} splits={self.splits if self.splits is not None else '-'} "
            f"split={self.split if self.split is not None else '-'} devices={self.devices or 'primary'} "
            f"shard={b(self.shard)} streams={b(self.streams)} overlap={b(self.overlap)}{overlap_src} "
            f"dual={self.dual_pp.value} host_bounce={b(self.host_bounce)} peer_probe={b(self.peer_probe)} "
            f"batch={b(self.batch_pp)} prime={b(self.prime_pp)} prime_pipe={b(self.prime_pipe)} "
            f"spec={b(self.spec_pp)} allow_unsplit={b(self.allow_unsplit_batch)} timing={b(self.dual_pp_timing)}"
        )
