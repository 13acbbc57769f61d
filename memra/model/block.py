"""A decoder block: pre-norm mixer (attention or GDN) and pre-norm FFN (dense or MoE), each residual."""

from __future__ import annotations

import torch

from memra.config import ModelConfig
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
        self.ffn = Moe(cfg, sub("moe."), ops) if ffn == "moe" else Mlp(sub("mlp."), ops)

    def forward(self, h: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """h [T, E] -> [T, E]: T tokens of one sequence."""
        return self._ffn(h, self.mixer.forward(self.ops.rms_norm(h, self.attn_norm, self.eps, self.zc), ctx))

    def forward_segments(self, h: torch.Tensor, wave: Segments) -> torch.Tensor:
        """h [N, E] -> [N, E]: prompt pieces of several sequences in one forward (cross-request prefill).
        Row-wise work (norms, projections, FFN / MoE) runs over all N rows; the mixer's sequence-mixing
        part runs piece by piece. Exact only where every row-wise op is batch-invariant (memra.step)."""
        x = self.ops.rms_norm(h, self.attn_norm, self.eps, self.zc)
        return self._ffn(h, self.mixer.forward_segments(x, wave))

    def forward_mixed(self, h: torch.Tensor, step: StackedStep, wave: Segments) -> torch.Tensor:
        """h [B + N, E] -> [B + N, E]: a decode step's B rows, then a prefill wave's N rows, in one forward
        (memra.step.mixed_step). Row-wise work over all rows; each kind's mixer part as its own forward."""
        return self._ffn(h, self.mixer.forward_mixed(self.ops.rms_norm(h, self.attn_norm, self.eps, self.zc), step, wave))

    def forward_stacked(self, h: torch.Tensor, step: StackedStep) -> torch.Tensor:
        """h [B, E] -> [B, E]: one token each of B sequences, stacked (the fast, non-exact decode)."""
        return self._ffn(h, self.mixer.forward_stacked(self.ops.rms_norm(h, self.attn_norm, self.eps, self.zc), step))

    def forward_tokens(self, h: torch.Tensor, step: StackedStep) -> torch.Tensor:
        """h [T, E] -> [T, E]: T consecutive generated tokens of one sequence (the stacked verify body).
        Attention's stacked form already attends row by row in order, each row after writing its own
        K/V, so row j sees rows < j exactly as decode would; GDN advances its state token by token."""
        x = self.ops.rms_norm(h, self.attn_norm, self.eps, self.zc)
        mixed = self.mixer.forward_stacked(x, step) if isinstance(self.mixer, Attention) else self.mixer.forward_tokens(x, step)
        return self._ffn(h, mixed)

    def _ffn(self, h: torch.Tensor, mixed: torch.Tensor) -> torch.Tensor:
        """The mixer's residual add, then the FFN's pre-norm and residual. On the exact GPU path the add
        and the norm that reads it are one kernel (ops.add_rms_norm), and the FFN's residual add is in
        its down projection's epilogue (ops.linear_add): the same bits as apart."""
        h, x = self.ops.add_rms_norm(h, mixed, self.ffn_norm, self.eps, self.zc)
        return self.ffn.forward(x, residual=h)
