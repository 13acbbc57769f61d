"""The step bodies: prime (chunked prefill) and decode_step (one token, B = 1).

Both are "embed, walk layers [0, L), norm, head" with a different StepContext: prompt tokens take
the GDN chunked form, generated tokens the recurrent form (the same way in every run, which is what
makes runs comparable bit for bit). Every check that can refuse happens before any state moves.
"""

from __future__ import annotations

from typing import Sequence

import torch

from memra.cache import PRIME_CHUNK_MAX_TOKENS, Cache
from memra.errors import MemraError


def _as_ids(model, ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
    t = torch.as_tensor(ids, dtype=torch.long).flatten()
    if t.numel() == 0:
        raise MemraError("cannot prime an empty prompt")
    bad = (t < 0) | (t >= model.cfg.vocab_size)
    if bool(bad.any()):
        raise MemraError(f"token id {int(t[bad][0])} is outside the vocabulary (0..{model.cfg.vocab_size - 1})")
    return t.to(model.device)


@torch.inference_mode()
def prime(model, ids, cache: Cache, all_logits: bool = False, chunk_size: int | None = None) -> torch.Tensor:
    """Run prompt tokens through the model in chunks, advancing the cache.

    Returns the last position's logits [V] (fp32), or every position's [T, V] when all_logits.
    chunk_size defaults to PRIME_CHUNK_MAX_TOKENS and may not exceed it.
    """
    chunk = PRIME_CHUNK_MAX_TOKENS if chunk_size is None else int(chunk_size)
    if not 1 <= chunk <= PRIME_CHUNK_MAX_TOKENS:
        raise MemraError(f"prime chunk size must be in 1..{PRIME_CHUNK_MAX_TOKENS}, got {chunk_size}")
    tokens = _as_ids(model, ids)
    cache.reserve(tokens.numel())  # refuses (context overflow) before any state changes
    outputs = []
    h_last = None
    for start in range(0, tokens.numel(), chunk):
        piece = tokens[start : start + chunk]
        ctx = model.context(cache, cache.pos, piece.numel(), recurrent=False)
        h = model.forward_layers(model.embed_tokens(piece), ctx)
        cache.pos += piece.numel()
        if all_logits:
            outputs.append(model.logits(model.norm_out(h)))
        h_last = h[-1:]
    if all_logits:
        return torch.cat(outputs)
    return model.logits(model.norm_out(h_last))[0]


@torch.inference_mode()
def decode_step(model, token: int, cache: Cache) -> torch.Tensor:
    """Feed one generated token at cache.pos; returns next-token logits [V] (fp32)."""
    tokens = _as_ids(model, [int(token)])
    cache.reserve(1)
    ctx = model.context(cache, cache.pos, 1, recurrent=True)
    h = model.forward_layers(model.embed_tokens(tokens), ctx)
    cache.pos += 1
    return model.logits(model.norm_out(h))[0]
