"""The MEMRA_PP_* doors (and MEMRA_{BATCH,PRIME,SPEC,DUAL}_PP, MEMRA_PEER_PROBE, ...): parsed, resolved and
refused, as pure functions of an explicit environment mapping.

Mirrors the reference runtime's door layer (its `pp_cuts`, the `*_on()` switches, MEMRA_DUAL_PP's three
modes). memra passes the doors its model was loaded with (memra.settings.Settings.pp_env), so a gate
A/Bs a door by building a second view of the model, not by changing the environment. A door value that
cannot be used leaves its door at the safe setting and warns once (memra.pp.errors): a typo must never
silently produce a different split than the one asked for. Door names, defaults and warning texts
mirror the reference, so they must not drift.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass

from memra.pp.errors import warn_once
from memra.pp.topology import StageFence
from memra.settings import process_env

Env = Mapping[str, str]


def resolve_env(env: Env | None) -> Env:
    """`env`, or the process environment where a caller passes none (memra's own callers pass the
    pipeline doors their model was loaded with: Settings.pp_env)."""
    return process_env() if env is None else env


_USIZE = re.compile(r"\+?[0-9]+")  # what the reference's unsigned parse accepts: no spaces, no sign


def parse_usize(raw: str) -> int | None:
    return int(raw) if _USIZE.fullmatch(raw) else None


# ---------------------------------------------------------------------------------------------
# The stage fence the doors ask for
# ---------------------------------------------------------------------------------------------


def parse_fence(n_layers: int, stages: str | None, splits: str | None, split: str | None) -> StageFence | None:
    """The fence the raw door strings ask for, or None (door OFF, with a one-time warning if a
    value was unusable). Precedence as in the reference: SPLITS, then SPLIT (N=2 only), then the
    even split cut_s = s * n_layers // N. Empty/0/1 stages means OFF without a warning."""
    if stages is None or stages in ("", "0", "1"):
        return None
    n = parse_usize(stages)
    if n is None:
        warn_once("MEMRA_PP_STAGES", stages, f"MEMRA_PP_STAGES={stages!r} is not a stage count; "
                  "pipeline parallelism stays off")
        return None
    if not 2 <= n <= n_layers:
        warn_once("MEMRA_PP_STAGES", stages, f"MEMRA_PP_STAGES={n} is outside 2..{n_layers} (the model's "
                  "decoder layers); pipeline parallelism stays off")
        return None
    if splits is not None:  # set-but-empty counts as set (and invalid), as in the reference
        parts = [parse_usize(p.strip()) for p in splits.split(",")]
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
        c = parse_usize(split)
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
    e = resolve_env(env)
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
    raw = resolve_env(env).get(name)
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
# MEMRA_DUAL_PP and MEMRA_PP_OVERLAP (the routing they drive: memra.pp.dual)
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
    raw = resolve_env(env).get("MEMRA_DUAL_PP")
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
    raw = resolve_env(env).get("MEMRA_PP_OVERLAP")
    if raw not in (None, "0", "1"):
        warn_once("MEMRA_PP_OVERLAP", raw, f"MEMRA_PP_OVERLAP={raw!r} is not 0 or 1; it is treated as 0")
    return pp_overlap_resolve(raw, dual_pp_mode(env))


def devices_raw(e: Env) -> str | None:
    """MEMRA_PP_DEVICES, with empty counting as unset (as in the reference)."""
    raw = e.get("MEMRA_PP_DEVICES")
    return raw if raw else None


def warn_unwired_once(path: str, env: Env | None = None) -> bool:
    """One notice when the door is set but the executing body has no stage split (it runs unsplit)."""
    raw = resolve_env(env).get("MEMRA_PP_STAGES")
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
        e = resolve_env(env)
        return cls(
            stages=e.get("MEMRA_PP_STAGES"),
            splits=e.get("MEMRA_PP_SPLITS"),
            split=e.get("MEMRA_PP_SPLIT"),
            devices=devices_raw(e),
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
