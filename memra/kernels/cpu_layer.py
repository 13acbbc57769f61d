"""A dense decoder layer's decode step in one C call (memra/kernels/cpu/layer.cpp), its plan made once.

A decode step of a 24-layer model calls ~15 ops a layer through Python (norms, four packed linears,
q/k norms, RoPE and attention, SwiGLU, the residual adds); on CPU each costs microseconds of dispatch
beyond its arithmetic, and small models pay it most. For the blocks it covers (attention + SwiGLU MLP,
every projection a packed GGUF weight the integer-dot kernel reads, fp32, no bias, gate, window or shared
KV), the layer's shapes, weight pointers and norms are bound into a `LayerPlan` at its first decode step,
and each token is one call: the same kernels in the same order as the op-by-op path under MEMRA_CPU_DECODE,
so the same bits (tests/test_cpu_decode.py), and no Python between them.
"""

from __future__ import annotations

import ctypes

import torch

from memra import counters
from memra.kernels import cpu_decode, cpu_qdot, split

MAX_PARTS = 8  # layer.cpp's kMaxParts: row blocks of several formats in one weight (Q4_K_M's qkv, say)
_KIND = {split.Q8Split: 8, split.Q4KSplit: 4, split.Q5KSplit: 5, split.Q6KSplit: 6}


class Part(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int64), ("n", ctypes.c_int64), ("q", ctypes.c_void_p), ("d", ctypes.c_void_p),
                ("dmin", ctypes.c_void_p), ("sc", ctypes.c_void_p), ("mn", ctypes.c_void_p)]


class Weight(ctypes.Structure):
    _fields_ = [("n", ctypes.c_int64), ("k", ctypes.c_int64), ("nparts", ctypes.c_int64), ("parts", Part * MAX_PARTS)]


class LayerPlan(ctypes.Structure):
    _fields_ = [("E", ctypes.c_int64), ("Hq", ctypes.c_int64), ("Hkv", ctypes.c_int64), ("D", ctypes.c_int64),
                ("F", ctypes.c_int64), ("eps", ctypes.c_float), ("scale", ctypes.c_float),
                ("attn_norm", ctypes.c_void_p), ("ffn_norm", ctypes.c_void_p), ("q_norm", ctypes.c_void_p),
                ("k_norm", ctypes.c_void_p), ("wqkv", Weight), ("wo", Weight), ("wgu", Weight), ("wdown", Weight)]


def _weight(w) -> Weight | None:
    """A packed weight's C description, or None where the kernel cannot read every part of it."""
    parts = w.parts if isinstance(w, split.SplitRows) else (w,)
    if len(parts) > MAX_PARTS or not all(type(p) in _KIND for p in parts):
        return None
    out = Weight(n=w.shape[0], k=w.shape[1], nparts=len(parts))
    for i, p in enumerate(parts):
        kind = _KIND[type(p)]
        quants = p.qs if kind == 4 else p.ql if kind == 6 else p.q
        ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
        mn = p.qh if kind == 6 else getattr(p, "mins", None)  # Q6_K's high-bit plane rides in the min slot
        out.parts[i] = Part(kind, p.shape[0], ptr(quants), ptr(p.d), ptr(getattr(p, "dmin", None)), ptr(p.scale if
                            kind != 8 else None), ptr(mn))
        assert all(t.is_contiguous() for t in p._tensors().values())
    return out


def _f32(t: torch.Tensor | None) -> bool:
    return t is None or (t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous())


def plan_for(block) -> LayerPlan | None:
    """The block's LayerPlan, or None where layer.cpp does not cover it (the op-by-op path runs)."""
    from memra.model.attention import Attention
    from memra.model.ffn import Mlp

    a, f = block.mixer, block.ffn
    if not (block.ops.cpu_ops and block.ops.qdot and isinstance(a, Attention) and isinstance(f, Mlp)
            and f.act is None and not block.sandwich and block.ple is None and block.scalar is None):
        return None
    if (a.bqkv is not None or a.gated or a.head_gate or a.k_eq_v or a.v_norm is not None or a.shared_kv
            or a.window is not None or a.rope_cols is not None or a.head_dim % 8 or block.hidden % 8
            or a.head_dim > cpu_decode.MAX_HEAD_DIM or a.n_heads % a.n_kv):
        return None
    if not all(_f32(t) for t in (block.attn_norm, block.ffn_norm, a.q_norm, a.k_norm)):
        return None
    weights = [_weight(w) if isinstance(w, split.SPLIT_TYPES) else None for w in (a.wqkv, a.wo, f.w_gate_up, f.w_down)]
    if any(w is None for w in weights):
        return None
    ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
    return LayerPlan(block.hidden, a.n_heads, a.n_kv, a.head_dim, f.w_down.shape[1], block.eps, a.scale,
                     ptr(block.attn_norm), ptr(block.ffn_norm), ptr(a.q_norm), ptr(a.k_norm), *weights)


def decode(plan: LayerPlan, h: torch.Tensor, ctx, layer: int) -> torch.Tensor:
    """h [1, E] (one token at ctx) -> [1, E] through the planned layer (its block holds the weights the plan
    points into); the token's K/V are written to the pool."""
    lib = cpu_qdot.library()
    out = h.contiguous().clone()
    kv = ctx.cache.kv
    k_pool, v_pool = kv.k[layer], kv.v[layer]
    lib.memra_decode_layer(ctypes.byref(plan), out.data_ptr(), ctx.cos.data_ptr(), ctx.sin.data_ptr(),
                           ctx.cos.shape[-1], k_pool.data_ptr(), v_pool.data_ptr(), ctx.kv_write_rows.data_ptr(),
                           ctx.kv_read_rows.data_ptr(), ctx.kv_read_rows.numel(), torch.get_num_threads(), lib.avx2)
    counters.bump("cpu_layer_steps")
    return out
