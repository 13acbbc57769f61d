"""The engine's step clock: what sits between two steps, on the host and on the device.

The engine launches step n's forwards and sampling and returns; step n+1 is scheduled, prepared and
launched while the GPU runs step n (memra.engine.inflight). The GPU stays busy only while the host's
work between two launches is shorter than a step's kernels. The clock measures both sides:

- host gap: perf_counter from a step's last launch (`launched`) to the next step's first (`launching`):
  landing the last step's tokens, the readers' events, scheduling, page tables. On CPU this is what
  the report shows.
- device idle: on CUDA, an event recorded on the stream at each step's first launch and one after its
  last. Event n+1's start minus event n's end is how long the stream sat empty, waiting for the host
  (0 when step n+1 was queued before step n ended).
- device wait: within a step, the sampling is launched only after the last step's tokens have landed
  (their events, the sequences that ended: the penalties and seeds need them). An event before the
  landing and one after it: their difference is how long the stream sat empty between the step's
  forward and its sampling while the host landed (0 when the forward was still running).

Four events a step, no sync in the loop: each step reads the events that have passed (Event.query), and
`flush` (the report's end) waits for the rest. A step after the engine idled (an empty plan) has neither
gap: its wait is for requests, not for the host.
"""

from __future__ import annotations

import time
from collections import deque

import torch

from memra.engine.step_mix import StepMix


class StepClock:
    def __init__(self, device: torch.device):
        self.mix = StepMix()
        self.cuda = device.type == "cuda"
        self._last_launch: float | None = None  # host time of the previous step's last launch
        self._gap: float | None = None  # this step's host gap, from launching() to done()
        self._start: torch.cuda.Event | None = None
        self._prev_end: torch.cuda.Event | None = None
        self._pending: deque = deque()  # (kind, start, end, previous end, landing) whose times are not read yet
        self._landing: tuple | None = None  # this step's events around the landing

    def launching(self) -> None:
        """The step's first device work is about to be queued."""
        self._gap = None if self._last_launch is None else time.perf_counter() - self._last_launch
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()

    def land(self, land) -> None:
        """Run land() (the last step's tokens to the host), timing on the device the stream's wait for it."""
        if not self.cuda or self._start is None:
            land()
            return
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record()
        land()
        after.record()
        self._landing = (before, after)

    def launched(self) -> None:
        """The step's last device work is queued."""
        self._last_launch = time.perf_counter()

    def done(self, plan, t0: float) -> tuple[str, float]:
        """Record the step (its plan, its start t0 on perf_counter) in the mix. -> (its kind, its seconds)."""
        kind = "mixed" if plan.prefill and plan.decode else "prefill" if plan.prefill else "decode"
        seconds = time.perf_counter() - t0
        self.mix.add(kind, len(plan.decode), sum(n for _, _, n in plan.prefill), seconds, self._gap)
        if self.cuda and self._start is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._pending.append((kind, self._start, end, self._prev_end, self._landing))
            self._start, self._prev_end, self._landing = None, end, None
            self._read(wait=False)
        return kind, seconds

    def idle(self) -> None:
        """An empty plan: the next step's wait is for work, not for the host."""
        self._last_launch = self._prev_end = None

    def flush(self) -> None:
        """Wait for the steps in flight and read every device time (at a report's end, not in the loop)."""
        self._read(wait=True)

    def _read(self, wait: bool) -> None:
        while self._pending and (wait or self._pending[0][2].query()):
            kind, start, end, prev, landing = self._pending.popleft()
            if wait:
                end.synchronize()
            idle = None if prev is None else max(0.0, prev.elapsed_time(start) / 1e3)
            waited = 0.0 if landing is None else max(0.0, landing[0].elapsed_time(landing[1]) / 1e3)
            self.mix.add_device(kind, idle, start.elapsed_time(end) / 1e3, waited)
