"""Weight updates on a serving engine: no request sees two versions of the weights.

    fut = engine.weight_swaps.submit(prepared, abort=False)   # any thread; prepared by memra.weights.update

Default (drain): from the step the update is seen, no waiting request starts and new ones queue behind it;
the sequences already started run to their end on the old weights. When none is left (and no token is in
flight), the update lands on the engine's thread between two steps (memra.weights.update.apply), the prefix
cache is dropped (its pages were primed by the old weights), and the queue runs on the new weights.
With abort=True the started sequences end at once, after the tokens already computed for them, each with
finish_reason "abort" (no error: the answer so far is whole); the requests that had not started run after
the update. Nothing is lost and nothing fails; a scoring job runs whole on one side of the update.
"""

from __future__ import annotations

from concurrent.futures import Future

from memra.engine.seq_state import queue_seqs
from memra.weights.update import Prepared, apply


class WeightSwaps:
    def __init__(self, engine):
        self.engine = engine
        self._pending: list[tuple[Prepared, bool, Future]] = []
        self.held: list[list] = []  # "add" commands that came while an update waits (engine._drain_commands)

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    def __len__(self) -> int:
        return len(self._pending)

    def submit(self, prepared: Prepared, abort: bool = False) -> Future:
        """Queue an update (any thread). -> a Future of the new weights version."""
        e = self.engine
        with e._lock:
            e._check_open()
            fut: Future = Future()
            self._pending.append((prepared, abort, fut))
        e._wake.set()
        return fut

    def advance(self) -> None:
        """On the engine thread, before scheduling: hold admission, end or wait out the started sequences,
        and land the update once none is left."""
        e = self.engine
        if not self._pending:
            return
        prepared, abort, fut = self._pending[0]
        e.scheduler.admitting = False
        if abort:
            e._land()  # the tokens already computed reach their readers first
            for s in self._started():
                e._finish(s, "abort")
        if self._started() or e._inflight is not None:
            return
        try:
            version = apply(e.model, prepared)
            e.backend.prefix.clear()
            if e.metrics is not None:
                e.metrics.weights_version.set(version)
            fut.set_result(version)
        except BaseException as err:  # copy_ between tensors of checked shapes: a bug if it fails
            fut.set_exception(err)
            raise
        finally:
            self._pending.pop(0)
            if not self._pending:
                e.scheduler.admitting = True
                held, self.held = self.held, []
                for seqs in held:
                    queue_seqs(e, seqs)
            # the waiting requests' cache lookups were made against the dropped pages: made again now
            e.backend.prefix.offer(e.scheduler, e.seqs)

    def _started(self) -> list:
        return [s for s in self.engine.seqs.values() if s.cache is not None or s.swapped is not None or s.out]

    def fail_all(self, err: BaseException) -> list:
        """The engine stops: pending updates fail; -> the held requests' sequences (the caller aborts them)."""
        pending, self._pending = self._pending, []
        for _, _, fut in pending:
            if not fut.done():
                fut.set_exception(err)
        held, self.held = self.held, []
        return [s for seqs in held for s in seqs]
