"""ModelConfig from GGUF metadata (the `{arch}.*` keys; memra.loading.gguf_file reads them). Every value
goes through memra.config.fields, so a bad one fails naming the file and the full key."""

from __future__ import annotations

from typing import Any

from memra.config.fields import (
    EPSILON, MAX_COUNT, MAX_DIM, MAX_POSITION, MAX_VOCAB, REQUIRED, ROPE_FACTOR, ROPE_THETA, Fields, bool_item, built,
    int_item,
)
from memra.config.model import HYBRID, AttentionConfig, GdnConfig, ModelConfig, MoeConfig, RopeConfig
from memra.errors import ConfigError

GGUF_ARCHITECTURES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3moe": "qwen3_moe",
    "qwen3next": "qwen3_next",
    "qwen35": "qwen3_5",
    "qwen35moe": "qwen3_5_moe",
}

_FIX = "re-download or re-convert the file"


def _head_count(f: Fields, name: str, default: Any = None) -> int:
    """A head count: one number, or llama.cpp's per-layer array, which memra takes only when uniform."""
    found = f.find(name)
    if found is not None and isinstance(found[1], (list, tuple)):
        counts = f.list(name, item=int_item(1, MAX_COUNT))
        f.require(len(set(counts)) == 1,
                  f"per-layer {found[0]} {counts[:8]} differ; memra needs one count for every layer")
        return counts[0]
    return f.int(name) if default is None else f.int(name, default)


def from_gguf_metadata(meta: dict[str, Any], source: str = "model.gguf", vocab_size: int | None = None) -> ModelConfig:
    """`meta` maps GGUF keys (e.g. 'qwen35.block_count') to plain Python values."""
    gguf_arch = Fields(source, ("", meta), fix=_FIX).str("general.architecture", None)
    if gguf_arch is None:
        raise ConfigError(f"{source}: no 'general.architecture' key; not a model GGUF file")
    arch = GGUF_ARCHITECTURES.get(gguf_arch)
    if arch is None:
        raise ConfigError(
            f"{source}: unknown architecture {gguf_arch!r}; memra supports {', '.join(sorted(GGUF_ARCHITECTURES))}"
        )
    prefixed = {k[len(gguf_arch) + 1:]: v for k, v in meta.items() if k.startswith(gguf_arch + ".")}
    f = Fields(source, (gguf_arch + ".", prefixed), home=gguf_arch + ".", fix=_FIX)
    key = lambda name: f"{gguf_arch}.{name}"  # noqa: E731 - the full key, for messages

    hybrid = arch in HYBRID
    n_mtp = f.int("nextn_predict_layers", 0, lo=0) if hybrid else 0
    block_count = f.int("block_count")
    n_layers = block_count - n_mtp
    f.require(n_layers >= 1, f"{key('block_count')} = {block_count} minus {key('nextn_predict_layers')} = {n_mtp} "
                             "leaves no trunk layers")
    hidden = f.int("embedding_length", hi=MAX_DIM)
    n_heads = _head_count(f, "attention.head_count")
    n_kv = _head_count(f, "attention.head_count_kv", n_heads)
    f.require(n_heads % n_kv == 0, f"{key('attention.head_count')} = {n_heads} must be a multiple of "
                                   f"{key('attention.head_count_kv')} = {n_kv}")
    head_dim = f.int("attention.key_length", hidden // n_heads, hi=MAX_DIM)

    if hybrid:
        recurrent = f.list("attention.recurrent_layers", None, item=bool_item)
        if recurrent is not None:
            f.require(len(recurrent) >= n_layers, f"{key('attention.recurrent_layers')} has {len(recurrent)} entries "
                                                  f"for {n_layers} layers")
            mixers = tuple("gdn" if r else "attention" for r in recurrent[:n_layers])
        else:
            interval = f.int("full_attention_interval", 4)
            mixers = tuple("attention" if (i + 1) % interval == 0 else "gdn" for i in range(n_layers))
    else:
        mixers = ("attention",) * n_layers

    moe = None
    n_experts = f.int("expert_count", 0, lo=0)
    if arch in ("qwen3_moe", "qwen3_next", "qwen3_5_moe"):
        if n_experts <= 0:
            raise ConfigError(f"{source}: {arch} needs '{gguf_arch}.expert_count' > 0")
        top_k = f.int("expert_used_count")
        f.require(top_k <= n_experts, f"{key('expert_used_count')} = {top_k} exceeds the {n_experts} experts")
        moe = built(source, MoeConfig,
                    n_experts=n_experts,
                    top_k=top_k,
                    expert_ffn=f.int("expert_feed_forward_length", hi=MAX_DIM),
                    shared_ffn=f.int("expert_shared_feed_forward_length", 0, lo=0, hi=MAX_DIM),
                    norm_topk=f.bool("expert_weights_norm", True),
                    shared_gate=arch != "qwen3_moe")
    # qwen3next may keep dense layers (mlp_only_layers); the loader refines per-layer FFN kinds from
    # which tensors exist, so here every layer of an MoE architecture starts as "moe".
    ffns = ("moe" if moe else "dense",) * n_layers

    gdn = None
    if "gdn" in mixers:
        nk, nv = f.int("ssm.group_count"), f.int("ssm.time_step_rank")
        f.require(nv % nk == 0, f"{key('ssm.time_step_rank')} = {nv} (value heads) must be a multiple of "
                                f"{key('ssm.group_count')} = {nk} (key heads)")
        state = f.int("ssm.state_size", hi=MAX_DIM)
        inner = f.int("ssm.inner_size", nv * state, hi=MAX_DIM)
        f.require(inner % nv == 0, f"{key('ssm.inner_size')} = {inner} must be a multiple of "
                                   f"{key('ssm.time_step_rank')} = {nv}")
        gdn = built(source, GdnConfig, n_k_heads=nk, n_v_heads=nv, k_head_dim=state, v_head_dim=inner // nv,
                    conv_kernel=f.int("ssm.conv_kernel"))

    scaling = f.str("rope.scaling.type", None)
    scaling = None if scaling in (None, "none") else scaling
    rope_dim = f.int("rope.dimension_count", head_dim, hi=MAX_DIM)
    f.require(rope_dim % 2 == 0 and rope_dim <= head_dim, f"{key('rope.dimension_count')} = {rope_dim} must be even "
                                                          f"and at most the head size {head_dim}")
    rope = built(source, RopeConfig,
                 theta=f.float("rope.freq_base", 10000.0, within=ROPE_THETA),
                 dim=rope_dim,
                 scaling=scaling,
                 factor=f.float("rope.scaling.factor", 1.0, within=ROPE_FACTOR),
                 original_max_position=f.int("rope.scaling.original_context_length", 8192, hi=MAX_POSITION))
    attn = built(source, AttentionConfig,
                 n_heads=n_heads,
                 n_kv_heads=n_kv,
                 head_dim=head_dim,
                 qkv_bias=arch == "qwen2",
                 qk_norm=arch not in ("llama", "qwen2"),
                 output_gate=hybrid)
    return built(source, ModelConfig,
                 arch=arch,
                 vocab_size=f.int("vocab_size", REQUIRED if vocab_size is None else vocab_size, hi=MAX_VOCAB),
                 hidden_size=hidden,
                 n_layers=n_layers,
                 mixers=mixers,
                 ffns=ffns,
                 intermediate_size=f.int("feed_forward_length", 0, lo=0 if moe else 1, hi=MAX_DIM),
                 attn=attn,
                 rope=rope,
                 norm_eps=f.float("attention.layer_norm_rms_epsilon", 1e-6, within=EPSILON),
                 zero_centered_norm=hybrid,
                 tie_embeddings=False,  # decided by the loader: no output.weight means tied
                 max_position=f.int("context_length", 4096, hi=MAX_POSITION),
                 gdn=gdn,
                 moe=moe,
                 n_mtp=n_mtp,
                 extra={"eos_token_id": _id(meta, "tokenizer.ggml.eos_token_id"),
                        "bos_token_id": _id(meta, "tokenizer.ggml.bos_token_id")})


def _id(meta: dict[str, Any], key: str) -> int | None:
    """A special token id as the config keeps it; the tokenizer (memra.tokenizer.gguf_vocab) checks its range."""
    value = meta.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None
