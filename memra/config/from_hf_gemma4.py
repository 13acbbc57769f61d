"""ModelConfig of a Gemma 4 text model from its config.json (`gemma4` with a `text_config`, or `gemma4_text`).

What differs from the Llama family, all expressed with ModelConfig's per-layer knobs: sliding layers
(window, RoPE theta 10k over the head) alternate with global ones (their own head size and KV heads,
K as V, "proportional" RoPE: a quarter of the frequency pairs rotate, the rest pass); q, k and v
RMS-normed per head (v without a weight) and a softmax scale of 1; norms after each branch too;
GeGLU (tanh); embeddings times sqrt(hidden); the last `num_kv_shared_layers` layers read the K/V of
the last earlier layer of their type (and, with `use_double_wide_mlp`, have twice the FFN width);
per-layer embeddings (E-variants); logits soft-capped. The MoE variant (`enable_moe_block`) is refused.
"""

from __future__ import annotations

from memra.config.fields import (
    FRACTION, MAX_DIM, MAX_POSITION, MAX_VOCAB, ROPE_THETA, Fields, Range, built, str_item,
)
from memra.config.model import AttentionConfig, RopeConfig
from memra.errors import ConfigError

_FIX = "fix the file or re-download the model"


def gemma4_fields(f: Fields, source: str, n_layers: int, hidden: int, n_heads: int) -> dict:
    """The ModelConfig fields Gemma 4 sets itself (the caller adds vocab, hidden, layers, eps, ...)."""
    if f.bool("enable_moe_block", False):
        raise ConfigError(f"{source}: Gemma 4 with enable_moe_block (the 26B-A4B MoE) is not supported yet; "
                          "its dense variants (E2B, E4B, 31B) are")
    if f.str("use_bidirectional_attention", None) == "all":
        raise ConfigError(f"{source}: use_bidirectional_attention = 'all' (an encoder) is not a causal model")
    act = f.str("hidden_activation", "gelu_pytorch_tanh")
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ConfigError(f"{source}: hidden_activation = {act!r} is not supported for Gemma 4 (gelu_pytorch_tanh)")
    layer_types = f.list("layer_types", None, item=str_item)
    if layer_types is None:  # transformers' default: every sixth layer global
        layer_types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n_layers)]
    f.require(len(layer_types) == n_layers, f"layer_types has {len(layer_types)} entries for {n_layers} layers")
    if bad := sorted(set(layer_types) - {"sliding_attention", "full_attention"}):
        raise f.error(f"unknown layer_types entries {bad}")
    layer_types[-1] = "full_attention"  # as transformers forces it
    window = f.int("sliding_window", 512, hi=MAX_POSITION)
    head_dim = f.int("head_dim", 256, hi=MAX_DIM)
    n_kv = f.int("num_key_value_heads", n_heads)
    k_eq_v = f.bool("attention_k_eq_v", False)
    overrides = f.scope("per_layer_config")[1]
    global_dim = f.int("global_head_dim", 512, hi=MAX_DIM)
    global_kv = f.int("num_global_key_value_heads", n_kv) if k_eq_v else n_kv

    shared = f.int("num_kv_shared_layers", 0, lo=0, hi=n_layers)
    first_shared = n_layers - shared
    attns, widths = [], []
    width = f.int("intermediate_size", hi=MAX_DIM)
    double = f.bool("use_double_wide_mlp", False)
    for i, kind in enumerate(layer_types):
        glob = kind == "full_attention"
        over = overrides.get(str(i), overrides.get(i, {}))
        if not isinstance(over, dict):
            raise f.error(f"per_layer_config[{i}] must be an object")
        d = Fields(source, (f"per_layer_config.{i}.", over), fix=_FIX)
        kv_from = None
        if i >= first_shared:
            earlier = [j for j in range(first_shared) if layer_types[j] == kind]
            f.require(bool(earlier), f"layer {i} shares the KV of an earlier {kind} layer, and there is none")
            kv_from = earlier[-1]
        attns.append(built(source, AttentionConfig,
                           n_heads=d.int("num_attention_heads", n_heads), n_kv_heads=d.int(
                               "num_key_value_heads", global_kv if glob else n_kv),
                           head_dim=d.int("head_dim", global_dim if glob else head_dim, hi=MAX_DIM),
                           qkv_bias=f.bool("attention_bias", False), qk_norm=True, scale=1.0, v_norm=True,
                           k_eq_v=k_eq_v and glob, kv_from=kv_from, rope=1 if glob else 0))
        widths.append(width * (2 if double and kv_from is not None else 1))
    # the global layers' RoPE spans their head (per_layer_config may set it where global_head_dim is absent)
    ropes = _ropes(f, source, head_dim, next((a.head_dim for a in attns if a.rope == 1), global_dim))
    ple = f.int("hidden_size_per_layer_input", 0, lo=0, hi=MAX_DIM)
    if ple:
        ple_vocab = f.int("vocab_size_per_layer_input", hi=MAX_VOCAB)
        vocab = f.int("vocab_size", hi=MAX_VOCAB)
        f.require(ple_vocab == vocab, f"vocab_size_per_layer_input = {ple_vocab} differs from vocab_size = {vocab}")
    softcap = f.find("final_logit_softcapping")
    return dict(mixers=("attention",) * n_layers, ffns=("dense",) * n_layers, intermediate_size=width,
                attn=attns[0], layer_attn=tuple(attns), rope=ropes[0], ropes=ropes[1:], zero_centered_norm=True,
                windows=tuple(window if t == "sliding_attention" else None for t in layer_types),
                ffn_act="gelu_tanh", ffn_widths=tuple(widths), sandwich_norm=True, embed_scale=hidden ** 0.5,
                final_softcap=None if softcap is None else f.float("final_logit_softcapping", within=Range(0.0, 1e6, lo_open=True)),
                ple_dim=ple)


def _ropes(f: Fields, source: str, head_dim: int, global_dim: int) -> tuple[RopeConfig, RopeConfig]:
    """(sliding layers' RoPE, global layers' RoPE) from rope_parameters.{sliding,full}_attention."""
    out = []
    for kind, dim, theta in (("sliding_attention", head_dim, 10000.0), ("full_attention", global_dim, 1e6)):
        rp = Fields(source, f.scope("rope_parameters"), fix=_FIX)
        rp = Fields(source, rp.scope(kind), fix=_FIX)
        rope_type = rp.str("rope_type", "default")
        if rope_type not in ("default", "proportional"):
            raise rp.error(f"rope_parameters.{kind}.rope_type = {rope_type!r} is not supported (default, proportional)")
        zero = 0
        if rope_type == "proportional":  # int(partial * dim // 2) pairs rotate, the others are 0-frequency
            partial = rp.float("partial_rotary_factor", 1.0, within=FRACTION)
            zero = dim // 2 - int(partial * dim // 2)
            factor = rp.float("factor", 1.0, within=FRACTION)
            rp.require(factor == 1.0, f"rope_parameters.{kind}.factor = {factor:g}: only 1 is supported")
        out.append(built(source, RopeConfig, theta=rp.float("rope_theta", theta, within=ROPE_THETA), dim=dim,
                         zero_pairs=zero))
    return out[0], out[1]
