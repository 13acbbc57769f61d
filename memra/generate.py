"""Offline generation for one sequence: prime the prompt, then decode token by token.

The server's continuous-batching engine (later) produces the same tokens; this is the simple loop
the CLI and the tests use.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

from memra import counters
from memra.errors import ContextOverflowError, MemraError
from memra.sampling import SamplingParams, apply_penalties, sample
from memra.spec import SpecConfig, SpecStats


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of the prompt, served from the engine's prefix cache (memra.prefix)
    generated_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    finish_reason: str = ""  # "stop" (end-of-sequence token) | "length" (max_tokens)
    token_ids: list[int] = field(default_factory=list)
    spec: SpecStats | None = None  # set when speculative decoding ran

    @property
    def decode_tokens_per_second(self) -> float:
        steps = max(self.generated_tokens - 1, 0)  # the first token comes from the prefill
        return steps / self.decode_seconds if self.decode_seconds > 0 else 0.0


def generate_tokens(model, prompt_ids: Sequence[int], params: SamplingParams, stats: GenerationStats | None = None,
                    eos_ids: Sequence[int] = (), speculative: SpecConfig | None = None) -> Iterator[int]:
    """Yield generated token ids until an end-of-sequence id or params.max_tokens.

    With `speculative`, tokens come from draft-and-verify rounds (memra.spec) — the very tokens this
    loop yields without it (E4), only more of them per forward.
    """
    stats = stats if stats is not None else GenerationStats()
    stats.prompt_tokens = len(prompt_ids)
    if not prompt_ids:
        raise MemraError("the prompt is empty after tokenization")
    if params.structured_outputs is not None:
        raise MemraError("structured_outputs runs in the engine: use memra.LLM or memra serve, not generate_tokens")
    need = len(prompt_ids) + params.max_tokens
    limit = model.cfg.max_position
    if len(prompt_ids) >= limit:
        raise ContextOverflowError(f"the prompt has {len(prompt_ids)} tokens; the model's context is {limit}")
    cache = model.new_cache(min(need, limit))
    if speculative is not None:
        yield from _speculative_tokens(model, list(prompt_ids), params, stats, set(eos_ids), speculative, cache)
        return
    t0 = time.perf_counter()
    logits = model.prime(prompt_ids, cache)
    stats.prefill_seconds = time.perf_counter() - t0
    t0 = time.perf_counter()
    stop = set(eos_ids)
    prompt = list(prompt_ids)
    try:
        for step in range(params.max_tokens):
            token = sample(apply_penalties(logits, params, prompt, stats.token_ids, stop), params, ctr=step)
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


def _speculative_tokens(model, prompt: list[int], params: SamplingParams, stats: GenerationStats, stop: set[int],
                        spec: SpecConfig, cache) -> Iterator[int]:
    """The plain loop's tokens, a verify at a time. Each emitted token is chosen by the plain loop's
    rule (penalties over prompt + output so far, step counter = its index); a draft survives only
    if it equals that choice, so the stream cannot differ from the plain one."""
    from memra.spec import drop_rejected, make_drafter, next_k, verify_round
    from memra.state_trail import StateTrail

    spec_stats = stats.spec = SpecStats()
    out = stats.token_ids
    drafter = make_drafter(spec, model, cache, params)
    t0 = time.perf_counter()
    logits, hidden = model.prime(prompt, cache, hidden=True) if spec.method == "mtp" else (model.prime(prompt, cache), None)
    stats.prefill_seconds = time.perf_counter() - t0
    t0 = time.perf_counter()
    trail, ema = StateTrail(), None

    def emit(logits_row, virtual_pos: int) -> tuple[int, bool]:
        """Choose the next token as the plain loop would; -> (token, finished)."""
        token = sample(apply_penalties(logits_row, params, prompt, out, stop), params, ctr=len(out))
        out.append(token)
        stats.generated_tokens += 1
        if token in stop:
            stats.finish_reason = "stop"
            return token, True
        if len(out) == params.max_tokens or virtual_pos >= cache.max_ctx:
            stats.finish_reason = "length"
            return token, True
        return token, False

    try:
        last, done = emit(logits, cache.pos)
        yield last
        drafter.start(prompt, hidden, last)
        while not done:
            # a verify feeds `last` + k drafts and emits at most k+1 tokens: stay inside both budgets
            k = max(0, min(next_k(spec, ema), params.max_tokens - len(out) - 1, cache.max_ctx - cache.pos - 1))
            cache.reserve(k + 1)  # the chained MTP drafts write their KV entries up to here
            drafts = drafter.propose(k, ctr=len(out)) if k else []
            chunk = [last, *drafts]
            logits_t, h_seed, pos0, snap = verify_round(model, cache, last, drafts, spec, trail)
            keep = accepted = 0
            while not done:
                token, done = emit(logits_t[keep], pos0 + keep + 1)
                yield token
                keep += 1
                if keep <= len(drafts) and drafts[keep - 1] == token:
                    accepted += 1  # the draft was the token plain decoding chose: its column stands
                    continue
                break
            spec_stats.verifies += 1
            spec_stats.drafted += len(drafts)
            spec_stats.accepted += accepted
            spec_stats.emitted += keep
            if done:
                break
            drop_rejected(model, cache, chunk, keep, pos0, trail, snap)
            spec_stats.rollbacks += keep < len(chunk)
            drafter.advance(chunk[:keep], h_seed[:keep], token)
            last = token
            ema = accepted if ema is None else 0.7 * ema + 0.3 * accepted
    finally:
        stats.decode_seconds = time.perf_counter() - t0
        counters.bump("spec_drafted_tokens", spec_stats.drafted)
        counters.bump("spec_accepted_tokens", spec_stats.accepted)
