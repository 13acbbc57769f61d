"""The scheduler's hooks for the prefix cache (memra.prefix), which the engine calls before it schedules.

A WAITING request whose first `cached` prompt tokens are in the prefix cache starts there; it is still
counted as holding the blocks of its whole cache (the cached ones are shared with the cache, so real use
is never more). Its `stops` are aligned positions where a prefill chunk must end (the prefix cache
snapshots recurrent state there); the cut rule stays (every cut aligned or the prompt end). A `held`
request waits at the head of the queue for a running prime of its prefix, which then serves it (FCFS:
nobody behind it starts meanwhile; the prime in flight always progresses, so the hold ends). A held
request whose prompt is the very prompt in flight is forked from it when that prime ends (n > 1 choices,
identical prompts): it starts prefilled, sampling its first token from the same last-position logits.
"""

from __future__ import annotations

from itertools import islice

from memra.engine.scheduled import Status


class PrefixHooks:
    """Mixed into memra.engine.scheduler.Scheduler (its `cfg`, `_seqs`, `_waiting`, `num_running`)."""

    def waiting_head(self) -> list[str]:
        """The WAITING rids that could start this step, in queue order (as many as places are free)."""
        places = max(0, self.cfg.max_admitted - self.num_running())
        return list(islice(self._waiting, places))  # a deque's index is O(i): walking it so was O(places^2)

    def set_cached(self, rid: str, cached: int, stops: tuple[int, ...], held: bool) -> None:
        seq = self._seqs[rid]
        if seq.status is not Status.WAITING:
            raise ValueError(f"{rid}: only a waiting request's cached prefix can be set")
        if not 0 <= cached < seq.prompt_len or cached % self.cfg.prefill_align:
            raise ValueError(f"{rid}: a cached prefix must be an aligned cut inside the prompt, got {cached}")
        if any(s % self.cfg.prefill_align or not cached < s <= seq.prompt_len for s in stops):
            raise ValueError(f"{rid}: chunk stops must be aligned cuts after the cached prefix, got {stops}")
        seq.prefilled, seq.stops, seq.held = cached, tuple(sorted(stops)), held

    def add_stop(self, rid: str, pos: int) -> None:
        """Also end a chunk of this (running) prefill at `pos`, an aligned cut ahead of it."""
        seq = self._seqs.get(rid)
        if seq is not None and pos % self.cfg.prefill_align == 0 and seq.prefilled < pos <= seq.prompt_len:
            seq.stops = tuple(sorted({*seq.stops, pos}))

    def fork(self, rid: str) -> bool:
        """Start a WAITING request whose prompt another one has just primed, in the step in flight, as that
        prompt's copy: fully prefilled, its first token sampled this step (it then counts as a decoder of
        this plan). -> False (nothing changed) when it has no place or blocks now; it then starts as usual."""
        seq = self._seqs.get(rid)
        if seq is None or seq.status is not Status.WAITING or self.num_running() >= self.cfg.max_admitted:
            return False
        if -(-seq.prompt_len // self.cfg.block_size) > self._free:
            return False
        seq.prefilled, seq.generated = seq.prompt_len, 0
        self._waiting.remove(rid)
        seq.status, seq.held = Status.RUNNING, False
        self._reserve(seq, 0)
        self._planned_decode.add(rid)
        return True
