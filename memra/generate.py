"""Offline generation for one sequence: prime the prompt, then decode token by token.

The server's continuous-batching engine (later) produces the same tokens; this is the simple loop
the CLI and the tests use.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

from memra.errors import ContextOverflowError, MemraError
from memra.sampling import SamplingParams, apply_penalties, sample


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    finish_reason: str = ""  # "stop" (end-of-sequence token) | "length" (max_tokens)
    token_ids: list[int] = field(default_factory=list)

    @property
    def decode_tokens_per_second(self) -> float:
        steps = max(self.generated_tokens - 1, 0)  # the first token comes from the prefill
        return steps / self.decode_seconds if self.decode_seconds > 0 else 0.0


def generate_tokens(model, prompt_ids: Sequence[int], params: SamplingParams, stats: GenerationStats | None = None,
                    eos_ids: Sequence[int] = ()) -> Iterator[int]:
    """Yield generated token ids until an end-of-sequence id or params.max_tokens."""
    stats = stats if stats is not None else GenerationStats()
    stats.prompt_tokens = len(prompt_ids)
    if not prompt_ids:
        raise MemraError("the prompt is empty after tokenization")
    need = len(prompt_ids) + params.max_tokens
    limit = model.cfg.max_position
    if len(prompt_ids) >= limit:
        raise ContextOverflowError(f"the prompt has {len(prompt_ids)} tokens; the model's context is {limit}")
    cache = model.new_cache(min(need, limit))
    t0 = time.perf_counter()
    logits = model.prime(prompt_ids, cache)
    stats.prefill_seconds = time.perf_counter() - t0
    t0 = time.perf_counter()
    stop = set(eos_ids)
    prompt = list(prompt_ids)
    try:
        for step in range(params.max_tokens):
            token = sample(apply_penalties(logits, params, prompt, stats.token_ids), params, ctr=step)
            stats.token_ids.append(token)
            stats.generated_tokens += 1
            yield token
            if token in stop:
                stats.finish_reason = "stop"
                break
            if step + 1 == params.max_tokens or cache.pos >= cache.max_ctx:
                stats.finish_reason = "length"
                break
            logits = model.decode_step(token, cache)
    finally:  # also when the consumer stops early (a stop string, a closed pipe)
        stats.decode_seconds = time.perf_counter() - t0
