"""Feed-forward blocks: dense gated FFN (SwiGLU, Gemma's GeGLU, Step's clamped SwiGLU), and mixture of
experts with an optional (gated) shared expert."""

from __future__ import annotations

from functools import partial

import torch

from memra import counters
from memra.config import ModelConfig
from memra.kernels import reference
from memra.kernels.table import GEMV_ROWS, KernelTable

# The MoE weights that multiply the same input, laid out as consecutive rows of one tensor (merge_moe_fronts)
FRONT = ("router", "shared_gate", "shared_gate_up")


def merge_moe_fronts(weights: dict[str, torch.Tensor]) -> int:
    """Lay each MoE layer's router [X, E], shared-expert gate [1, E] and shared gate/up [2Fs, E] out as one
    tensor [X + 1 + 2Fs, E], with views of it in their places in `weights`, so a decode step can read the three in
    one launch (Moe.forward, MEMRA_MOE_FRONT). The values, and every call on the three apart, are as before (a
    row slice of a contiguous tensor is contiguous); an in-place weight update writes the shared storage. Only
    where the three are plain tensors of one dtype and device. -> the layers merged."""
    merged = 0
    for key in [k for k in weights if k.endswith("moe.router")]:
        prefix = key[: -len("router")]
        parts = [weights.get(prefix + name) for name in FRONT]
        if not all(isinstance(p, torch.Tensor) and p.dim() == 2 for p in parts) \
                or len({(p.dtype, p.device, p.shape[1]) for p in parts}) != 1:
            continue
        front = torch.cat(parts)
        at = 0
        for name, part in zip(FRONT, parts):
            weights[prefix + name] = front[at : at + part.shape[0]]
            at += part.shape[0]
        merged += 1
    return merged


def front_of(w: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """The one tensor whose consecutive rows are w's router, shared gate and shared gate/up, as merge_moe_fronts
    lays them out; None where they are apart (or views of something else, such as a loader's buffer)."""
    parts = [w.get(name) for name in FRONT]
    if not all(isinstance(p, torch.Tensor) for p in parts):
        return None
    base = parts[0]._base
    if base is None or base.dim() != 2 or base.shape[0] != sum(p.shape[0] for p in parts):
        return None
    at = base.data_ptr()
    for p in parts:
        if p._base is not base or p.data_ptr() != at or p.shape[1:] != base.shape[1:] or not p.is_contiguous():
            return None
        at += p.numel() * p.element_size()
    return base


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
        # the three weights' one tensor where merge_moe_fronts laid them out (a plain SwiGLU shared expert only)
        self.front = front_of(w) if self.shared is not None and self.shared.act is None else None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, E] -> residual + (routed experts + shared expert); the two adds in the experts' combine
        where it runs as a kernel (ops.moe_experts), with the bits of the adds apart."""
        if self._front_merged(x):  # one launch for the three weights that read x
            logits, gate, gate_up = self.ops.linear(x, self.front).split(
                [self.router.shape[0], 1, self.shared.w_gate_up.shape[0]], dim=-1)  # [T, X], [T, 1], [T, 2Fs]
            s = self.ops.linear(self.ops.silu_mul(gate_up), self.shared.w_down)  # Mlp.forward's GEMV rows
            counters.bump("moe_front_merged")
        else:
            logits, s, gate = self.ops.linear(x, self.router), None, None
            if self.shared is not None:
                s = self.shared.forward(x)
                if self.shared_gate is not None:  # scaled by sigmoid(gate) in moe_experts (its combine, where it can)
                    gate = self.ops.linear(x, self.shared_gate)  # [T, 1]
        weights, ids = self.ops.moe_route(logits, self.top_k, self.normalize, x.dtype, self.bias)
        return self.ops.moe_experts(x, weights, ids, self.w_gate_up, self.w_down, shared=s, residual=residual,
                                    act=self.act, scale=self.scale, shared_gate=gate)

    def _front_merged(self, x: torch.Tensor) -> bool:
        """The three weights in one launch (MEMRA_MOE_FRONT): laid out as one, and the Triton kernel's GEMV bucket
        (up to GEMV_ROWS rows, on the exact path), where a column's bits do not depend on the weight's other rows
        and the shared expert's SwiGLU runs apart anyway; past it the shared gate/up keeps its fused epilogue."""
        return (self.front is not None and self.ops.moe_front and self.ops.triton_path(x)
                and x.numel() // x.shape[-1] <= GEMV_ROWS)
