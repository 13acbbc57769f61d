"""Feed-forward blocks: dense gated FFN (SwiGLU, Gemma's GeGLU, Step's clamped SwiGLU), and mixture of
experts with an optional (gated) shared expert."""

from __future__ import annotations

from functools import partial

import torch

from memra.config import ModelConfig
from memra.kernels import reference
from memra.kernels.table import KernelTable


class Mlp:
    """w_gate_up [2F, E] (gate rows first), w_down [E, F]. act: "silu" | "gelu_tanh"; limit: Step's clamp."""

    def __init__(self, w: dict[str, torch.Tensor], ops: KernelTable, act: str = "silu", limit: float | None = None):
        self.w_gate_up, self.w_down, self.ops = w["w_gate_up"], w["w_down"], ops
        self.act = (None if act == "silu" and limit is None  # the table's fused gate-up + SwiGLU
                    else reference.gelu_tanh_mul if act == "gelu_tanh"
                    else partial(reference.clamped_silu_mul, limit=limit))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, E] -> [T, E]; with `residual`, residual + that (in the down projection's launch where it can)."""
        if self.act is None:
            act = self.ops.linear_silu_mul(x, self.w_gate_up)  # [T, F]
        else:  # elementwise in torch (row-wise: a row's bits are its own), around the table's matmul
            act = self.act(self.ops.linear(x, self.w_gate_up))
        return self.ops.linear(act, self.w_down) if residual is None else self.ops.linear_add(act, self.w_down, residual)


class Moe:
    """router [X, E]; experts w_gate_up [X, 2F, E], w_down [X, E, F];
    shared expert shared_gate_up [2Fs, E], shared_down [E, Fs], shared_gate [1, E] (sigmoid scale) — optional;
    router_bias [X] fp32 (Step's sigmoid routing: chosen by score + bias) — optional."""

    def __init__(self, cfg: ModelConfig, layer: int, w: dict[str, torch.Tensor], ops: KernelTable):
        self.top_k, self.normalize, self.ops = cfg.moe.top_k, cfg.moe.norm_topk, ops
        self.router, self.w_gate_up, self.w_down = w["router"], w["w_gate_up"], w["w_down"]
        limit = lambda limits: limits[layer] if limits and layer < len(limits) else None  # noqa: E731
        shared_limit, self.limit = limit(cfg.shared_limits), limit(cfg.swiglu_limits)
        self.shared = (Mlp({"w_gate_up": w["shared_gate_up"], "w_down": w["shared_down"]}, ops, limit=shared_limit)
                       if "shared_gate_up" in w else None)
        self.shared_gate, self.bias, self.scale = w.get("shared_gate"), w.get("router_bias"), cfg.moe_scale
        self.act = None if self.limit is None else partial(reference.clamped_silu_mul, limit=self.limit)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, E] -> residual + (routed experts + shared expert); the two adds in the experts' combine
        where it runs as a kernel (ops.moe_experts), with the bits of the adds apart."""
        weights, ids = self.ops.moe_route(self.ops.linear(x, self.router), self.top_k, self.normalize, x.dtype,
                                          self.bias)
        s = gate = None
        if self.shared is not None:
            s = self.shared.forward(x)
            if self.shared_gate is not None:  # scaled by sigmoid(gate) in moe_experts (its combine, where it can)
                gate = self.ops.linear(x, self.shared_gate)  # [T, 1]
        return self.ops.moe_experts(x, weights, ids, self.w_gate_up, self.w_down, shared=s, residual=residual,
                                    act=self.act, scale=self.scale, shared_gate=gate)
