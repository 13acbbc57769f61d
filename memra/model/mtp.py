"""MTP (NextN) block: predicts token t+2 from the trunk's final-normed hidden at t and the token at t+1.

    e  = norm_e(embed[x_{t+1}]);  hn = norm_h(h_t);  u = [e | hn] @ fc^T
    u  = Block(u)  (full attention with its own KV, at layer index n_layers + j)
    logits = lm_head(norm(u))
It shares the trunk's embedding and LM head. Used as the speculative drafter.
"""

from __future__ import annotations

import torch

from memra.config import ModelConfig
from memra.kernels.table import KernelTable
from memra.model.block import Block
from memra.model.context import StepContext


class MtpBlock:
    """fc [E, 2E]; enorm, hnorm, norm [E] fp32; block.* a full-attention Block."""

    def __init__(self, cfg: ModelConfig, j: int, w: dict[str, torch.Tensor], ops: KernelTable):
        self.eps, self.zc, self.ops = cfg.norm_eps, cfg.zero_centered_norm, ops
        self.fc, self.enorm, self.hnorm, self.norm = w["fc"], w["enorm"], w["hnorm"], w["norm"]
        block_w = {k[len("block."):]: v for k, v in w.items() if k.startswith("block.")}
        ffn = "moe" if "moe.router" in block_w else "dense"
        self.block = Block(cfg, cfg.n_layers + j, "attention", ffn, block_w, ops)

    def forward(self, h_normed: torch.Tensor, next_embed: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """h_normed [T, E] (trunk output after its final norm), next_embed [T, E] -> normed draft hidden [T, E]."""
        e = self.ops.rms_norm(next_embed, self.enorm, self.eps, self.zc)
        hn = self.ops.rms_norm(h_normed, self.hnorm, self.eps, self.zc)
        u = self.ops.linear(torch.cat((e, hn), dim=-1), self.fc)
        u = self.block.forward(u, ctx)
        return self.ops.rms_norm(u, self.norm, self.eps, self.zc)
