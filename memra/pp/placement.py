"""Placement: which device each stage runs on, how stage boundaries cross devices, and every
placement the pipeline refuses to run (ambiguous stage count, bad device list, missing device or peer
access, host bounce on an unsafe placement, an unsplit walk over remote weights).

Refusals raise PipelineError in the reference's order, because running anyway would fake a gate; the
texts mirror the reference and must not drift. Doors are read through memra.pp.doors.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from memra.pp.doors import (
    Env,
    PpDoors,
    allow_unsplit_batch,
    devices_raw,
    parse_usize,
    pp_host_bounce_on,
    pp_shard_off,
    pp_streams_off,
    resolve_env,
)
from memra.pp.errors import PipelineError
from memra.pp.probe_policy import PeerProbeStartupPolicy, peer_probe_startup_policy


def _stages_env_open(e: Env) -> bool:
    n = parse_usize(e.get("MEMRA_PP_STAGES", ""))
    return n is not None and n >= 2


def _distinct_devices(raw: str) -> tuple[int, int]:
    """(entries, distinct entries) of a device list; "1" and "01" are one device."""
    items = [p.strip() for p in raw.split(",")]
    keys = {(parse_usize(p) if parse_usize(p) is not None else p) for p in items}
    return len(items), len(keys)


def pp_multi_stream_same_device(env: Env | None = None) -> bool:
    """Two or more stage streams would share one device (no placement, or a repeated device).
    The deferred-readback arm is refused there: it raced on one device and no flag fixed it."""
    e = resolve_env(env)
    devices = devices_raw(e)
    if (not _stages_env_open(e) and devices is None) or pp_streams_off(e):
        return False
    if devices is None:
        return True
    n, distinct = _distinct_devices(devices)
    return distinct < n


def pp_sharded_cross_device(env: Env | None = None) -> bool:
    """The door is open, the placement spans 2+ devices and weights are sharded per stage — so some
    layers' weights live away from the primary device. (STREAMS=0 puts everything home too.)"""
    e = resolve_env(env)
    if not _stages_env_open(e) or pp_shard_off(e) or pp_streams_off(e):
        return False
    devices = devices_raw(e)
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
    if doors.devices is not None:
        parts = [parse_usize(p.strip()) for p in doors.devices.split(",")]
        if len(parts) < 2 or any(p is None for p in parts):
            raise PipelineError(f"MEMRA_PP_DEVICES={doors.devices!r} is not a device list; "
                                "want one CUDA index per stage, e.g. 0,1 or 0,1,2,3")
        devices = tuple(p for p in parts if p is not None)
    else:
        n = parse_usize(doors.stages or "")
        devices = (primary_dev,) * (n if n is not None and n >= 2 else 2)
    n_env = parse_usize(doors.stages or "")
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
