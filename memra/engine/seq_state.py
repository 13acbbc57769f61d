"""The engine's state of one sequence (one choice of one request), from submit to its last event."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from memra.cache import Cache
from memra.engine.sampler import RowSpec
from memra.engine.scheduler import QueueFull
from memra.engine.types import TokenEvent
from memra.sampling import SamplingParams
from memra.structured import compile_for


@dataclass
class SeqState:
    """What the engine knows of one sequence: its request, its output so far, where its cache is."""

    rid: str
    index: int
    prompt: list[int]
    params: SamplingParams
    logprobs: int | None
    eos: frozenset[int]
    sink: Callable[[TokenEvent], None]
    arrival: float = field(default_factory=time.perf_counter)
    out: list[int] = field(default_factory=list)
    cache: Cache | None = None
    swapped: dict | None = None  # host copies while preempted
    last_token_at: float | None = None
    done: bool = False
    row: RowSpec | None = None  # what the sampler needs (shares `prompt` and `out`)
    spec: object | None = None  # its drafter state when it speculates (memra.engine.speculation.SpecSeq)
    cached: int = 0  # prompt tokens served from the prefix cache
    prefix: object | None = None  # its memra.prefix.serving.PrefixState, where the prefix cache is on

    def __post_init__(self) -> None:
        self.row = RowSpec(self.params, self.prompt, self.out, self.logprobs, stop_ids=self.eos)

    def start(self, spec, model) -> None:
        """Its drafter, where `spec` (the engine's speculation) drafts for it, and its grammar state, where its
        output is constrained: compiled on the caller's thread (submit's; the server compiles on its pool
        first), cached by the constraint. A constrained sequence decodes plainly: a draft would need the
        grammar's mask at every column. A complete grammar allows only EOS next, so it ends as any answer does."""
        so = self.params.structured_outputs
        self.row.grammar = compile_for(model.tokenizer, so).start() if so is not None else None
        self.spec = spec.start(self.params) if spec is not None and so is None else None

    def swap_out(self, backend) -> bool:
        """Preempted: its cache to host copies (the backend's, byte for byte), freed on the device.
        -> whether there was a cache to keep (none before its first prefill chunk)."""
        if self.cache is None:
            self.swapped = {"empty": True}
            return False
        self.swapped, self.cache = backend.swap_out(self.cache), None
        return True

    def swap_in(self, backend, max_ctx: int, new_cache) -> None:
        """Resumed: its cache back from the host copies, or a new one (`new_cache(self)`) where there were none."""
        saved, self.swapped = self.swapped, None
        self.cache = new_cache(self) if saved is None or saved.get("empty") else backend.swap_in(saved, max_ctx)


def queue_seqs(engine, seqs) -> None:
    """A request's sequences into the engine's scheduler and table (a refused one ends at once with its error)."""
    for s in seqs:
        try:
            engine.scheduler.add(s.rid, len(s.prompt), s.params.max_tokens)
        except (ValueError, QueueFull) as err:  # cannot fit this pool, or raced past the bound
            s.done = True
            s.sink(TokenEvent(s.index, None, finish_reason="abort", error=str(err), error_kind="refused"))
            continue
        engine.seqs[s.rid] = s
