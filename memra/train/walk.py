"""The training forward's differentiable walk: the model's own layers (memra.model.block) over canonical
weights that carry autograd, on TrainOps (memra.train.ops: reference ops, boxes for the cache pools).

Layer-major: each layer runs over every position of every sequence before the next layer starts (a layer at
position p reads only that layer's inputs at positions <= p, so this is the order-free form of the token-major
decode), which is what lets a whole layer be recomputed under activation checkpointing.

Two groupings of a sequence's positions into forwards:
- "prompt" (the gradient's default path): every sequence whole in the prompt form (GDN chunked at the
  absolute 64-grid, attention causal over the whole sequence), all of them in one forward a layer (the
  model's cross-request prefill, Block.forward_segments: row-wise work over every sequence's rows at once, the
  mixing sequence by sequence): matmuls over all rows, a cheap backward. Its values agree with the sampler's
  to float rounding, not in bits.
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
from memra.engine.sampler import lone_row
from memra.kernels.cuts import TILE, aligned_cuts
from memra.model.block import Block
from memra.model.context import Segments, StepContext, joined
from memra.train.ops import TrainCache, TrainOps

OPS = TrainOps.make()


@dataclass(frozen=True)
class Seq:
    ids: torch.Tensor  # [L] long, on the model's device
    start: int  # the first generated position (L: the whole sequence is a prompt)


def groups(seq: Seq) -> list[tuple[int, int, bool]]:
    """[a, b) and recurrent? of each forward the sampler ran for this sequence, in order."""
    n = seq.ids.numel()
    # the generated tokens but the last (nothing reads its row): decode steps, as the scorer feeds them
    return [(a, b, False) for a, b in aligned_cuts(seq.start, 0, TILE)] + [(p, p + 1, True) for p in range(seq.start, n - 1)]


def heads(seq: Seq) -> list[tuple[int, int]]:
    """[a, b) of each head call, as the sampler groups them (scoring's rows; memra.engine.scoring)."""
    n, s = seq.ids.numel(), seq.start
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
        self._joined: dict[tuple[int, ...], tuple] = {}  # the prompt form's joined rotary tables, by lengths

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
        if grouping == "prompt":  # hs: every sequence's rows end to end, one forward
            return (block.forward_segments(hs[0], self._wave(seqs)),)
        out = []
        for seq, h in zip(seqs, hs):
            cache = TrainCache(self.cfg, self.model.dtype, self.model.device)
            out.append(torch.cat([block.forward(h[a:b], self._ctx(cache, a, b, rec)) for a, b, rec in groups(seq)]))
        return tuple(out)

    def _wave(self, seqs: list[Seq]) -> Segments:
        """The prompt form's one forward: each sequence a piece from position 0, with state of its own (fresh
        boxes for every layer call, so a checkpointed layer's recompute starts where its forward did)."""
        ctxs, bounds, at = [], [], 0
        for s in seqs:
            n = s.ids.numel()
            ctxs.append(self._ctx(TrainCache(self.cfg, self.model.dtype, self.model.device), 0, n, False))
            bounds.append((at, at + n))
            at += n
        key = tuple(b - a for a, b in bounds)
        if key not in self._joined:
            self._joined[key] = joined([c.cos for c in ctxs]), joined([c.sin for c in ctxs])
        cos, sin = self._joined[key]
        return Segments(ctxs, bounds, at, cos, sin, ctxs[0].cache.kv, None)  # no shared pool: piece by piece

    def logprobs(self, seqs: list[Seq], grouping: str = "prompt", checkpointing: bool = False) -> list[torch.Tensor]:
        """Each sequence's next-token logprobs [L-1] fp32: row i is log p(ids[i+1] | ids[..i])."""
        if grouping == "prompt":
            hs = (self.embed(torch.cat([s.ids for s in seqs])),)
        else:
            hs = tuple(torch.cat([self.embed(s.ids[a:b]) for a, b, _ in groups(s)]) for s in seqs)
        for block in self.blocks:
            run = lambda *x, block=block: self._layer(block, seqs, grouping, *x)  # noqa: E731
            if checkpointing and torch.is_grad_enabled():
                hs = checkpoint(run, *hs, use_reentrant=False)
                counters.bump("train_checkpointed_layers")
            else:
                hs = run(*hs)
        if grouping == "prompt":
            return self._prompt_head(seqs, hs[0])
        return [self._head(seq, h) for seq, h in zip(seqs, hs)]

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm and lm_head over h's rows (the hidden state: a wider stream's head) -> fp32 logits."""
        cfg = self.cfg
        x = h if h.shape[-1] == cfg.hidden_size else h[:, : cfg.hidden_size].contiguous()
        logits = self.ops.linear(self.ops.rms_norm(x, self.w["final_norm"], cfg.norm_eps, cfg.zero_centered_norm),
                                 self.lm_head)
        if cfg.final_softcap is not None:
            logits = torch.tanh(logits / cfg.final_softcap) * cfg.final_softcap
        return logits.float()

    def _prompt_head(self, seqs: list[Seq], h: torch.Tensor) -> list[torch.Tensor]:
        """The head over every row at once (the prompt form's values are not bitwise anyway) -> [L-1] each."""
        logp = torch.log_softmax(self._logits(h), dim=-1)
        nxt = torch.cat([torch.cat((s.ids[1:], s.ids[:1])) for s in seqs])  # a sequence's last row: never read
        picked = logp.gather(1, nxt[:, None])[:, 0]
        return [lp[:-1] for lp in picked.split([s.ids.numel() for s in seqs])]

    def _head(self, seq: Seq, h: torch.Tensor) -> torch.Tensor:
        """Final norm, lm_head and log_softmax over each head group's rows (the group's whole rows: the matmul's
        M is the sampler's) -> [L-1]: row i is the logprob of ids[i+1]. A later group's row replaces an
        earlier one's (the last prompt position's one-row head after its piece's)."""
        n = seq.ids.numel()
        out = torch.zeros(n - 1, dtype=torch.float32, device=h.device)
        for a, b in heads(seq):
            used = min(b, n - 1)  # the last position scores nothing
            if used <= a:
                continue
            logits = self._logits(h[a:b])
            # row by row: the sampler's log_softmax runs over one row [V] of its own (lone_row)
            logp = torch.stack([torch.log_softmax(lone_row(r), dim=-1) for r in logits[: used - a]])
            picked = logp.gather(1, seq.ids[a + 1 : used + 1, None])[:, 0]
            out = out.index_put((torch.arange(a, used, device=h.device),), picked)
        return out
