"""memra.train.Trainer: the training forward of a loaded model, whose logprobs are the sampler's (promise E11).

    trainer = memra.train.Trainer(llm)                         # parameters: the checkpoint's tensors, fp32
    logp = trainer(ids, lens, starts)                          # packed sequences -> [N] next-token logprobs
    loss = -(advantages * logp).sum(); loss.backward(); opt.step()
    llm.update_weights(trainer.weights())                      # the sampler takes the new weights

Values: each position's logprob is the one the sampler gave that token, bit for bit (memra.train.exact: the
scorer, E9), whatever the packing, order or lengths, since every sequence is computed alone with the
sampler's arithmetic. Gradient: through the model's own layers over weights derived from the parameters
(memra.train.walk, memra.train.params), in the prompt form by default (grad_walk="sampler": the sampler's
own grouping, whose values are the sampler's bits too, slower). The two meet in SamplerValues
(memra.train.ops): the exact values forward, the walk's gradient backward.

The trainer refuses to run on parameters the sampler does not hold: after an optimizer step, until
llm.update_weights(trainer.weights()) lands (the logprobs would be of weights nothing sampled with).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from memra import counters
from memra.errors import MemraError
from memra.train.exact import sampler_logprobs, sampler_logprobs_batch, walked_logprobs
from memra.train.ops import SamplerValues, TrainOps
from memra.train.params import derive, read_checkpoint
from memra.train.walk import Seq, Walk
from memra.weights.update import open_source

GRAD_WALKS = ("prompt", "sampler")
VALUES = ("auto", "walk", "scorer")


class Trainer(nn.Module):
    def __init__(self, llm_or_model, checkpointing: bool = False, grad_walk: str = "prompt", values: str = "auto",
                 canary: bool = False):
        """checkpointing: recompute each layer in the backward (activation checkpointing per layer).
        values: where the sampler's logprobs come from (memra.train.exact): "walk" (auto on a CPU's row plan)
        or "scorer" (auto elsewhere: the model's own kernels; on a CPU where its rows decode stacked).
        canary: the values from the prompt-form walk instead of the sampler's (a plain trainer's numbers:
        `memra gate --mode train` must FAIL on it)."""
        super().__init__()
        model = getattr(llm_or_model, "model", llm_or_model)
        if grad_walk not in GRAD_WALKS:
            raise MemraError(f"grad_walk must be one of {', '.join(GRAD_WALKS)}, got {grad_walk!r}")
        if values not in VALUES:
            raise MemraError(f"values must be one of {', '.join(VALUES)}, got {values!r}")
        if values == "walk" and model.device.type != "cpu":
            raise MemraError("values='walk' reproduces the sampler only where its kernels are the reference ops "
                             "(a CPU); use values='scorer' on a GPU")
        cfg = model.cfg
        if cfg.ple_dim or any(cfg.attn_of(i).kv_from is not None for i in range(cfg.n_layers)
                              if cfg.mixers[i] == "attention"):
            raise MemraError(f"memra.train does not run {cfg.arch} yet (per-layer embeddings / shared KV layers)")
        packed = next((k for k, t in (getattr(model, "_weights", None) or {}).items() if not isinstance(t, torch.Tensor)),
                      None)
        if packed is not None:  # its linears compute on packed blocks (int8 dot products on a CPU): not a float walk
            raise MemraError(f"memra.train needs the model's weights as floats; {packed} is packed "
                             f"({type(model._weights[packed]).__name__}): load it with packed_weights=False")
        self.model, self.checkpointing, self.grad_walk, self.canary = model, checkpointing, grad_walk, canary
        self.values = _auto_values(model) if values == "auto" else values
        self._opened = open_source(model)
        tensors = read_checkpoint(model)
        self.names = list(tensors)
        self.params = nn.ParameterList([nn.Parameter(t) for t in tensors.values()])
        self._view = model.with_settings(model.settings)  # the sampler's weight tensors, caches of its own
        self._pushed = self._versions()
        self._sampler_version = getattr(model, "weights_version", 0)

    def weights(self) -> dict[str, torch.Tensor]:
        """The parameters in the checkpoint's names, for llm.update_weights (which must follow before the next
        forward)."""
        self._pushed = self._versions()
        self._sampler_version = getattr(self.model, "weights_version", 0) + 1
        return {n: p.detach() for n, p in zip(self.names, self.params)}

    def named_weights(self) -> dict[str, nn.Parameter]:
        return dict(zip(self.names, self.params))

    def _versions(self) -> list[int]:
        return [p._version for p in self.params]

    def _check_in_step(self) -> None:
        have = getattr(self.model, "weights_version", 0)
        if self._versions() != self._pushed:
            raise MemraError("the trainer's parameters changed since the sampler received them: call "
                             "llm.update_weights(trainer.weights()) before the next forward")
        if have != self._sampler_version:
            raise MemraError(f"the sampler holds weights version {have}, the trainer expected "
                             f"{self._sampler_version}: call llm.update_weights(trainer.weights()), or make a new "
                             "Trainer after updating the sampler from elsewhere")

    def forward(self, ids: torch.Tensor, lens: Sequence[int], starts: Sequence[int] | None = None) -> torch.Tensor:
        """ids [N] long: sequences packed end to end (lens[k] tokens each, any order); starts[k]: where sequence
        k's generated part begins (its prompt length; None: all prompt). -> [N] fp32: position i holds the
        logprob of the next token of its sequence (0.0 at each sequence's last position)."""
        seqs = self._split(ids, lens, starts)
        self._check_in_step()
        counters.bump("train_forwards")
        w = derive(self.model, self.named_weights(), opened=self._opened)
        walk = Walk(self.model, w)
        if self.canary or torch.is_grad_enabled():
            counters.bump("train_grad_tokens", sum(s.ids.numel() for s in seqs))
        if self.canary:
            return _flat(walk.logprobs(seqs, "prompt", self.checkpointing))
        if self.values == "walk" and self.grad_walk == "sampler":  # one walk: the values and their gradient
            counters.bump("train_exact_tokens", sum(s.ids.numel() - 1 for s in seqs))
            exact_walk = Walk(self.model, w, TrainOps.mirror(self.model.ops))  # the sampler's C kernels, if it has them
            return _flat(exact_walk.logprobs(seqs, "sampler", self.checkpointing))
        if self.values == "walk":
            exact = _flat(walked_logprobs(self.model, {k: t.detach() for k, t in w.items()}, seqs))
        elif self.model.device.type == "cpu":  # the sequences' generated tokens in one batched verify a round
            exact = _flat(sampler_logprobs_batch(self._view, seqs))
        else:
            exact = _flat([sampler_logprobs(self._view, s).to(self.model.device) for s in seqs])
        if not torch.is_grad_enabled():
            return exact
        return SamplerValues.apply(_flat(walk.logprobs(seqs, self.grad_walk, self.checkpointing)), exact)

    def _split(self, ids, lens, starts) -> list[Seq]:
        ids = torch.as_tensor(ids)
        lens = [int(n) for n in lens]
        if ids.dim() != 1 or ids.dtype not in (torch.int64, torch.int32):
            raise MemraError(f"ids must be a 1-D tensor of token ids, got {tuple(ids.shape)} {ids.dtype}")
        if any(n < 1 for n in lens) or sum(lens) != ids.numel():
            raise MemraError(f"lens must be positive and sum to len(ids) = {ids.numel()}, got {lens}")
        starts = [n for n in lens] if starts is None else [int(s) for s in starts]
        if len(starts) != len(lens) or any(not 1 <= s <= n for s, n in zip(starts, lens)):
            raise MemraError("starts[k] (where sequence k's generated tokens begin) must be in 1..lens[k]")
        vocab = self.model.cfg.vocab_size
        if ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < vocab):
            raise MemraError(f"token ids must be in 0..{vocab - 1}")
        ids = ids.to(device=self.model.device, dtype=torch.long)
        out, at = [], 0
        for n, s in zip(lens, starts):
            out.append(Seq(ids[at : at + n], s))
            at += n
        return out


def _auto_values(model) -> str:
    """Where the values come from by default: the scorer (one verify forward for a sequence's generated
    tokens) wherever decode stacks its rows (a GPU's invariant kernels; a CPU's fp32 model under MEMRA_CPU_FLIN:
    memra.decode_plan), else, on a CPU's row plan, the walk (the sampler's one-row steps, a layer's weights
    kept in cache across a sequence's tokens)."""
    if model.device.type != "cpu":
        return "scorer"
    from memra.decode_plan import decode_plan

    return "scorer" if model.settings.exact and decode_plan(model) == "stacked" else "walk"


def _flat(per_seq: list[torch.Tensor]) -> torch.Tensor:
    """Each sequence's [L-1] next-token logprobs, packed back to [N] with 0.0 at every sequence's end."""
    parts = []
    for lp in per_seq:
        parts += [lp, lp.new_zeros(1)]
    return torch.cat(parts)
