"""The pipeline runtime: stages, boundaries and the transports between them.

    StageRt      one stage: its device, its own stream (CUDA, unless MEMRA_PP_STREAMS=0), its layer
                 range and a worker thread for the bodies that run stages concurrently.
    BoundaryRt   between stage b and b+1: TWO persistent, grow-only slots, each with a TX and an RX
                 event (device ordering) and a host-side handoff (issue ordering), and a step
                 counter that alternates the slots for pipelined bodies.
    Transport    how bytes cross: Local (same device), Peer (device-to-device copy), HostBounce
                 (device -> staging host buffer -> device, sized n_embd x PRIME_CHUNK_MAX_TOKENS).

Why slots are persistent: a slot is written on the TX stage's stream and read on the RX stage's.
Allocating per step would free memory on one stream while the other may still read it. Why slots
are grow-only: the payload width changes every tick in serving (B rows, prime chunks); growing to the
high-water mark allocates O(distinct widths) times. A fresh slot is made before any copy into it is
issued and the RX stream is synchronised once, so its zero-fill can never land after a TX copy.

Bits: a boundary copy moves bytes unchanged, and every stage runs the same kernels on the same bytes
in the same order as the unsplit walk, so a split walk is bit-identical to the unsplit one (E2).
"""

from __future__ import annotations

import contextlib
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from memra import counters
from memra.cache import PRIME_CHUNK_MAX_TOKENS
from memra.pp.fence import BoundaryTransport, PipelineError, PpDoors, PpPlacement, StageFence

HANDOFF_TIMEOUT_S = 120.0  # a stage that never hands off is a bug; fail loudly instead of hanging


class Handoff:
    """Host-side ordering of one slot between one producer and one consumer: TX may fill the slot
    only after the previous RX drained it, RX may read only after TX filled it. (CUDA events order
    the devices; this orders the host threads that enqueue on them, so a wait is never enqueued
    before the event it waits on was recorded.)"""

    def __init__(self, abort: threading.Event | None = None):
        self._free = threading.Semaphore(1)
        self._full = threading.Semaphore(0)
        self._abort = abort or threading.Event()

    def _take(self, sem: threading.Semaphore, what: str) -> None:
        waited = 0.0
        while not sem.acquire(timeout=0.05):  # wake up to notice a sibling stage that failed
            waited += 0.05
            if self._abort.is_set():
                raise PipelineError(f"pipeline body aborted while {what}: another stage failed")
            if waited >= HANDOFF_TIMEOUT_S:
                raise PipelineError(f"pipeline boundary stalled: {what} waited {HANDOFF_TIMEOUT_S:.0f}s")

    def tx_begin(self) -> None:
        self._take(self._free, "TX for the slot to drain")

    def tx_end(self) -> None:
        self._full.release()

    def rx_begin(self) -> None:
        self._take(self._full, "RX for the slot to fill")

    def rx_end(self) -> None:
        self._free.release()


@dataclass
class BoundarySlot:
    handoff: Handoff = field(default_factory=Handoff)  # the runtime replaces it with one tied to its abort flag
    buf: torch.Tensor | None = None  # uint8, on the RX device, grow-only
    host: torch.Tensor | None = None  # uint8 staging for host bounce (pinned under CUDA)
    ev_tx: torch.cuda.Event | None = None
    ev_rx: torch.cuda.Event | None = None
    shape: tuple = ()
    dtype: torch.dtype = torch.float32


# --- transports ----------------------------------------------------------------------------------


class LocalTransport:
    """Both stages on one device: one device copy into the slot."""

    kind = BoundaryTransport.LOCAL

    def send(self, payload: torch.Tensor, slot: BoundarySlot) -> None:
        slot.buf[: payload.numel()].copy_(payload, non_blocking=True)

    def receive(self, slot: BoundarySlot, n: int) -> torch.Tensor:
        return slot.buf[:n]


class PeerTransport(LocalTransport):
    """Cross-device: a device-to-device copy issued on the sending stage's stream (the slot lives
    on the receiving device)."""

    kind = BoundaryTransport.PEER

    def send(self, payload: torch.Tensor, slot: BoundarySlot) -> None:
        super().send(payload, slot)
        counters.bump("pp_peer_boundary_copies")


class HostBounceTransport:
    """Cross-device without trusting the peer path: D2H into host staging on the sending stream,
    then H2D on the receiving stream after it has waited for the TX event."""

    kind = BoundaryTransport.HOST_BOUNCE

    def send(self, payload: torch.Tensor, slot: BoundarySlot) -> None:
        n = payload.numel()
        if n > slot.host.numel():
            raise PipelineError(f"host-bounce payload of {n} bytes exceeds the staging capacity of {slot.host.numel()} "
                                f"bytes (n_embd x {PRIME_CHUNK_MAX_TOKENS} tokens)")
        slot.host[:n].copy_(payload, non_blocking=True)

    def receive(self, slot: BoundarySlot, n: int) -> torch.Tensor:
        slot.buf[:n].copy_(slot.host[:n], non_blocking=True)
        return slot.buf[:n]


def make_transport(kind: BoundaryTransport):
    return {BoundaryTransport.LOCAL: LocalTransport, BoundaryTransport.PEER: PeerTransport,
            BoundaryTransport.HOST_BOUNCE: HostBounceTransport}[kind]()


# --- stages and boundaries ------------------------------------------------------------------------


def stage_devices(model_device: torch.device, placement_devices: tuple[int, ...], streams: bool) -> list[torch.device]:
    """The device each stage runs on: its placement's CUDA index, except that MEMRA_PP_STREAMS=0 (the
    single-stream rollback) keeps every stage on the model's device, as it keeps every weight and cache
    there (fence.pp_sharded_cross_device); a stage elsewhere would compute on home weights from a
    device that is not current. On CPU every stage is the model's device."""
    if model_device.type != "cuda" or not streams:
        return [model_device] * len(placement_devices)
    return [torch.device("cuda", d) for d in placement_devices]


@dataclass
class StageRt:
    index: int
    device: torch.device
    layers: tuple[int, int]  # [start, stop) of the decoder layers this stage runs
    stream: torch.cuda.Stream | None  # None: CPU, or MEMRA_PP_STREAMS=0 (the caller's stream)
    worker: ThreadPoolExecutor

    def scope(self):
        """Everything issued inside runs on this stage's stream (per thread, as torch does)."""
        if self.stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self.stream)


@dataclass
class BoundaryRt:
    index: int  # between stage index and index + 1
    cross: bool
    transport: object
    slots: tuple[BoundarySlot, BoundarySlot]
    step: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def next_slot(self, alternate: bool) -> int:
        with self.lock:
            i = self.step % 2 if alternate else 0
            self.step += 1
            return i


class PendingLogits:
    """A step's logits still on the last stage's device. `wait()` orders the readback stream after
    the step's completion event, copies to the host and returns them; work enqueued after this step
    keeps running on the stage streams meanwhile."""

    def __init__(self, logits: torch.Tensor, event: torch.cuda.Event | None, stream: torch.cuda.Stream | None):
        self._logits, self._event, self._stream = logits, event, stream

    def wait(self) -> torch.Tensor:
        if self._stream is None:
            return self._logits.cpu()
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(self._event)
            host = self._logits.to("cpu", non_blocking=True)
            self._logits.record_stream(self._stream)
        self._stream.synchronize()
        return host


class PpRuntime:
    """One placement's pipeline: built once per (fence, placement, transport doors) and kept on the
    model. Holds no per-sequence state; caches come from `new_cache`."""

    def __init__(self, model, fence: StageFence, placement: PpPlacement, doors: PpDoors,
                 transports: tuple[BoundaryTransport, ...] | None = None):
        self.model, self.fence, self.placement, self.doors = model, fence, placement, doors
        cuda = model.device.type == "cuda"
        devices = stage_devices(model.device, placement.devices, doors.streams)
        use_streams = cuda and doors.streams
        self.stages = [
            StageRt(s, devices[s], fence.ranges[s], torch.cuda.Stream(devices[s]) if use_streams else None,
                    ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"memra-pp-stage{s}"))
            for s in range(fence.n_stages)
        ]
        # MEMRA_PP_STREAMS=0 keeps every stage home, so no boundary crosses a device
        kinds = transports or (placement.transports() if doors.streams else
                               (BoundaryTransport.LOCAL,) * (fence.n_stages - 1))
        cfg = model.cfg
        for i in range(cfg.n_layers):  # Gemma 4's shared KV is read in place: reader and owner on one device
            src = cfg.attn_of(i).kv_from
            if src is not None and devices[fence.stage_of(i)] != devices[fence.stage_of(src)]:
                raise PipelineError(f"layer {i} reads the K/V of layer {src}, on another device across the stage "
                                    f"fence {list(fence.bounds)}; choose cuts that keep them together (MEMRA_PP_SPLITS)")
        row_bytes = cfg.stream_width * torch.empty((), dtype=model.dtype).element_size()  # per-layer inputs ride too
        self.host_capacity = row_bytes * PRIME_CHUNK_MAX_TOKENS
        self.abort = threading.Event()  # set when a stage of a concurrent body fails
        self.boundaries = []
        for b, kind in enumerate(kinds):
            slots = (BoundarySlot(Handoff(self.abort)), BoundarySlot(Handoff(self.abort)))
            for sl in slots:
                if cuda:
                    sl.ev_tx, sl.ev_rx = torch.cuda.Event(), torch.cuda.Event()
                if kind is BoundaryTransport.HOST_BOUNCE:
                    sl.host = torch.empty(self.host_capacity, dtype=torch.uint8, pin_memory=cuda)
            self.boundaries.append(BoundaryRt(b, devices[b] != devices[b + 1], make_transport(kind), slots))
        last = self.stages[-1]
        self.readback = torch.cuda.Stream(last.device) if cuda else None
        self._active_lock = threading.Lock()
        self._active: dict[str, int] = {}
        from memra.pp import probe_policy

        self.reprobe = probe_policy.ReprobeState()  # runtime re-probe schedule (memra.pp.probe)
        self.latch = probe_policy.TransportLatch()  # one-way: native peer -> validated host bounce
        self.probe_lock = threading.Lock()

    def set_transport(self, b: int, kind: BoundaryTransport) -> None:
        """Carry boundary b over another transport from the next copy on (the runtime probe's latch
        to host bounce; tests use it to run host bounce and peer code paths on one device)."""
        bd = self.boundaries[b]
        if kind is BoundaryTransport.HOST_BOUNCE:
            for sl in bd.slots:
                if sl.host is None:
                    sl.host = torch.empty(self.host_capacity, dtype=torch.uint8,
                                          pin_memory=self.stages[b].device.type == "cuda")
        bd.transport = make_transport(kind)

    # --- placement ---
    @property
    def n_stages(self) -> int:
        return len(self.stages)

    def layer_devices(self) -> dict[int, torch.device]:
        """Which device owns each layer's state (MTP layers: the last stage's)."""
        n = self.model.cfg.n_layers
        out = {i: self.stages[self.fence.stage_of(i)].device for i in range(n)}
        out.update({n + j: self.stages[-1].device for j in range(self.model.cfg.n_mtp)})
        return out

    def new_cache(self, max_ctx: int):
        """A cache whose layer state lives on the stage that owns the layer, drawn from the model's pools
        for this placement."""
        if max_ctx > self.model.cfg.max_position:
            from memra.errors import MemraError

            raise MemraError(f"max_ctx {max_ctx} exceeds the model's {self.model.cfg.max_position} positions")
        return self.model.pools(self.layer_devices()).new_cache(max_ctx)

    # --- the boundary ---
    def _grow(self, slot: BoundarySlot, dst: StageRt, n: int) -> None:
        if slot.buf is None or slot.buf.numel() < n:
            slot.buf = torch.zeros(n, dtype=torch.uint8, device=dst.device)
            if dst.stream is not None:
                torch.cuda.synchronize(dst.device)  # the zero-fill may not land after a TX copy

    def tx(self, b: int, x: torch.Tensor, pipelined: bool = False) -> int:
        """Hand `x` (the residual leaving stage b, issued in stage b's scope) to stage b+1.
        Returns the slot used, for the paired rx(). Pipelined bodies always alternate slots;
        serial bodies alternate only under MEMRA_PP_OVERLAP."""
        bd = self.boundaries[b]
        i = bd.next_slot(pipelined or self.doors.overlap)
        self.tx_slot(b, x, i)
        return i

    def tx_slot(self, b: int, x: torch.Tensor, i: int) -> None:
        bd, src, dst = self.boundaries[b], self.stages[b], self.stages[b + 1]
        slot = bd.slots[i]
        slot.handoff.tx_begin()
        payload = x.contiguous().view(-1).view(torch.uint8)
        self._grow(slot, dst, payload.numel())
        if slot.ev_rx is not None:
            torch.cuda.current_stream(src.device).wait_event(slot.ev_rx)  # write after the last read
        slot.shape, slot.dtype = tuple(x.shape), x.dtype
        bd.transport.send(payload, slot)
        if slot.ev_tx is not None:
            slot.ev_tx.record(torch.cuda.current_stream(src.device))
            if src.stream is not None:
                x.record_stream(src.stream)
        counters.bump("pp_boundary_copies")
        slot.handoff.tx_end()

    def rx(self, b: int, i: int) -> torch.Tensor:
        """Receive slot i of boundary b (in stage b+1's scope): a fresh tensor owned by that stage."""
        bd, dst = self.boundaries[b], self.stages[b + 1]
        slot = bd.slots[i]
        slot.handoff.rx_begin()
        try:
            if slot.ev_tx is not None:
                torch.cuda.current_stream(dst.device).wait_event(slot.ev_tx)
            n = torch.Size(slot.shape).numel() * torch.empty((), dtype=slot.dtype).element_size()
            raw = bd.transport.receive(slot, n)
            work = raw.clone().view(slot.dtype).view(slot.shape)
            if slot.ev_rx is not None:
                slot.ev_rx.record(torch.cuda.current_stream(dst.device))
        finally:
            slot.handoff.rx_end()
        return work

    # --- publication across streams ---
    def publish_to(self, s: int, dst_stream: torch.cuda.Stream | None) -> None:
        """Order the caller's stream after everything stage s has enqueued (its results are read there)."""
        st = self.stages[s]
        if st.stream is None or dst_stream is None or st.stream == dst_stream:
            return
        dst_stream.wait_stream(st.stream)

    def fence_stages_behind(self, src_stream: torch.cuda.Stream | None) -> None:
        """Order every stage stream after the caller's stream, before a body enqueues new stage work
        (buffers the caller still reads may otherwise be reused by a stage's allocations)."""
        if src_stream is None:
            return
        for st in self.stages:
            if st.stream is not None and st.stream != src_stream:
                st.stream.wait_stream(src_stream)

    def defer(self, logits: torch.Tensor) -> PendingLogits:
        """Wrap last-stage logits for deferred readback (call in the last stage's scope)."""
        last = self.stages[-1]
        if last.stream is None and self.readback is None:
            return PendingLogits(logits, None, None)
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(last.device))
        return PendingLogits(logits, ev, self.readback)

    # --- liveness of concurrent stage sections ---
    @contextlib.contextmanager
    def section(self, kind: str):
        """Mark a stage section of a concurrent body; counts `<kind>` overlaps (a section that began
        while another of the same body was running): the proof the overlap was real."""
        with self._active_lock:
            if self._active.get(kind, 0) > 0:
                counters.bump(kind)
            self._active[kind] = self._active.get(kind, 0) + 1
        try:
            yield
        finally:
            with self._active_lock:
                self._active[kind] -= 1

    def run_concurrent(self, jobs):
        """Run one job per stage on the stages' worker threads (inference mode, as the caller) and
        return their results. If any fails, the others are woken and the slots reset, then the
        first error is raised — no hang, and the next body starts from empty slots."""
        def wrap(fn):
            def run():
                with torch.inference_mode():
                    return fn()
            return run

        futures = [st.worker.submit(wrap(job)) for st, job in zip(self.stages, jobs)]
        errors = []
        for f in futures:
            try:
                f.result()
            except BaseException as err:  # noqa: BLE001 - collected, re-raised below
                errors.append(err)
                self.abort.set()
        if errors:
            for f in futures:
                f.exception()
            self.abort.clear()
            for bd in self.boundaries:
                for sl in bd.slots:
                    sl.handoff = Handoff(self.abort)
            first = next((e for e in errors if not (isinstance(e, PipelineError) and "aborted" in str(e))), errors[0])
            raise first
        return [f.result() for f in futures]

    def close(self) -> None:
        for st in self.stages:
            st.worker.shutdown(wait=False)
