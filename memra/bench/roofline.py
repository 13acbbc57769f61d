"""The roofline: what a decode or prefill step must read and compute, from the model actually built.

Decode is bound by the bytes a step must read (the weights once, with routed experts at their expected
share, plus each sequence's KV and recurrent state) over the read bandwidth; prefill by the slower of
FLOPs over the matmul peak and weight bytes over the bandwidth. The probes (memra.bench.probes) supply
the bandwidth and the peak; this module only counts.
"""

from __future__ import annotations

import math

import torch

from memra.config import ModelConfig
from memra.errors import MemraError
from memra.random_model import canonical_shapes


def tensor_bytes(t) -> int:
    """Bytes a weight occupies (and a step reads): packed bytes for a packed weight (its nbytes, as a tensor's)."""
    return t.nbytes


def tensor_numel(t) -> int:
    return math.prod(tuple(t.shape))


def trunk_weights(model) -> dict[str, torch.Tensor]:
    """The weights a plain decode or prefill step reads, by canonical name (memra.random_model
    .canonical_shapes): embedding, every decoder layer, final norm, LM head — not the MTP blocks.
    Read back from the built model, so the byte counts are those of the tensors actually in memory."""
    cfg = model.cfg
    out = {"embed": model.embed, "final_norm": model.final_norm, "lm_head": model.lm_head}
    for name, shape in canonical_shapes(cfg).items():
        if not name.startswith("layers."):
            continue
        _, i, rest = name.split(".", 2)
        block = model.blocks[int(i)]
        if rest in ("attn_norm", "ffn_norm"):
            t = getattr(block, rest)
        else:
            part, leaf = rest.split(".", 1)
            owner = block.mixer if part in ("attn", "gdn") else block.ffn
            if leaf in ("shared_gate_up", "shared_down"):
                owner, leaf = owner.shared, "w_gate_up" if leaf == "shared_gate_up" else "w_down"
            t = getattr(owner, leaf)
        if tuple(t.shape) != tuple(shape):
            raise MemraError(f"{name}: the model holds shape {tuple(t.shape)}, the canonical layout says {shape}; "
                             f"memra.bench.roofline.trunk_weights needs updating for this layout")
        out[name] = t
    for i, block in enumerate(model.blocks):  # qkv biases (Qwen2) are not in the canonical shape list
        if getattr(block.mixer, "bqkv", None) is not None:
            out[f"layers.{i}.attn.bqkv"] = block.mixer.bqkv
    for name, shape in (("embed", (cfg.vocab_size, cfg.hidden_size)), ("lm_head", (cfg.vocab_size, cfg.hidden_size))):
        if tuple(out[name].shape) != shape:
            raise MemraError(f"{name}: shape {tuple(out[name].shape)}, expected {shape}")
    return out


ROUTED = ("moe.w_gate_up", "moe.w_down")  # per-expert tensors: a step reads only the routed experts' rows


def experts_touched(n_experts: int, top_k: int, tokens: int) -> float:
    """Expected distinct experts a forward over `tokens` tokens reads, assuming each token routes to
    top_k of n_experts uniformly and independently: exactly top_k at one token, approaching all n as
    tokens grow, never above min(tokens * top_k, n). Random weights route close to uniformly; a
    trained router is skewed, so it touches fewer experts and its true roofline is a little higher."""
    if tokens <= 1:
        return float(min(top_k, n_experts)) if tokens == 1 else 0.0
    return n_experts * (1.0 - (1.0 - top_k / n_experts) ** tokens)


def weight_bytes(model, tokens: int) -> float:
    """Bytes of weights one forward over `tokens` token rows must read: every trunk tensor once, except
    the embedding (only the `tokens` rows gathered) and the routed experts (their expected share)."""
    cfg, total = model.cfg, 0.0
    for name, t in trunk_weights(model).items():
        b = tensor_bytes(t)
        if name == "embed":
            b = min(tokens, cfg.vocab_size) * cfg.hidden_size * t.element_size()
        elif name.endswith(ROUTED):
            b *= experts_touched(cfg.moe.n_experts, cfg.moe.top_k, tokens) / cfg.moe.n_experts
        total += b
    return total


def cache_parts(cfg: ModelConfig, dtype: torch.dtype, context: int) -> tuple[int, int]:
    """One sequence's cache (memra.cache layout): (K and V of `context` positions over the attention
    layers, the recurrent state of the GDN layers: the delta-rule state in its dtype + conv window) in bytes."""
    item = torch.empty((), dtype=dtype).element_size()
    kv = len(cfg.attention_layers) * context * 2 * cfg.attn.n_kv_heads * cfg.attn.head_dim * item
    rec = 0
    if cfg.gdn is not None:
        g = cfg.gdn
        state_item = g.state_torch_dtype.itemsize  # fp32 or bf16 (GdnConfig.state_dtype)
        per_layer = g.n_v_heads * g.k_head_dim * g.v_head_dim * state_item + g.conv_dim * (g.conv_kernel - 1) * item
        rec = len(cfg.gdn_layers) * per_layer
    return kv, rec


def state_bytes(cfg: ModelConfig, dtype: torch.dtype, context: int) -> int:
    """Bytes one sequence's decode step moves in its cache: the KV of `context` positions (read; the new
    token's K/V write is negligible) and the GDN recurrent state read and written back (it is replaced
    every step, so its write is as unavoidable as its read)."""
    kv, rec = cache_parts(cfg, dtype, context)
    return kv + 2 * rec


def cache_bytes(cfg: ModelConfig, dtype: torch.dtype, context: int) -> int:
    """Memory one sequence's cache of `context` positions holds."""
    return sum(cache_parts(cfg, dtype, context))


def decode_step_bytes(model, batch: int, context: int) -> float:
    """Bytes a decode step of `batch` sequences, each at `context` positions, must move."""
    return weight_bytes(model, batch) + batch * state_bytes(model.cfg, model.dtype, context)


def roofline_decode_tokens_per_s(model, batch: int, bandwidth: float, *, context: int) -> float:
    """The bandwidth bound of decode: batch tokens per (bytes that must be read / read bandwidth)."""
    return batch / (decode_step_bytes(model, batch, context) / bandwidth)


def token_flops(model) -> float:
    """Matmul FLOPs of one token through the trunk: 2 per weight of every matmul (the routed experts at
    top_k / n_experts of theirs), neither the embedding (a gather) nor the LM head (counted per logits row)."""
    cfg, per_token = model.cfg, 0.0
    for name, t in trunk_weights(model).items():
        if name in ("embed", "lm_head") or len(t.shape) < 2 or name.endswith(".gdn.conv"):
            continue
        n = tensor_numel(t)  # a packed QuantWeight counts its logical [N, K]
        if name.endswith(ROUTED):
            n *= cfg.moe.top_k / cfg.moe.n_experts
        per_token += 2 * n
    return per_token


def attention_flops(cfg: ModelConfig, keys: float) -> float:
    """QK^T and PV over `keys` (query, key) pairs in every attention layer: 2 FLOPs a multiply-add, 2 products."""
    return len(cfg.attention_layers) * 4 * cfg.attn.n_heads * cfg.attn.head_dim * keys


def gdn_flops(cfg: ModelConfig, tokens: int) -> float:
    """An estimate of the chunked delta rule over `tokens` tokens in every GDN layer (state apply + update, and
    the intra-chunk products); 0 without GDN layers."""
    from memra.kernels.reference import GDN_CHUNK

    if cfg.gdn is None:
        return 0.0
    g = cfg.gdn
    per_head = 6 * g.k_head_dim * g.v_head_dim + 2 * GDN_CHUNK * (g.k_head_dim + g.v_head_dim)
    return len(cfg.gdn_layers) * g.n_v_heads * per_head * tokens


def prefill_flops(model, tokens: int, pos0: int = 0) -> float:
    """FLOPs of priming `tokens` tokens of one sequence from position pos0: the trunk's matmuls per token,
    the LM head once (prime computes only the last position's logits), causal attention over the prefix
    (the token at position p attends to p + 1 keys), and the chunked delta rule's estimate."""
    cfg = model.cfg
    keys = tokens * pos0 + tokens * (tokens + 1) / 2
    return (token_flops(model) * tokens + 2 * cfg.vocab_size * cfg.hidden_size + attention_flops(cfg, keys)
            + gdn_flops(cfg, tokens))


def roofline_prefill_tokens_per_s(model, tokens: int, bandwidth: float, matmul_flops: float, pos0: int = 0) -> float:
    """The prefill bound: tokens / max(FLOPs / matmul peak, weight bytes / read bandwidth)."""
    seconds = max(prefill_flops(model, tokens, pos0) / matmul_flops, weight_bytes(model, tokens) / bandwidth)
    return tokens / seconds
