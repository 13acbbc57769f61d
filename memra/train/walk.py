"""The training forward's differentiable walk: the model's own layers (memra.model.block) over canonical
weights that carry autograd, on TrainOps (memra.train.ops: reference ops, boxes for the cache pools).

Layer-major: each layer runs over every position of every sequence before the next layer starts (a layer at
position p reads only that layer's inputs at positions <= p, so this is the order-free form of the token-major
decode), which is what lets a whole layer be recomputed under activation checkpointing.

Two groupings of a sequence's positions into forwards:
- "prompt" (the gradient's default path): one forward per sequence in the prompt form (GDN chunked at the
  absolute 64-grid, attention causal over the whole sequence): matmuls over the sequence's rows, a cheap
  backward. Its values agree with the sampler's to float rounding, not in bits.
- "sampler": the forwards the sampler ran (memra.engine.scoring, promise E9): the prompt in pieces cut at
  absolute multiples of 64, the head over each piece, the head over the last prompt position alone, then every
  generated position alone as a decode step (GDN recurrent, attention over its prefix). Its values equal the
  sampler's bit for bit (tests/test_train.py), so its gradient is that of the very function sampled; its
  backward is one small matmul per position and weight (slow on a CPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from memra import counters
from memra.kernels.cuts import TILE, aligned_cuts
from memra.model.block import Block
from memra.model.context import StepContext
from memra.train.ops import TrainCache, TrainOps

OPS = TrainOps.make()


@dataclass(frozen=True)
class Seq:
    ids: torch.Tensor  # [L] long, on the model's device
    start: int  # the first generated position (L: the whole sequence is a prompt)


def groups(seq: Seq, grouping: str) -> list[tuple[int, int, bool]]:
    """[a, b) and recurrent? of each forward the walk runs for this sequence, in order."""
    n = seq.ids.numel()
    if grouping == "prompt":
        return [(0, n, False)]
    # the generated tokens but the last (nothing reads its row): decode steps, as the scorer feeds them
    return [(a, b, False) for a, b in aligned_cuts(seq.start, 0, TILE)] + [(p, p + 1, True) for p in range(seq.start, n - 1)]


def heads(seq: Seq, grouping: str) -> list[tuple[int, int]]:
    """[a, b) of each head call, as the sampler groups them (scoring's rows; memra.engine.scoring)."""
    n, s = seq.ids.numel(), seq.start
    if grouping == "prompt":
        return [(0, n)]
    out = list(aligned_cuts(s, 0, TILE))
    if s < n:  # the first generated token was drawn from the head over the last prompt position alone
        out.append((s - 1, s))
    return out + [(p, p + 1) for p in range(s, n - 1)]


class Walk:
    def __init__(self, model, weights: dict[str, torch.Tensor], ops: TrainOps = OPS):
        """ops: the kernel table (TrainOps.mirror(model.ops) for the sampler's bits where its table runs C
        kernels; the plain reference ops by default)."""
        cfg = self.cfg = model.cfg
        self.model, self.w, self.ops = model, weights, ops
        sub = lambda p: {k[len(p):]: v for k, v in weights.items() if k.startswith(p)}  # noqa: E731
        self.blocks = [Block(cfg, i, cfg.mixers[i], cfg.ffns[i], sub(f"layers.{i}."), ops) for i in range(cfg.n_layers)]
        self.lm_head = weights.get("lm_head", weights["embed"])
        self._rope: dict[tuple[int, int], tuple] = {}

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        e = self.w["embed"][ids]
        scale = self.model.embed_scale
        return e if scale is None else e * scale

    def _tables(self, a: int, b: int):
        """Positions a..b-1's rotary tables, computed per forward as the sampler's context computes them (an
        elementwise op's bits can depend on the call's shape on a CPU), once for every layer."""
        key = (a, b)
        if key not in self._rope:
            m = self.model
            positions = torch.arange(a, b, device=m.device)
            cos, sin = OPS.rope_cos_sin(positions, m.inv_freq, m.dtype)
            self._rope[key] = positions, cos, sin, torch.arange(b, device=m.device)
        return self._rope[key]

    def _ctx(self, cache: TrainCache, a: int, b: int, recurrent: bool) -> StepContext:
        positions, cos, sin, prefix = self._tables(a, b)
        return StepContext(cache=cache, pos0=a, n_tokens=b - a, cos=cos, sin=sin, recurrent=recurrent,
                           kv_write_rows=positions, kv_read_rows=prefix)

    def _layer(self, block: Block, seqs: list[Seq], grouping: str, *hs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = []
        for seq, h in zip(seqs, hs):
            cache = TrainCache(self.cfg, self.model.dtype, self.model.device)
            out.append(torch.cat([block.forward(h[a:b], self._ctx(cache, a, b, rec))
                                  for a, b, rec in groups(seq, grouping)]))
        return tuple(out)

    def logprobs(self, seqs: list[Seq], grouping: str = "prompt", checkpointing: bool = False) -> list[torch.Tensor]:
        """Each sequence's next-token logprobs [L-1] fp32: row i is log p(ids[i+1] | ids[..i])."""
        hs = tuple(torch.cat([self.embed(s.ids[a:b]) for a, b, _ in groups(s, grouping)]) for s in seqs)
        for block in self.blocks:
            run = lambda *x, block=block: self._layer(block, seqs, grouping, *x)  # noqa: E731
            if checkpointing and torch.is_grad_enabled():
                hs = checkpoint(run, *hs, use_reentrant=False)
                counters.bump("train_checkpointed_layers")
            else:
                hs = run(*hs)
        return [self._head(seq, h, grouping) for seq, h in zip(seqs, hs)]

    def _head(self, seq: Seq, h: torch.Tensor, grouping: str) -> torch.Tensor:
        """Final norm, lm_head and log_softmax over each head group's rows (the group's whole rows: the matmul's
        M is the sampler's) -> [L-1]: row i is the logprob of ids[i+1]. A later group's row replaces an
        earlier one's (the last prompt position's one-row head after its piece's)."""
        cfg, n = self.cfg, seq.ids.numel()
        out = torch.zeros(n - 1, dtype=torch.float32, device=h.device)
        for a, b in heads(seq, grouping):
            used = min(b, n - 1)  # the last position scores nothing
            if used <= a:
                continue
            x = h[a:b] if h.shape[-1] == cfg.hidden_size else h[a:b, : cfg.hidden_size].contiguous()
            logits = self.ops.linear(self.ops.rms_norm(x, self.w["final_norm"], cfg.norm_eps, cfg.zero_centered_norm),
                                     self.lm_head)
            if cfg.final_softcap is not None:
                logits = torch.tanh(logits / cfg.final_softcap) * cfg.final_softcap
            logits = logits.float()
            # row by row where the bits matter: the sampler's log_softmax runs over one row [V]
            logp = (torch.log_softmax(logits, dim=-1) if grouping == "prompt"
                    else torch.stack([torch.log_softmax(r, dim=-1) for r in logits[: used - a]]))
            picked = logp[: used - a].gather(1, seq.ids[a + 1 : used + 1, None])[:, 0]
            out = out.index_put((torch.arange(a, used, device=h.device),), picked)
        return out
