"""Gemma 4 and Step-3.5 GGUFs: their `{arch}.*` keys rewritten as the config.json fields that
memra.config.from_hf_gemma4 / from_hf_step read, so each architecture has one builder and one set of checks.

llama.cpp's converter leaves some of the config implicit, and its loader hard-codes it; we do the same:
- gemma4: whether global layers use K as V (`attention_k_eq_v`) shows only in the tensors (a global layer
  that projects K/V itself has no `attn_v`); the global layers' "proportional" RoPE is written as a
  `rope_freqs` tensor whose 1e30 entries switch pairs off, so the rotating fraction is read from it;
  double-wide FFNs are the per-layer `feed_forward_length`; the activation is always GELU (tanh).
- step35: full-attention layers rotate half of each head and sliding ones all of it; the softmax scale
  is head_dim ** -0.5; the first `leading_dense_block_count` layers are dense, the rest MoE; appended
  MTP blocks (`nextn_predict_layers`) are not part of the trunk.
"""

from __future__ import annotations

from typing import Any, Callable

from memra.config.fields import Fields
from memra.errors import ConfigError

SLIDING_GGUF_ARCHITECTURES = {"gemma4": "gemma4", "step35": "step3p5"}

HasTensor = Callable[[str], bool]
ReadTensor = Callable[[str], list[float]]


_FIX = "re-convert the file with llama.cpp's convert_hf_to_gguf.py"


class _Keys:
    """The `{arch}.` keys of one file, read through memra.config.fields.Fields (a missing required key fails
    naming the full key); their values are checked where the config.json builder reads them."""

    def __init__(self, meta: dict[str, Any], arch: str, source: str):
        self.arch, self.source = arch, source
        prefixed = {k[len(arch) + 1:]: v for k, v in meta.items() if k.startswith(arch + ".")}
        self.fields = Fields(source, (arch + ".", prefixed), home=arch + ".", fix=_FIX)

    def get(self, name: str, default: Any = ...) -> Any:
        found = self.fields.find(name)
        if found is None and default is ...:
            raise self.fields.error(f"required key {self.arch}.{name} is missing")
        return default if found is None else found[1]

    def per_layer(self, name: str, n_layers: int, default: Any = ...) -> list:
        """A per-layer array, or one value for every layer."""
        value = self.get(name, default)
        values = list(value) if isinstance(value, (list, tuple)) else [value] * n_layers
        self.fields.require(len(values) >= n_layers, f"{self.arch}.{name} has {len(values)} entries for "
                                                     f"{n_layers} layers; the file is corrupt")
        return values[:n_layers]


def _layer_types(k: _Keys, n_layers: int) -> list[str]:
    pattern = k.per_layer("attention.sliding_window_pattern", n_layers)
    return ["sliding_attention" if p else "full_attention" for p in pattern]


def _common(k: _Keys, n_layers: int, vocab: int, tied: bool) -> dict[str, Any]:
    return {"hidden_size": k.get("embedding_length"), "num_hidden_layers": n_layers, "vocab_size": vocab,
            "rms_norm_eps": k.get("attention.layer_norm_rms_epsilon"), "tie_word_embeddings": tied,
            "max_position_embeddings": k.get("context_length", 8192), "sliding_window": k.get("attention.sliding_window"),
            "layer_types": _layer_types(k, n_layers)}


def _one(values: list, what: str, k: _Keys) -> Any:
    if len(set(values)) != 1:
        raise ConfigError(f"{k.source}: {what} differ across layers ({values}); memra needs one value")
    return values[0]


def gemma4_config(k: _Keys, vocab: int, has: HasTensor, read: ReadTensor) -> dict[str, Any]:
    if k.get("expert_count", 0):
        raise ConfigError(f"{k.source}: Gemma 4 with experts (the 26B-A4B MoE) is not supported yet; its dense "
                          "variants (E2B, E4B, 31B) are")
    n_layers = k.get("block_count")
    cfg = _common(k, n_layers, vocab, tied=not has("output.weight"))
    types = cfg["layer_types"]
    shared = k.get("attention.shared_kv_layers", 0)
    first_shared = n_layers - shared
    widths = k.per_layer("feed_forward_length", n_layers)
    base = widths[0]
    if any(w not in (base, 2 * base) or (w != base and i < first_shared) for i, w in enumerate(widths)):
        raise ConfigError(f"{k.source}: {k.arch}.feed_forward_length {widths} is not one width (doubled on the "
                          "KV-sharing layers)")
    heads = _one(k.per_layer("attention.head_count", n_layers), f"{k.arch}.attention.head_count", k)
    kv = k.per_layer("attention.head_count_kv", n_layers, heads)
    slide_kv = _one([n for n, t in zip(kv, types) if t == "sliding_attention"] or [heads], "sliding KV heads", k)
    global_kv = _one([n for n, t in zip(kv, types) if t == "full_attention"] or [slide_kv], "global KV heads", k)
    global_dim = k.get("attention.key_length")
    owners = [i for i in range(first_shared) if types[i] == "full_attention"]
    k_eq_v = bool(owners) and not has(f"blk.{owners[0]}.attn_v.weight")
    rope_full: dict[str, Any] = {"rope_theta": k.get("rope.freq_base"), "rope_type": "default"}
    if has("rope_freqs.weight"):  # proportional RoPE: pairs with a factor of 1e30 do not rotate
        factors = read("rope_freqs.weight")
        rope_full = {**rope_full, "rope_type": "proportional",
                     "partial_rotary_factor": 2 * sum(1 for f in factors if f < 1e29) / global_dim}
    cfg.update({
        "model_type": "gemma4_text", "num_attention_heads": heads, "num_key_value_heads": slide_kv,
        "num_global_key_value_heads": global_kv, "head_dim": k.get("attention.key_length_swa", global_dim),
        "global_head_dim": global_dim, "attention_k_eq_v": k_eq_v, "num_kv_shared_layers": shared,
        "intermediate_size": base, "use_double_wide_mlp": any(w != base for w in widths),
        "hidden_activation": "gelu_pytorch_tanh",
        "rope_parameters": {"sliding_attention": {"rope_theta": k.get("rope.freq_base_swa", 10000.0),
                                                  "rope_type": "default"},
                            "full_attention": rope_full},
        "hidden_size_per_layer_input": k.get("embedding_length_per_layer_input", 0),
        "vocab_size_per_layer_input": vocab,
    })
    if (cap := k.get("final_logit_softcapping", None)) is not None:
        cfg["final_logit_softcapping"] = cap
    return cfg


def step35_config(k: _Keys, vocab: int, has: HasTensor) -> dict[str, Any]:
    n_layers = k.get("block_count") - k.get("nextn_predict_layers", 0)
    cfg = _common(k, n_layers, vocab, tied=not has("output.weight"))
    types = cfg["layer_types"]
    heads = k.per_layer("attention.head_count", n_layers)
    full = _one([h for h, t in zip(heads, types) if t == "full_attention"] or heads[:1], "full-attention heads", k)
    slide = _one([h for h, t in zip(heads, types) if t == "sliding_attention"] or [full], "sliding heads", k)
    kv = _one(k.per_layer("attention.head_count_kv", n_layers), f"{k.arch}.attention.head_count_kv", k)
    dense = k.get("leading_dense_block_count", 0)
    every = k.get("moe_every_n_layers", 1) or 1
    mlp = ["dense" if i < dense or (i - dense) % every else "sparse" for i in range(n_layers)]
    theta = k.get("rope.freq_base")
    cfg.update({
        "model_type": "step3p5", "num_attention_heads": full, "num_sliding_attention_heads": slide,
        "num_key_value_heads": kv, "head_dim": k.get("attention.key_length"),
        "intermediate_size": k.get("feed_forward_length"), "mlp_layer_types": mlp,
        "rope_parameters": {"full_attention": {"rope_theta": theta, "partial_rotary_factor": 0.5},
                            "sliding_attention": {"rope_theta": k.get("rope.freq_base_swa", theta)}},
    })
    if "sparse" in mlp:
        if k.get("expert_weights_norm", True) is not True or k.get("expert_gating_func", 2) != 2:
            raise ConfigError(f"{k.source}: Step MoE without sigmoid routing renormalised over the chosen experts "
                              f"({k.arch}.expert_gating_func / expert_weights_norm) is not supported")
        cfg.update({"n_routed_experts": k.get("expert_count"), "num_experts_per_tok": k.get("expert_used_count"),
                    "moe_intermediate_size": k.get("expert_feed_forward_length"),
                    "share_expert_dim": k.get("expert_shared_feed_forward_length", 0),
                    "moe_router_scaling_factor": k.get("expert_weights_scale", 1.0)})
    for gguf_name, hf_name in (("swiglu_clamp_exp", "swiglu_limits"), ("swiglu_clamp_shexp", "swiglu_limits_shared")):
        if k.get(gguf_name, None) is not None:
            cfg[hf_name] = k.per_layer(gguf_name, n_layers)
    return cfg


def sliding_hf_config(meta: dict[str, Any], source: str, vocab: int, has: HasTensor, read: ReadTensor) -> dict[str, Any]:
    """config.json fields for a gemma4 / step35 GGUF (`meta`: its metadata; `vocab`: token_embd's rows)."""
    arch = meta["general.architecture"]
    k = _Keys(meta, arch, source)
    return gemma4_config(k, vocab, has, read) if arch == "gemma4" else step35_config(k, vocab, has)
