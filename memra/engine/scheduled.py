"""What the scheduler keeps of each request (`Sequence`, its `Status`) and what it hands the engine for
one step (`StepPlan`); the policy that moves them is memra.engine.scheduler's."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Status(enum.Enum):
    WAITING = "waiting"  # queued, never admitted; holds nothing
    RUNNING = "running"  # admitted: holds its blocks and a recurrent slot
    SWAPPED = "swapped"  # preempted: its state is on the host; holds nothing here
    FINISHED = "finished"  # done or cancelled; forgotten by the scheduler


@dataclass
class Sequence:
    """The scheduler's view of one request (the engine owns tokens and tensors)."""

    rid: str
    prompt_len: int
    max_tokens: int
    arrival: int  # monotonically increasing admission order
    status: Status
    prefilled: int = 0  # prompt tokens already in the cache
    generated: int = 0  # tokens sampled so far (the first comes from the last prefill chunk)
    blocks: int = 0  # KV blocks held (reserved for the step in flight, between schedule and step_done)
    block_size: int = 16  # copied from the config so blocks_needed needs no arguments beyond the tokens
    stops: tuple[int, ...] = ()  # aligned positions a prefill chunk must end at (prefix-cache snapshots)
    held: bool = False  # waiting for a running prime of its prefix (memra.prefix): admission stops here

    @property
    def in_cache(self) -> int:
        """Tokens in the KV cache: the newest sampled token is not fed until the next decode."""
        return self.prefilled + max(self.generated - 1, 0)

    @property
    def prefill_done(self) -> bool:
        return self.prefilled >= self.prompt_len

    @property
    def decode_ready(self) -> bool:
        """Fully prefilled, has a sampled token to feed, and not yet at max_tokens."""
        return self.prefill_done and 1 <= self.generated < self.max_tokens

    def blocks_needed(self, extra_tokens: int = 0) -> int:
        """Blocks this sequence must hold for its cache plus `extra_tokens` more (a total, not a delta)."""
        return -(-(self.in_cache + extra_tokens) // self.block_size)


@dataclass(frozen=True)
class StepPlan:
    prefill: list[tuple[str, int, int]]  # (rid, start position, n tokens), cuts aligned (module docstring)
    decode: list[str]  # rids that decode one token (fully prefilled, generated >= 1)
    swap_out: list[str]  # preempt BEFORE the step: the engine copies KV + recurrent state to host and frees it
    swap_in: list[str]  # resume BEFORE the step: the engine copies the state back (they run in this step)

    @property
    def empty(self) -> bool:
        return not (self.prefill or self.decode or self.swap_out or self.swap_in)
