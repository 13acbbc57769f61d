"""ModelConfig from a Hugging Face config.json (already parsed), including Qwen3.5's nested `text_config`
and `rope_parameters`. Every field goes through memra.config.fields, so a bad value fails naming the file
and the field before anything computes with it."""

from __future__ import annotations

from typing import Any

from memra.config.fields import (
    EPSILON, FRACTION, MAX_DIM, MAX_POSITION, MAX_VOCAB, ROPE_FACTOR, ROPE_THETA, Fields, built, int_item, kind,
    str_item, token_ids,
)
from memra.config.from_hf_gemma4 import gemma4_fields
from memra.config.from_hf_step import step_fields
from memra.config.model import GDN_STATE_DTYPES, HYBRID, AttentionConfig, GdnConfig, ModelConfig, MoeConfig, RopeConfig
from memra.errors import ConfigError

_HF_MODEL_TYPES = {
    "llama": "llama",
    "mistral": "mistral",
    "gemma4": "gemma4",
    "gemma4_text": "gemma4",
    "step3p5": "step3p5",
    "step3p7": "step3p5",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3_moe",
    "qwen3_next": "qwen3_next",
    "qwen3_5": "qwen3_5",
    "qwen3_5_text": "qwen3_5",
    "qwen3_5_moe": "qwen3_5_moe",
    "qwen3_5_moe_text": "qwen3_5_moe",
}

_MIXER_NAMES = {"full_attention": "attention", "sliding_attention": "attention", "linear_attention": "gdn"}
_FIX = "fix the file or re-download the model"


def from_hf_config(raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a JSON object at the top level, found {kind(raw)}")
    text = Fields(source, ("", raw), fix=_FIX).scope("text_config")
    f = Fields(source, text, ("", raw), fix=_FIX)
    model_type = f.str("model_type", None)
    if model_type is None:
        raise ConfigError(f"{source}: no 'model_type'; is this a Hugging Face model directory?")
    arch = _HF_MODEL_TYPES.get(model_type)
    if arch is None:
        raise ConfigError(
            f"{source}: unknown architecture {model_type!r}; memra supports "
            f"{', '.join(sorted(_HF_MODEL_TYPES))}"
        )
    rp = Fields(source, f.scope("rope_parameters"), f.scope("rope_scaling"), text, ("", raw), fix=_FIX)

    hidden = f.int("hidden_size", hi=MAX_DIM)
    n_layers = f.int("num_hidden_layers")
    n_heads = f.int("num_attention_heads")
    head_dim = f.int("head_dim", hidden // n_heads, hi=MAX_DIM)
    hybrid = arch in HYBRID

    # (Step's layer_types may be padded with its MTP layers' entries: from_hf_step reads them)
    layer_types = None if arch == "step3p5" else f.list("layer_types", None, item=str_item)
    if layer_types is None and hybrid:
        interval = f.int("full_attention_interval", 4)
        layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)]
    if layer_types is not None:
        f.require(len(layer_types) == n_layers,
                  f"layer_types has {len(layer_types)} entries for num_hidden_layers = {n_layers}")
        known = set(_MIXER_NAMES) if hybrid else {"full_attention", "sliding_attention"}
        if unknown := sorted(set(layer_types) - known):
            raise f.error(f"unknown layer_types entries {unknown}")
    mixers = tuple(_MIXER_NAMES[t] for t in layer_types) if hybrid else ("attention",) * n_layers
    windows = _windows(f, arch, n_layers, layer_types)

    n_experts = f.int("num_experts", 0, "num_local_experts", lo=0)
    moe = None
    if arch in ("qwen3_moe", "qwen3_next", "qwen3_5_moe"):
        if n_experts <= 0:
            raise ConfigError(f"{source}: {arch} needs 'num_experts' > 0")
        top_k = f.int("num_experts_per_tok")
        f.require(top_k <= n_experts, f"num_experts_per_tok = {top_k} exceeds the {n_experts} experts")
        moe = built(source, MoeConfig,
                    n_experts=n_experts,
                    top_k=top_k,
                    expert_ffn=f.int("moe_intermediate_size", hi=MAX_DIM),
                    shared_ffn=0 if arch == "qwen3_moe" else f.int("shared_expert_intermediate_size", 0, lo=0,
                                                                   hi=MAX_DIM),
                    norm_topk=f.bool("norm_topk_prob", True) if arch != "qwen3_5_moe" else True,
                    shared_gate=arch != "qwen3_moe")
    if arch == "qwen3_5_moe":
        ffns = ("moe",) * n_layers
    elif moe is not None:
        step = f.int("decoder_sparse_step", 1)
        dense_layers = set(f.list("mlp_only_layers", [], item=int_item(0, n_layers - 1)))
        ffns = tuple("dense" if i in dense_layers or (i + 1) % step else "moe" for i in range(n_layers))
    else:
        ffns = ("dense",) * n_layers
    intermediate = (f.int("intermediate_size", hi=MAX_DIM) if "dense" in ffns
                    else f.int("intermediate_size", 0, lo=0, hi=MAX_DIM))

    gdn = None
    if "gdn" in mixers:
        nk, nv = f.int("linear_num_key_heads"), f.int("linear_num_value_heads")
        f.require(nv % nk == 0, f"linear_num_value_heads = {nv} must be a multiple of linear_num_key_heads = {nk}")
        state = f.str("mamba_ssm_dtype", "float32")
        f.require(state in GDN_STATE_DTYPES, f"mamba_ssm_dtype = {state!r}: memra stores the GDN state in "
                                             f"{' or '.join(GDN_STATE_DTYPES)}")
        gdn = built(source, GdnConfig, n_k_heads=nk, n_v_heads=nv,
                    k_head_dim=f.int("linear_key_head_dim", hi=MAX_DIM),
                    v_head_dim=f.int("linear_value_head_dim", hi=MAX_DIM),
                    conv_kernel=f.int("linear_conv_kernel_dim", 4),
                    state_dtype=state)

    partial = rp.float("partial_rotary_factor", 1.0, within=FRACTION)
    scaling_type = rp.str("rope_type", None, "type")
    scaling_type = None if scaling_type in (None, "default") else scaling_type
    low = rp.float("low_freq_factor", 1.0, within=ROPE_FACTOR)
    high = rp.float("high_freq_factor", 4.0, within=ROPE_FACTOR)
    if scaling_type == "llama3":
        hi_label, lo_label = ((rp.find(n) or (n,))[0] for n in ("high_freq_factor", "low_freq_factor"))
        rp.require(high > low, f"llama3 RoPE needs {hi_label} = {high:g} greater than {lo_label} = {low:g}")
    rope_dim = int(head_dim * partial)
    rp.require(rope_dim > 0 and rope_dim % 2 == 0, f"head_dim = {head_dim} times partial_rotary_factor = {partial:g} "
               f"gives {rope_dim} rotary dims; that must be a positive even number")
    rope = built(source, RopeConfig,
                 theta=rp.float("rope_theta", 10000.0, within=ROPE_THETA),
                 dim=rope_dim,
                 scaling=scaling_type,
                 factor=rp.float("factor", 1.0, within=ROPE_FACTOR),
                 low_freq_factor=low,
                 high_freq_factor=high,
                 original_max_position=rp.int("original_max_position_embeddings", 8192, hi=MAX_POSITION))
    n_kv = f.int("num_key_value_heads", n_heads)
    f.require(n_heads % n_kv == 0,
              f"num_attention_heads = {n_heads} must be a multiple of num_key_value_heads = {n_kv}")
    attn = built(source, AttentionConfig,
                 n_heads=n_heads,
                 n_kv_heads=n_kv,
                 head_dim=head_dim,
                 qkv_bias=arch == "qwen2" or f.bool("attention_bias", False),
                 qk_norm=arch not in ("llama", "mistral", "qwen2"),
                 output_gate=hybrid and f.bool("attn_output_gate", True))
    n_mtp = f.int("mtp_num_hidden_layers", 0, "num_nextn_predict_layers", lo=0) if hybrid else 0
    tie = Fields(source, ("", raw), text, fix=_FIX).bool("tie_word_embeddings", arch == "gemma4")
    fields = dict(
                 arch=arch,
                 vocab_size=f.int("vocab_size", hi=MAX_VOCAB),
                 hidden_size=hidden,
                 n_layers=n_layers,
                 mixers=mixers,
                 ffns=ffns,
                 intermediate_size=intermediate,
                 attn=attn,
                 rope=rope,
                 norm_eps=f.float("rms_norm_eps", 1e-6, within=EPSILON),
                 zero_centered_norm=hybrid,
                 tie_embeddings=tie,
                 max_position=f.int("max_position_embeddings", 4096, hi=MAX_POSITION),
                 gdn=gdn,
                 moe=moe,
                 n_mtp=n_mtp,
                 windows=windows,
                 extra={"eos_token_id": token_ids(f, "eos_token_id"), "bos_token_id": token_ids(f, "bos_token_id")})
    if arch == "gemma4":
        fields.update(gemma4_fields(f, source, n_layers, hidden, n_heads))
    if arch == "step3p5":
        fields.update(step_fields(f, source, n_layers, n_heads, head_dim))
    return built(source, ModelConfig, **fields)


def _windows(f: Fields, arch: str, n_layers: int, layer_types: list[str] | None) -> tuple[int | None, ...]:
    """Per layer: its sliding window, or None. Mistral slides on every layer when `sliding_window` is set;
    elsewhere the layers `layer_types` calls "sliding_attention" do (Qwen2-style configs that only say
    `use_sliding_window` slide from layer `max_window_layers` on, as transformers reads them)."""
    if arch == "mistral":
        window = f.int("sliding_window", None, hi=MAX_POSITION)
        return () if window is None else (window,) * n_layers
    if layer_types is None and f.bool("use_sliding_window", False):
        first = f.int("max_window_layers", n_layers, lo=0)
        layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(n_layers)]
    if layer_types is None or "sliding_attention" not in layer_types:
        return ()
    window = f.int("sliding_window", hi=MAX_POSITION)
    return tuple(window if t == "sliding_attention" else None for t in layer_types)
