"""A decoder block: pre-norm mixer (attention or GDN) and pre-norm FFN (dense or MoE), each residual.

Gemma's blocks also norm each branch's output before its residual add (sandwich norms); Gemma 4's
E-variants then add a gated per-layer input (the stream carries every layer's, after the hidden state)
and scale the block's output by a learned scalar."""

from __future__ import annotations

from typing import Callable

import torch

from memra.config import ModelConfig
from memra.kernels import cpu_decode, cpu_layer
from memra.kernels.reference import gelu_tanh_mul
from memra.kernels.table import KernelTable
from memra.model.attention import Attention
from memra.model.context import Segments, StackedStep, StepContext
from memra.model.ffn import Mlp, Moe
from memra.model.gdn import GatedDeltaNet


class Block:
    def __init__(self, cfg: ModelConfig, layer: int, mixer: str, ffn: str, w: dict[str, torch.Tensor], ops: KernelTable):
        self.layer, self.eps, self.zc, self.ops = layer, cfg.norm_eps, cfg.zero_centered_norm, ops
        self.attn_norm, self.ffn_norm = w["attn_norm"], w["ffn_norm"]
        sub = lambda prefix: {k[len(prefix):]: v for k, v in w.items() if k.startswith(prefix)}
        self.mixer = (Attention(cfg, layer, sub("attn."), ops) if mixer == "attention"
                      else GatedDeltaNet(cfg, layer, sub("gdn."), ops))
        limit = cfg.shared_limits[layer] if layer < len(cfg.shared_limits) else None  # Step's dense layers too
        self.ffn = Moe(cfg, layer, sub("moe."), ops) if ffn == "moe" else Mlp(sub("mlp."), ops, cfg.ffn_act, limit)
        self.sandwich = cfg.sandwich_norm
        self.post_attn_norm, self.post_ffn_norm = w.get("post_attn_norm"), w.get("post_ffn_norm")
        self.scalar = w.get("layer_scalar")  # [1] | None
        self.hidden, self.ple = cfg.hidden_size, None
        if "ple_gate" in w and layer < cfg.n_layers:  # [P, E], [E, P], [E]: this layer's per-layer input's path
            at = cfg.hidden_size + layer * cfg.ple_dim
            self.ple = (w["ple_gate"], w["ple_proj"], w["ple_norm"], slice(at, at + cfg.ple_dim))
        self.layer_plan = None  # a one-token step in one C call (cpu_layer.LayerPlan), False: none; made at first use

    def forward(self, h: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """h [T, W] -> [T, W]: T tokens of one sequence."""
        if ctx.n_tokens == 1 and ctx.recurrent and self._planned(ctx):  # a generated token: the kernels below in one call
            return cpu_layer.decode(self.layer_plan, h, ctx, self.mixer.kv_layer)
        return self._run(h, lambda x: self.mixer.forward(x, ctx))

    def _planned(self, ctx: StepContext) -> bool:
        if self.layer_plan is None:
            plan = cpu_layer.plan_for(self)
            if plan is not None and not cpu_decode.supports(ctx.cos.new_empty(1, plan.Hq, plan.D),
                                                            ctx.cache.kv.k[self.mixer.kv_layer], ctx.cos):
                plan = None
            self.layer_plan = plan or False
        return self.layer_plan is not False

    def forward_segments(self, h: torch.Tensor, wave: Segments) -> torch.Tensor:
        """h [N, W] -> [N, W]: prompt pieces of several sequences in one forward (cross-request prefill).
        Row-wise work (norms, projections, FFN / MoE) runs over all N rows; the mixer's sequence-mixing
        part runs piece by piece. Exact only where every row-wise op is batch-invariant (memra.step)."""
        return self._run(h, lambda x: self.mixer.forward_segments(x, wave))

    def forward_mixed(self, h: torch.Tensor, step: StackedStep, wave: Segments) -> torch.Tensor:
        """h [B + N, W] -> [B + N, W]: a decode step's B rows, then a prefill wave's N rows, in one forward
        (memra.step.mixed_step). Row-wise work over all rows; each kind's mixer part as its own forward."""
        return self._run(h, lambda x: self.mixer.forward_mixed(x, step, wave))

    def forward_stacked(self, h: torch.Tensor, step: StackedStep) -> torch.Tensor:
        """h [B, W] -> [B, W]: one token each of B sequences, stacked (the fast, non-exact decode)."""
        return self._run(h, lambda x: self.mixer.forward_stacked(x, step))

    def forward_tokens(self, h: torch.Tensor, step: StackedStep) -> torch.Tensor:
        """h [T, W] -> [T, W]: T consecutive generated tokens of one sequence (the stacked verify body).
        Attention's stacked form already attends row by row in order, each row after writing its own
        K/V, so row j sees rows < j exactly as decode would; GDN advances its state token by token."""
        if isinstance(self.mixer, Attention):
            return self._run(h, lambda x: self.mixer.forward_stacked(x, step))
        return self._run(h, lambda x: self.mixer.forward_tokens(x, step))

    def _run(self, h: torch.Tensor, mix: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The block around its mixer `mix` (normed input -> mixer output). A stream wider than the hidden
        state (per-layer inputs after it) passes its tail through unchanged."""
        side = None
        if h.shape[-1] != self.hidden:
            h, side = h[:, : self.hidden].contiguous(), h
        if not self.sandwich:
            out = self._ffn(h, mix(self.ops.rms_norm(h, self.attn_norm, self.eps, self.zc)))
        else:
            out = self._sandwich(h, mix, side)
        return out if side is None else torch.cat((out, side[:, self.hidden:]), dim=-1)

    def _ffn(self, h: torch.Tensor, mixed: torch.Tensor) -> torch.Tensor:
        """The mixer's residual add, then the FFN's pre-norm and residual. On the exact GPU path the add
        and the norm that reads it are one kernel (ops.add_rms_norm), and the FFN's residual add is in
        its down projection's epilogue (ops.linear_add): the same bits as apart."""
        h, x = self.ops.add_rms_norm(h, mixed, self.ffn_norm, self.eps, self.zc)
        return self.ffn.forward(x, residual=h)

    def _sandwich(self, h: torch.Tensor, mix, side: torch.Tensor | None) -> torch.Tensor:
        """Gemma: h + norm(mixer(norm(h))), then h + norm(ffn(norm(h))); then (E-variants) the per-layer
        input's gated path, h + norm(proj(gelu(h @ gate^T) * input)); then h * the layer's scalar."""
        norm = lambda x, w: self.ops.rms_norm(x, w, self.eps, self.zc)  # noqa: E731
        h = h + norm(mix(norm(h, self.attn_norm)), self.post_attn_norm)
        h = h + norm(self.ffn.forward(norm(h, self.ffn_norm)), self.post_ffn_norm)
        if self.ple is not None:
            gate, proj, pnorm, cols = self.ple
            g = gelu_tanh_mul(torch.cat((self.ops.linear(h, gate), side[:, cols]), dim=-1))
            h = h + norm(self.ops.linear(g, proj), pnorm)
        return h if self.scalar is None else h * self.scalar
