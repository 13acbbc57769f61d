"""ModelConfig of a Step-3.5 / Step-3.7 text model from its config.json (`step3p5` text, or the `step3p7`
wrapper with a `text_config`), in transformers' layout (transformers.models.step3p7).

What it is made of, in ModelConfig's knobs: full-attention and sliding-window layers (`layer_types`,
`sliding_window`), the sliding ones with their own head count (`num_sliding_attention_heads`) and each
kind its own RoPE (`rope_parameters.<type>`: theta, partial rotary factor); q/k RMSNorm; a sigmoid gate
per head from its own projection (`g_proj`); softmax scale `query_pre_attn_scalar ** -0.5`; (1+w) norms
computed in fp32; dense SwiGLU layers and MoE layers (`mlp_layer_types`) whose router scores experts
with a sigmoid, chooses the top k of score + `e_score_correction_bias`, renormalises the chosen scores
and scales the routed sum by `moe_router_scaling_factor`, beside an always-on shared expert
(`share_expert_dim`); per-layer clamps of the SwiGLU (`swiglu_limits`, `swiglu_limits_shared`). The
MTP layers (`num_nextn_predict_layers`) are not loaded: they are not a drafter memra runs.
"""

from __future__ import annotations

from typing import Any

from memra.config.fields import FRACTION, MAX_DIM, MAX_POSITION, ROPE_FACTOR, ROPE_THETA, Fields, built, str_item
from memra.config.model import AttentionConfig, MoeConfig, RopeConfig
from memra.errors import ConfigError

_FIX = "fix the file or re-download the model"
_TYPES = ("full_attention", "sliding_attention")


def step_fields(f: Fields, source: str, n_layers: int, n_heads: int, head_dim: int) -> dict[str, Any]:
    """The ModelConfig fields Step sets itself (the caller adds vocab, hidden, layers, eps, ...)."""
    layer_types = f.list("layer_types", None, item=str_item) or ["full_attention"] * n_layers
    f.require(len(layer_types) >= n_layers, f"layer_types has {len(layer_types)} entries for {n_layers} layers")
    layer_types = layer_types[:n_layers]  # hub configs pad it with the MTP layers' entries
    if bad := sorted(set(layer_types) - set(_TYPES)):
        raise f.error(f"layer_types entries {bad} are not supported (full_attention, sliding_attention)")
    gating = f.find("gating")
    if gating is not None and gating[1] not in (True, "per-head"):
        raise f.error(f"gating = {gating[1]!r} is not supported (a gate per head)")
    if f.bool("mlp_bias", False) or f.bool("use_bidirectional_attention", False):
        raise f.error("mlp_bias and use_bidirectional_attention are not supported")
    n_kv = f.int("num_key_value_heads", n_heads, "num_attention_groups")
    slide_heads = f.int("num_sliding_attention_heads", n_heads)
    scale = f.int("query_pre_attn_scalar", head_dim, hi=MAX_DIM) ** -0.5
    attns, ropes = [], _ropes(f, source, layer_types, head_dim)
    for kind in layer_types:
        heads = slide_heads if kind == "sliding_attention" else n_heads
        f.require(heads % n_kv == 0, f"{heads} attention heads are not a multiple of {n_kv} KV heads")
        attns.append(built(source, AttentionConfig, n_heads=heads, n_kv_heads=n_kv, head_dim=head_dim,
                           qkv_bias=f.bool("attention_bias", False), qk_norm=True, head_gate=True, scale=scale,
                           rope=_TYPES.index(kind)))
    mlp_types = (f.list("mlp_layer_types", None, item=str_item) or ["sparse"] * n_layers)[:n_layers]
    f.require(len(mlp_types) == n_layers and set(mlp_types) <= {"sparse", "dense"},
              f"mlp_layer_types must name 'sparse' or 'dense' for each of the {n_layers} layers")
    ffns = tuple("moe" if t == "sparse" else "dense" for t in mlp_types)
    moe = None
    if "moe" in ffns:
        n_experts = f.int("n_routed_experts", None, "num_local_experts", "moe_num_experts")
        if n_experts is None:
            raise f.error("an MoE layer needs 'n_routed_experts'")
        top_k = f.int("num_experts_per_tok", None, "moe_top_k")
        f.require(top_k is not None and top_k <= n_experts, f"num_experts_per_tok must be 1..{n_experts}")
        moe = built(source, MoeConfig, n_experts=n_experts, top_k=top_k,
                    expert_ffn=f.int("moe_intermediate_size", hi=MAX_DIM),
                    shared_ffn=f.int("share_expert_dim", 0, "share_expert_dims", lo=0, hi=MAX_DIM), norm_topk=True)
    window = f.int("sliding_window", None, hi=MAX_POSITION) if "sliding_attention" in layer_types else None
    f.require(window is not None or "sliding_attention" not in layer_types, "sliding layers need 'sliding_window'")
    return dict(mixers=("attention",) * n_layers, ffns=ffns, moe=moe, attn=attns[0], layer_attn=tuple(attns),
                rope=ropes[0], ropes=ropes[1:], zero_centered_norm=True,
                windows=tuple(window if t == "sliding_attention" else None for t in layer_types),
                moe_scale=f.float("moe_router_scaling_factor", 1.0, within=ROPE_FACTOR),
                swiglu_limits=_limits(f, "swiglu_limits", n_layers),
                shared_limits=_limits(f, "swiglu_limits_shared", n_layers),
                intermediate_size=f.int("intermediate_size", hi=MAX_DIM) if "dense" in ffns else 0)


def _limits(f: Fields, name: str, n_layers: int) -> tuple[float | None, ...]:
    found = f.find(name)
    if found is None:
        return ()
    values = found[1]
    if not isinstance(values, list) or len(values) < n_layers or any(
            v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0) for v in values):
        raise f.error(f"{found[0]} must list a non-negative clamp (or null) for each of the {n_layers} layers")
    return tuple(None if not v else float(v) for v in values[:n_layers])


def _ropes(f: Fields, source: str, layer_types: list[str], head_dim: int) -> tuple[RopeConfig, RopeConfig]:
    """(full layers' RoPE, sliding layers' RoPE): rope_parameters per layer type, as transformers writes them."""
    out = []
    for kind in _TYPES:
        rp = Fields(source, Fields(source, f.scope("rope_parameters"), fix=_FIX).scope(kind), fix=_FIX)
        rope_type = rp.str("rope_type", "default")
        scaling = None if rope_type == "default" else rope_type
        if scaling not in (None, "linear", "llama3"):
            raise rp.error(f"rope_parameters.{kind}.rope_type = {rope_type!r} is not supported")
        dim = int(head_dim * rp.float("partial_rotary_factor", 1.0, within=FRACTION))
        out.append(built(source, RopeConfig, theta=rp.float("rope_theta", 10000.0, within=ROPE_THETA), dim=dim,
                         scaling=scaling, factor=rp.float("factor", 1.0, within=ROPE_FACTOR),
                         low_freq_factor=rp.float("low_freq_factor", 1.0, within=ROPE_FACTOR),
                         high_freq_factor=rp.float("high_freq_factor", 4.0, within=ROPE_FACTOR),
                         original_max_position=rp.int("original_max_position_embeddings", 8192, hi=MAX_POSITION)))
    if not out[0].dim or not out[1].dim:
        raise ConfigError(f"{source}: a partial_rotary_factor leaves no rotary dims")
    return out[0], out[1]
