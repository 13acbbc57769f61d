"""The continuous-batching scheduler: per engine step, who prefills how much, who decodes, who is
swapped out and who resumes.

Pure Python and deterministic (no torch, no clock, no randomness), so it is unit-tested without a
model. The engine calls `schedule()`, executes the `StepPlan` (swap_out, then swap_in, then the
prefill chunks and one decode token per decode rid), and reports with `step_done()`.

Policy
------
Accounting. The scheduler counts KV blocks and recurrent slots; the engine's pools must hold at
least `total_blocks` blocks and `total_slots` slots, and the counts here never exceed them. A RUNNING
sequence holds ceil(in_cache / block_size) blocks, where in_cache = prefilled + max(generated - 1, 0)
(the newest sampled token is not fed yet). `schedule()` reserves the blocks the step will write (a
prefill chunk, or 1 token for a decode); `step_done()` trims back to what was really written. A
speculating decode row may write more than its one token (its verify's drafts): the engine asks
`reserve_extra` during the step, which grants what the free blocks allow. Every RUNNING sequence
holds one recurrent slot; WAITING and SWAPPED sequences hold neither blocks nor a slot (a swapped
one's state is on the host, which the engine owns). So the running set is capped by
min(max_running, total_slots).

One step, in this order:
1. Decode. Every RUNNING sequence that is fully prefilled and has sampled >= 1 token decodes one
   token, oldest first, 1 budget token each (if the budget runs out the youngest wait a step). When a
   decode needs a block and none is free, the RUNNING sequence with the latest arrival is swapped out
   (possibly the one asking, if it is the latest), repeatedly, until the block fits. Latest-first
   means the oldest sequence always makes progress; a preempted sequence does not run this step.
2. Prefill of RUNNING sequences still in their prompt, oldest first, each one chunk (below). If a
   chunk that the budget allows gets no block at all, that sequence swaps out younger RUNNING
   sequences that are not scheduled this step (latest first) until some chunk fits — otherwise
   prefillers that hold every block between them would wait for each other for ever.
3. Resume SWAPPED sequences, oldest first, then admit WAITING ones in the queue's order (first come first
   served, or longest output first: memra.engine.admission.enqueue). Each
   needs room in the running set (which is also a free slot), the budget for its step, and the blocks
   for its whole cache plus what the step writes. Resumed sequences run in this very step: the engine
   swaps them in before running it, so a resumed decoder is in `decode` and a resumed prefiller in
   `prefill` (swap_in is always a subset of the rids that run). This phase is strictly ordered: at the
   first candidate that cannot start, it stops, so a waiting request is never admitted while an older
   swapped one cannot resume, and nobody passes the queue's head. It is skipped entirely when this step
   preempted anything (memory is short: resuming would only thrash) or when a RUNNING prefiller could
   not be scheduled (new work would keep taking the budget and blocks it waits for).
   A consequence: running + swapped never exceeds the running-set cap (admission happens only when
   no swapped sequence is left), so host memory for swapped state is bounded too. Waiting requests
   may be held a few steps so that several start in one prefill (`grouping`: memra.engine.admission).

Split budget (`prefill_budget` P; None: one budget, decode rows charged first, so a wide batch starves
prefill). With P set, decode rows (and resumed decoders) are charged to token_budget and every prefill
chunk to P, whatever the decode rows took: each step prefills up to P tokens, never more. P at the largest
captured mixed-step bucket, and at most max_pieces chunks a step, keep every mixed step a graph replay.

Preemption off (`preemption=False`). For an engine that cannot swap (a pipeline whose stages live in
other processes): the caller sizes total_blocks for every running sequence's whole context
(max_running x blocks of the longest sequence), so no step ever needs a victim, and `schedule()`
raises RuntimeError at the point where it would have to swap one out instead of planning a swap the
engine cannot carry out (fail closed: a broken sizing stops the engine loudly, it never corrupts).

Prefill chunks. A sequence at `start` with budget b and room for r more tokens in its blocks plus the free
ones: n = min(prompt_len - start, b, r); if start + n < prompt_len, start + n is rounded down to a multiple
of prefill_align; if that leaves n <= 0 it is not scheduled this step (nor once max_pieces chunks are). Every
cut lands on an absolute multiple of prefill_align or on the prompt end, which the engine's exactness relies
on (E5). The chunk that reaches the prompt end samples the sequence's first token.

Prefix cache: a WAITING request may start at a cached aligned cut (still counted as holding its whole cache's
blocks), end chunks at `stops`, or be `held` at the queue's head (memra.engine.prefix_hooks).

Liveness. Whenever anything is RUNNING, the oldest RUNNING sequence (or, when it is a prefiller blocked by the
budget, the decoders ahead of it) makes progress each step; when nothing is RUNNING the oldest swapped sequence
or the waiting queue's head starts with the whole pool (add() refuses a request whose prompt_len + max_tokens
cannot fit it). Swapping loses no work, so every request finishes.

Finished and cancelled sequences are forgotten at once (memory stays bounded for a long-running server): `get()`
raises KeyError for them and the rid may be reused. Reports about a rid cancelled while its step was in flight
are ignored. A sequence that reaches max_tokens is finished by the scheduler even if the engine did not list it,
so a missed report cannot overrun the block bound.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from memra.engine.admission import PrefillGrouping, enqueue
from memra.engine.prefix_hooks import PrefixHooks
from memra.engine.scheduled import Sequence, Status, StepPlan


class QueueFull(Exception):
    """add() when the waiting queue is at its bound: the server answers 429 instead of queueing without limit."""


@dataclass(frozen=True)
class SchedulerConfig:
    max_running: int = 32  # sequences in the running set (prefilling or decoding) at once
    token_budget: int = 2048  # max tokens per step: decode tokens (1 per decoding seq) + prefill tokens
    prefill_align: int = 64  # chunk cuts land on absolute multiples of this (or the prompt end)
    max_waiting: int = 256  # bound on the waiting queue (never unbounded)
    block_size: int = 16  # KV tokens per block
    total_blocks: int = 1024  # KV blocks in the shared pool
    total_slots: int | None = None  # recurrent-state slots (hybrid models); None = unlimited (no GDN layers)
    preemption: bool = True  # False: never swap out; schedule() raises where it would have to (module docstring)
    grouping: PrefillGrouping = field(default_factory=PrefillGrouping)  # waiting requests held to start together
    prefill_budget: int | None = None  # prompt tokens a step, apart from decode rows (split budget); None: shared
    max_pieces: int | None = None  # prefill chunks a step at most (a captured mixed step's piece entries); None: any
    longest_first: bool = False  # waiting requests queued by max_tokens, most first (MEMRA_ADMISSION_ORDER=lof)

    def __post_init__(self) -> None:
        names = ["max_running", "token_budget", "prefill_align", "max_waiting", "block_size", "total_blocks"]
        names += [n for n in ("total_slots", "prefill_budget", "max_pieces") if getattr(self, n) is not None]
        for name, v in ((n, getattr(self, n)) for n in names):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"SchedulerConfig.{name} must be a positive integer, got {v!r}")
        if not isinstance(self.preemption, bool):
            raise ValueError(f"SchedulerConfig.preemption must be True or False, got {self.preemption!r}")
        for name in ("token_budget", "prefill_budget"):
            if (getattr(self, name) or self.prefill_align) < self.prefill_align:
                raise ValueError(
                    f"SchedulerConfig.{name} ({getattr(self, name)}) must be >= prefill_align ({self.prefill_align}): "
                    f"otherwise a prompt longer than the budget could never be cut on an aligned position")

    @property
    def max_admitted(self) -> int:
        """The running-set cap: each running sequence needs a recurrent slot as well as a place."""
        return self.max_running if self.total_slots is None else min(self.max_running, self.total_slots)


class Scheduler(PrefixHooks):
    """Owns the queue, the running set and the block/slot counts; see the module docstring for the policy."""

    def __init__(self, cfg: SchedulerConfig):
        self.cfg = cfg
        self._seqs: dict[str, Sequence] = {}  # every live sequence in arrival order (add() appends): oldest first
        self._waiting: deque[str] = deque()  # WAITING rids in admission order (SchedulerConfig.longest_first)
        self._free = cfg.total_blocks
        self._arrivals = 0
        # The plan in flight, until step_done: what each rid was told to do (checks the engine's report).
        self._planned_prefill: dict[str, int] = {}
        self._planned_decode: set[str] = set()
        self._extra: dict[str, int] = {}  # rid -> extra tokens reserve_extra granted it for the plan in flight
        self._in_flight = False
        self._held = 0  # steps the startable waiting requests have been held (memra.engine.admission)
        self.admitting = True  # False: no waiting request starts (memra.engine.weight_swap)

    # --- requests ---
    def add(self, rid: str, prompt_len: int, max_tokens: int) -> None:
        """Queue a request. ValueError if it is malformed, a live duplicate, or could never fit the pool;
        QueueFull when max_waiting requests are already waiting (a bad request is refused first)."""
        if prompt_len < 1 or max_tokens < 1:
            raise ValueError(f"{rid}: prompt_len and max_tokens must be >= 1, got {prompt_len} and {max_tokens}")
        if rid in self._seqs:
            raise ValueError(f"{rid}: a request with this id is already queued or running")
        need = -(-(prompt_len + max_tokens) // self.cfg.block_size)
        if need > self.cfg.total_blocks:
            raise ValueError(f"{rid}: {prompt_len} prompt + {max_tokens} new tokens need {need} KV blocks of "
                             f"{self.cfg.block_size} tokens, but the pool has {self.cfg.total_blocks}; shorten the prompt "
                             "or lower max_tokens")
        if len(self._waiting) >= self.cfg.max_waiting:
            raise QueueFull(f"{self.cfg.max_waiting} requests are already waiting; retry later")
        self._seqs[rid] = Sequence(rid, prompt_len, max_tokens, self._arrivals, Status.WAITING,
                                   block_size=self.cfg.block_size)
        self._arrivals += 1
        enqueue(self._waiting, rid, lambda r: self._seqs[r].max_tokens, self.cfg.longest_first)

    def cancel(self, rid: str) -> bool:
        """End a request in any state and free what it holds. -> whether it was known and unfinished."""
        seq = self._seqs.get(rid)
        if seq is None:
            return False
        self._finish(seq)
        return True

    # --- the step ---
    def schedule(self) -> StepPlan:
        if self._in_flight:
            raise RuntimeError("schedule() called before step_done() reported the previous plan")
        budget = self.cfg.token_budget
        prefill: list[tuple[str, int, int]] = []
        decode, swap_out, swap_in = [], [], []  # rids
        scheduled: set[str] = set()

        def preempt(victim: Sequence) -> None:
            if not self.cfg.preemption:
                raise RuntimeError(
                    f"{victim.rid}: the step needs a KV block swapped out but preemption is off; total_blocks "
                    f"({self.cfg.total_blocks}) must cover max_running x the longest sequence's blocks")
            self._free, victim.blocks, victim.status = self._free + victim.blocks, 0, Status.SWAPPED
            swap_out.append(victim.rid)

        # 1. Decode, oldest first; out of blocks -> swap out the latest arrival until the block fits.
        for seq in self._with(Status.RUNNING):
            if budget == 0:
                break
            if seq.status is not Status.RUNNING or not seq.decode_ready:
                continue
            while seq.blocks_needed(1) > seq.blocks + self._free:
                victim = max((s for s in self._with(Status.RUNNING) if s.blocks and s.rid not in scheduled),
                             key=lambda s: s.arrival)  # never empty: `seq` itself qualifies
                preempt(victim)
                if victim is seq:
                    break
            if seq.status is Status.RUNNING:
                self._reserve(seq, 1)
                decode.append(seq.rid)
                scheduled.add(seq.rid)
                budget -= 1

        # 2. Running prefillers, oldest first; one with no block at all swaps out younger idle ones.
        shared, blocked = self.cfg.prefill_budget is None, False
        pbudget = budget if shared else self.cfg.prefill_budget  # prompt tokens: what decode left, or apart
        for seq in self._with(Status.RUNNING):
            if seq.status is not Status.RUNNING or seq.prefill_done:
                continue
            n = self._chunk(seq, pbudget)
            if n == 0 and self._chunk(seq, pbudget, blocks=False) > 0:
                for victim in reversed(self._with(Status.RUNNING)):
                    if victim.arrival <= seq.arrival:
                        break
                    if victim.rid in scheduled or not victim.blocks:
                        continue
                    preempt(victim)
                    n = self._chunk(seq, pbudget)
                    if n:
                        break
            if n == 0:
                blocked = True
                continue
            prefill.append((seq.rid, seq.prefilled, n))
            self._reserve(seq, n)
            scheduled.add(seq.rid)
            pbudget = pbudget - n if len(prefill) != self.cfg.max_pieces else 0  # the last piece: no prompt tokens left

        # 3. Resume swapped (oldest first), then admit waiting (FCFS); stop at the first that cannot start.
        if not blocked and not swap_out:
            running = self.num_running()  # counted once (a walk over every sequence), then kept as they start
            startable = min(len(self._waiting), max(0, self.cfg.max_admitted - running))
            hold = self.cfg.grouping.holds(decoding=bool(decode), prefilling=bool(prefill), startable=startable,
                                           held=self._held)
            if hold:
                self._held += 1
            elif startable:  # they start now; with no place free the count waits as it is
                self._held = 0
            admit = not hold and self.admitting  # admitting: False while a weight update drains
            candidates = self._with(Status.SWAPPED) + ([self._seqs[rid] for rid in self._waiting] if admit else [])
            for seq in candidates:
                if running >= self.cfg.max_admitted or seq.held or len(prefill) == self.cfg.max_pieces:
                    break
                decoder = seq.decode_ready  # a swapped sequence preempted between tokens
                if decoder:
                    if (pbudget if shared else budget) < 1 or seq.blocks_needed(1) > self._free:
                        break
                    n = 1
                else:
                    n = self._chunk(seq, pbudget)
                    if n == 0:
                        break
                if seq.status is Status.SWAPPED:
                    swap_in.append(seq.rid)
                else:
                    self._waiting.popleft()  # candidates follow the queue's order
                seq.status = Status.RUNNING
                running += 1
                self._reserve(seq, n)
                if decoder:
                    decode.append(seq.rid)
                else:
                    prefill.append((seq.rid, seq.prefilled, n))
                scheduled.add(seq.rid)
                budget, pbudget = (budget - n, pbudget) if decoder and not shared else (budget, pbudget - n)

        self._planned_prefill = {rid: n for rid, _, n in prefill}
        self._planned_decode = set(decode)
        self._in_flight = bool(prefill or decode)
        return StepPlan(prefill, decode, swap_out, swap_in)

    def reserve_extra(self, rid: str, tokens: int) -> int:
        """A decode row of the plan in flight will write up to `tokens` more positions this step than its
        one (a speculative verify: its last token and `tokens` drafts). Reserves the blocks for as many
        as fit in its own blocks' slack and the free ones, never beyond max_tokens. -> how many were
        granted (0..tokens); step_done gives back whatever was not written."""
        seq = self._seqs.get(rid)
        if seq is None or rid not in self._planned_decode:
            raise ValueError(f"{rid}: reserve_extra is for a decode row of the plan in flight")
        n = max(0, min(tokens, seq.max_tokens - seq.generated - 1))
        while n and seq.blocks_needed(1 + n) > seq.blocks + self._free:
            n -= 1
        self._reserve(seq, 1 + n)
        self._extra[rid] = n
        return n

    def step_done(self, prefilled: dict[str, int], sampled: list[str], finished: list[str],
                  extra: dict[str, int] | None = None) -> list[str]:
        """The engine's report on the plan in flight.

        prefilled: rid -> prompt tokens written this step (the planned chunk; a planned rid left out
        made no progress); sampled: rids that got one new token (a completed prefill samples its
        first); extra: rid -> tokens it got beyond that one (a speculative verify; at most what
        reserve_extra granted); finished: rids that are done (EOS / max_tokens / stop string) and are
        freed. Reports about rids no longer live (cancelled during the step) are ignored. Everything is
        checked before anything changes, so a bad report leaves it as it was. -> the rids freed at
        max_tokens now."""
        extra = {rid: n for rid, n in (extra or {}).items() if n and rid in self._seqs}
        for rid, n in extra.items():
            if not 0 < n <= self._extra.get(rid, 0) or rid not in sampled:
                raise ValueError(f"{rid}: reported {n} extra tokens, reserve_extra granted {self._extra.get(rid, 0)}")
        live = self._seqs
        grown: dict[str, int] = {}
        for rid, n in prefilled.items():
            if rid not in live or n == 0:
                continue
            planned = self._planned_prefill.get(rid, 0)
            if n != planned:  # a partial chunk could end off the alignment grid
                raise ValueError(f"{rid}: reported {n} prefilled tokens, the plan said {planned}")
            grown[rid] = n
        if len(set(sampled)) != len(sampled):
            raise ValueError(f"a rid is reported sampled twice in one step: {sampled}")
        completes = {rid for rid, n in grown.items() if live[rid].prefilled + n == live[rid].prompt_len}
        for rid in sampled:
            if rid in live and rid not in self._planned_decode and rid not in completes:
                raise ValueError(f"{rid}: reported sampled, but it neither decoded nor completed its prefill this step")
        unsampled = sorted(completes - set(sampled) - set(finished))
        if unsampled:  # it would sit prefilled with no token to feed, neither prefilling nor decoding
            raise ValueError(f"{unsampled[0]}: its prefill completed but no first token was reported sampled")
        for rid, n in grown.items():
            live[rid].prefilled += n
        for rid in (r for r in sampled if r in live):
            live[rid].generated += 1 + extra.get(rid, 0)
        for rid in (r for r in finished if r in live):
            self._finish(live[rid])
        ended = []  # reached max_tokens with this step
        for rid in list(self._planned_prefill) + list(self._planned_decode):
            seq = live.get(rid)
            if seq is None:
                continue
            if seq.generated >= seq.max_tokens:
                self._finish(seq)
                ended.append(rid)
                continue
            keep = seq.blocks_needed(0)  # give back what was reserved but not written
            self._free += seq.blocks - keep
            seq.blocks = keep
        self._planned_prefill, self._planned_decode, self._in_flight, self._extra = {}, set(), False, {}
        return ended

    # --- views ---
    def free_blocks(self) -> int:
        return self._free

    def free_slots(self) -> int | None:
        return None if self.cfg.total_slots is None else self.cfg.total_slots - self.num_running()

    def num_running(self) -> int:
        # list(): one C call, so a server thread's submit() may count while the engine thread adds or ends one
        return sum(s.status is Status.RUNNING for s in list(self._seqs.values()))

    def num_waiting(self) -> int:
        """Waiting includes SWAPPED: both are requests not running now."""
        return len(self._seqs) - self.num_running()

    def get(self, rid: str) -> Sequence:
        """A live sequence; KeyError for an unknown, finished or cancelled rid."""
        return self._seqs[rid]

    @property
    def kv_usage(self) -> float:
        """Used blocks / total (reservations for the step in flight count as used)."""
        return (self.cfg.total_blocks - self._free) / self.cfg.total_blocks

    # --- internals ---
    def _with(self, status: Status) -> list[Sequence]:
        """A snapshot, oldest first: callers change statuses while iterating."""
        return [s for s in self._seqs.values() if s.status is status]

    def _chunk(self, seq: Sequence, budget: int, *, blocks: bool = True) -> int:
        """Prompt tokens `seq` may prefill now: the rule in the module docstring (0 = not this step)."""
        room = budget
        if blocks:  # its own blocks' slack plus every free block (a swapped/waiting one holds none)
            room = min(room, (seq.blocks + self._free) * self.cfg.block_size - seq.in_cache)
        end = seq.prefilled + max(0, min(seq.prompt_len - seq.prefilled, room))
        end = min([end] + [s for s in seq.stops if s > seq.prefilled])  # stops are aligned: the rule holds
        if end < seq.prompt_len:
            end -= end % self.cfg.prefill_align
        return max(0, end - seq.prefilled)

    def _reserve(self, seq: Sequence, tokens: int) -> None:
        need = seq.blocks_needed(tokens)
        extra = need - seq.blocks
        assert extra <= self._free, f"{seq.rid}: reserving {extra} blocks with {self._free} free"
        if extra > 0:
            self._free -= extra
            seq.blocks = need

    def _finish(self, seq: Sequence) -> None:
        if seq.status is Status.WAITING:
            self._waiting.remove(seq.rid)
        self._free += seq.blocks
        seq.blocks = 0
        seq.status = Status.FINISHED
        del self._seqs[seq.rid]
        self._planned_prefill.pop(seq.rid, None)
        self._planned_decode.discard(seq.rid)
