"""Perplexity over a text: the file's tokens cut into windows of `ctx` tokens, each window scored from
an empty cache (the first token of a window is context only). The same windows are what any peer
implementation must score to compare numbers."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from memra.errors import MemraError
from memra.settings import show_progress as show_bars


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
    if show_progress and show_bars():
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


@dataclass(frozen=True)
class MtpAgreement:
    agree: int
    positions: int

    @property
    def rate(self) -> float:
        return self.agree / self.positions if self.positions else 0.0


@torch.inference_mode()
def mtp_agreement(model, ids: list[int], ctx: int = 512) -> MtpAgreement:
    """How often the MTP head's draft for token t+2 equals the model's own greedy choice there.

    Teacher-forced on the text, window by window: the trunk runs over the true tokens; at each t the
    MTP block sees the final hidden at t and the true token t+1 (what a drafter sees after that token
    was accepted) and its argmax is compared with argmax of the trunk's logits at t+1.
    """
    if not model.mtp:
        raise MemraError("this model has no MTP block")
    agree = total = 0
    for piece in windows(ids, ctx):
        if len(piece) < 3:
            continue
        tokens = torch.tensor(piece, device=model.device)
        cache = model.new_cache(len(piece))
        cache.reserve(len(piece))
        trunk_ctx = model.context(cache, 0, len(piece), recurrent=False)
        h = model.norm_out(model.forward_layers(model.embed_tokens(tokens), trunk_ctx))  # [n, E]
        greedy = model.logits(h).argmax(-1)  # [n]: the model's choice for position t+1
        mtp_ctx = model.context(cache, 0, len(piece) - 1, recurrent=False)
        draft = model.logits(model.mtp[0].forward(h[:-1], model.embed_tokens(tokens[1:]), mtp_ctx)).argmax(-1)
        # draft[t] predicts position t+2; the model's own greedy choice for t+2 is greedy[t+1]
        agree += int((draft[:-1] == greedy[1:-1]).sum())
        total += len(piece) - 2
        cache.free()
    return MtpAgreement(agree, total)
