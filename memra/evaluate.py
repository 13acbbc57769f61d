"""Perplexity over a text: the file's tokens cut into windows of `ctx` tokens, each window scored from
an empty cache (the first token of a window is context only). The same windows are what any peer
implementation must score to compare numbers."""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass

import torch

from memra.errors import MemraError


@dataclass(frozen=True)
class Perplexity:
    ppl: float
    nll: float  # mean negative log-likelihood per scored token (nats)
    scored_tokens: int
    windows: int


def windows(ids: list[int], ctx: int) -> list[list[int]]:
    if ctx < 2:
        raise MemraError(f"perplexity windows need at least 2 tokens, got ctx={ctx}")
    return [ids[s:s + ctx] for s in range(0, len(ids), ctx) if len(ids[s:s + ctx]) >= 2]


@torch.inference_mode()
def perplexity(model, ids: list[int], ctx: int = 512, show_progress: bool = True) -> Perplexity:
    pieces = windows(ids, ctx)
    if not pieces:
        raise MemraError("the text has fewer than 2 tokens; nothing to score")
    bar = None
    if show_progress and sys.stderr.isatty() and not os.environ.get("CI"):
        from tqdm import tqdm

        bar = tqdm(total=sum(len(p) - 1 for p in pieces), unit="tok", desc="perplexity")
    total, count = 0.0, 0
    for piece in pieces:
        cache = model.new_cache(len(piece))
        logits = model.prime(piece[:-1], cache, all_logits=True)  # [n-1, V]: predictions of tokens 1..n-1
        targets = torch.tensor(piece[1:], device=logits.device)
        logprobs = torch.log_softmax(logits.double(), dim=-1)
        total -= logprobs.gather(1, targets[:, None]).sum().item()
        count += len(piece) - 1
        cache.free()
        if bar is not None:
            bar.update(len(piece) - 1)
    if bar is not None:
        bar.close()
    return Perplexity(ppl=math.exp(total / count), nll=total / count, scored_tokens=count, windows=len(pieces))
