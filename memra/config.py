"""ModelConfig: one normalized, frozen description of a network, whatever file it came from.

Two front doors build it — `from_hf_config` (a `config.json` dict, including Qwen3.5's nested
`text_config` and `rope_parameters`) and `from_gguf_metadata` (the `{arch}.*` keys of a GGUF file) —
and nothing downstream ever looks at a raw config again. Every architecture is expressed with the
same few knobs (per-layer mixer and FFN kind, head geometry, norm style, RoPE), so the model code
has no `if arch == ...` branches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

from memra.errors import ConfigError

# Canonical architecture names (HF model_type spelling) and what each one is made of.
ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3_moe", "qwen3_next", "qwen3_5", "qwen3_5_moe")

_HF_MODEL_TYPES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3_moe",
    "qwen3_next": "qwen3_next",
    "qwen3_5": "qwen3_5",
    "qwen3_5_text": "qwen3_5",
    "qwen3_5_moe": "qwen3_5_moe",
    "qwen3_5_moe_text": "qwen3_5_moe",
}

GGUF_ARCHITECTURES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3moe": "qwen3_moe",
    "qwen3next": "qwen3_next",
    "qwen35": "qwen3_5",
    "qwen35moe": "qwen3_5_moe",
}

HYBRID = frozenset({"qwen3_next", "qwen3_5", "qwen3_5_moe"})  # GDN + gated attention, (1+w) norms


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    dim: int  # rotated channels per head (R); the rest of the head passes through
    scaling: str | None = None  # None | "linear" | "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    def __post_init__(self) -> None:
        if self.dim <= 0 or self.dim % 2:
            raise ConfigError(f"rotary dimension must be a positive even number, got {self.dim}")
        if self.scaling not in (None, "linear", "llama3"):
            raise ConfigError(
                f"unsupported RoPE scaling type {self.scaling!r}; memra supports none, 'linear' and 'llama3'"
            )


@dataclass(frozen=True)
class AttentionConfig:
    n_heads: int
    n_kv_heads: int
    head_dim: int
    qkv_bias: bool = False  # qwen2
    qk_norm: bool = False  # qwen3 family: RMSNorm over each q/k head
    output_gate: bool = False  # hybrids: q_proj also yields a per-head sigmoid gate

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"attention heads ({self.n_heads}) must be a multiple of KV heads ({self.n_kv_heads})")


@dataclass(frozen=True)
class GdnConfig:
    """Gated DeltaNet geometry. Value head h reads key head h // (n_v_heads // n_k_heads)."""

    n_k_heads: int
    n_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int

    def __post_init__(self) -> None:
        if self.n_v_heads % self.n_k_heads:
            raise ConfigError(f"GDN value heads ({self.n_v_heads}) must be a multiple of key heads ({self.n_k_heads})")

    @property
    def key_dim(self) -> int:
        return self.n_k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.n_v_heads * self.v_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim


@dataclass(frozen=True)
class MoeConfig:
    n_experts: int
    top_k: int
    expert_ffn: int
    shared_ffn: int = 0  # 0 = no shared expert
    norm_topk: bool = True  # renormalise the top-k routing weights to sum to 1
    shared_gate: bool = False  # shared expert scaled by sigmoid(x . w)

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.n_experts:
            raise ConfigError(f"experts per token ({self.top_k}) must be in 1..{self.n_experts}")


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    n_layers: int
    mixers: tuple[str, ...]  # per layer: "attention" | "gdn"
    ffns: tuple[str, ...]  # per layer: "dense" | "moe"
    intermediate_size: int
    attn: AttentionConfig
    rope: RopeConfig
    norm_eps: float
    zero_centered_norm: bool  # hybrids: y = x_hat * (1 + w) computed in fp32 before the cast
    tie_embeddings: bool
    max_position: int
    gdn: GdnConfig | None = None
    moe: MoeConfig | None = None
    n_mtp: int = 0  # MTP (NextN) blocks after the trunk; each is a full-attention block
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise ConfigError(f"unknown architecture {self.arch!r}; memra supports {', '.join(ARCHITECTURES)}")
        for name in ("vocab_size", "hidden_size", "n_layers", "max_position"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if len(self.mixers) != self.n_layers or len(self.ffns) != self.n_layers:
            raise ConfigError(
                f"per-layer types have {len(self.mixers)} mixers / {len(self.ffns)} FFNs for {self.n_layers} layers"
            )
        if bad := set(self.mixers) - {"attention", "gdn"}:
            raise ConfigError(f"unknown layer type(s) {sorted(bad)}")
        if "gdn" in self.mixers and self.gdn is None:
            raise ConfigError("layers of type 'gdn' need the linear-attention (GDN) geometry")
        if "moe" in self.ffns and self.moe is None:
            raise ConfigError("layers of type 'moe' need the expert geometry (num_experts, experts per token, width)")
        if self.rope.dim > self.attn.head_dim:
            raise ConfigError(f"rotary dims ({self.rope.dim}) exceed head_dim ({self.attn.head_dim})")

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, m in enumerate(self.mixers) if m == "attention")

    @property
    def gdn_layers(self) -> tuple[int, ...]:
        return tuple(i for i, m in enumerate(self.mixers) if m == "gdn")

    def describe(self) -> str:
        kinds = "".join("A" if m == "attention" else "G" for m in self.mixers)
        lines = [
            f"architecture   {self.arch}",
            f"layers         {self.n_layers}  [{kinds}]  (A = full attention, G = Gated DeltaNet)"
            + (f"  + {self.n_mtp} MTP block(s)" if self.n_mtp else ""),
            f"hidden         {self.hidden_size}   vocab {self.vocab_size}   max positions {self.max_position}",
            f"attention      {self.attn.n_heads} q heads / {self.attn.n_kv_heads} kv heads x {self.attn.head_dim}"
            f"  rope dims {self.rope.dim} theta {self.rope.theta:g}"
            + (f" scaling {self.rope.scaling} x{self.rope.factor:g}" if self.rope.scaling else "")
            + ("  qk-norm" if self.attn.qk_norm else "")
            + ("  output-gate" if self.attn.output_gate else "")
            + ("  qkv-bias" if self.attn.qkv_bias else ""),
        ]
        if self.gdn:
            g = self.gdn
            lines.append(
                f"gated deltanet {g.n_k_heads} key heads x {g.k_head_dim} / {g.n_v_heads} value heads x {g.v_head_dim}"
                f"  conv {g.conv_kernel}"
            )
        if self.moe:
            m = self.moe
            lines.append(
                f"experts        {m.n_experts} (top {m.top_k}) width {m.expert_ffn}"
                + (f"  shared {m.shared_ffn}" if m.shared_ffn else "")
            )
        if "dense" in self.ffns:
            lines.append(f"dense mlp      width {self.intermediate_size}")
        lines.append(
            f"norm           eps {self.norm_eps:g}  {'(1+w) zero-centred' if self.zero_centered_norm else 'plain'}"
            f"   tied embeddings: {'yes' if self.tie_embeddings else 'no'}"
        )
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# From a Hugging Face config.json
# ---------------------------------------------------------------------------------------------


def _getter(source: str, *dicts: dict[str, Any]) -> Callable[..., Any]:
    """A field reader that looks through `dicts` in order and fails with the field's name."""

    missing = object()

    def get(name: str, default: Any = missing, *aliases: str) -> Any:
        for key in (name, *aliases):
            for d in dicts:
                if key in d and d[key] is not None:
                    return d[key]
        if default is missing:
            raise ConfigError(f"{source}: required field {name!r} is missing")
        return default

    return get


def from_hf_config(raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
    text = raw.get("text_config") or {}
    model_type = text.get("model_type") or raw.get("model_type")
    if model_type is None:
        raise ConfigError(f"{source}: no 'model_type'; is this a Hugging Face model directory?")
    arch = _HF_MODEL_TYPES.get(model_type)
    if arch is None:
        raise ConfigError(
            f"{source}: unknown architecture {model_type!r}; memra supports "
            f"{', '.join(sorted(_HF_MODEL_TYPES))}"
        )
    get = _getter(source, text, raw)
    rope_params = get("rope_parameters", {}) or {}
    rope_scaling = get("rope_scaling", {}) or {}
    rp = _getter(source, rope_params, rope_scaling, text, raw)

    hidden = int(get("hidden_size"))
    n_layers = int(get("num_hidden_layers"))
    n_heads = int(get("num_attention_heads"))
    head_dim = int(get("head_dim", hidden // n_heads))
    hybrid = arch in HYBRID

    if hybrid:
        layer_types = get("layer_types", None)
        if layer_types is None:
            interval = int(get("full_attention_interval", 4))
            layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)]
        mixer_names = {"full_attention": "attention", "linear_attention": "gdn"}
        if unknown := sorted(set(layer_types) - set(mixer_names)):
            raise ConfigError(f"{source}: unknown layer_types entries {unknown}")
        mixers = tuple(mixer_names[t] for t in layer_types)
    else:
        mixers = ("attention",) * n_layers

    n_experts = int(get("num_experts", 0, "num_local_experts"))
    moe = None
    if arch in ("qwen3_moe", "qwen3_next", "qwen3_5_moe"):
        if n_experts <= 0:
            raise ConfigError(f"{source}: {arch} needs 'num_experts' > 0")
        moe = MoeConfig(
            n_experts=n_experts,
            top_k=int(get("num_experts_per_tok")),
            expert_ffn=int(get("moe_intermediate_size")),
            shared_ffn=int(get("shared_expert_intermediate_size", 0)) if arch != "qwen3_moe" else 0,
            norm_topk=bool(get("norm_topk_prob", True)) if arch != "qwen3_5_moe" else True,
            shared_gate=arch != "qwen3_moe",
        )
    if arch == "qwen3_5_moe":
        ffns = ("moe",) * n_layers
    elif moe is not None:
        step = int(get("decoder_sparse_step", 1))
        dense_layers = set(get("mlp_only_layers", []))
        ffns = tuple("dense" if i in dense_layers or (i + 1) % step else "moe" for i in range(n_layers))
    else:
        ffns = ("dense",) * n_layers
    intermediate = int(get("intermediate_size")) if "dense" in ffns else int(get("intermediate_size", 0))

    gdn = None
    if "gdn" in mixers:
        gdn = GdnConfig(
            n_k_heads=int(get("linear_num_key_heads")),
            n_v_heads=int(get("linear_num_value_heads")),
            k_head_dim=int(get("linear_key_head_dim")),
            v_head_dim=int(get("linear_value_head_dim")),
            conv_kernel=int(get("linear_conv_kernel_dim", 4)),
        )

    partial = float(rp("partial_rotary_factor", 1.0))
    scaling_type = rp("rope_type", None, "type")
    scaling_type = None if scaling_type in (None, "default") else scaling_type
    rope = RopeConfig(
        theta=float(rp("rope_theta", 10000.0)),
        dim=int(head_dim * partial),
        scaling=scaling_type,
        factor=float(rp("factor", 1.0)),
        low_freq_factor=float(rp("low_freq_factor", 1.0)),
        high_freq_factor=float(rp("high_freq_factor", 4.0)),
        original_max_position=int(rp("original_max_position_embeddings", 8192)),
    )
    attn = AttentionConfig(
        n_heads=n_heads,
        n_kv_heads=int(get("num_key_value_heads", n_heads)),
        head_dim=head_dim,
        qkv_bias=arch == "qwen2" or bool(get("attention_bias", False)),
        qk_norm=arch not in ("llama", "qwen2"),
        output_gate=hybrid and bool(get("attn_output_gate", True)),
    )
    n_mtp = int(get("mtp_num_hidden_layers", 0, "num_nextn_predict_layers")) if hybrid else 0
    return ModelConfig(
        arch=arch,
        vocab_size=int(get("vocab_size")),
        hidden_size=hidden,
        n_layers=n_layers,
        mixers=mixers,
        ffns=ffns,
        intermediate_size=intermediate,
        attn=attn,
        rope=rope,
        norm_eps=float(get("rms_norm_eps", 1e-6)),
        zero_centered_norm=hybrid,
        tie_embeddings=bool(raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
        max_position=int(get("max_position_embeddings", 4096)),
        gdn=gdn,
        moe=moe,
        n_mtp=n_mtp,
        extra={"eos_token_id": get("eos_token_id", None), "bos_token_id": get("bos_token_id", None)},
    )


# ---------------------------------------------------------------------------------------------
# From GGUF metadata
# ---------------------------------------------------------------------------------------------


def from_gguf_metadata(meta: dict[str, Any], source: str = "model.gguf", vocab_size: int | None = None) -> ModelConfig:
    """`meta` maps GGUF keys (e.g. 'qwen35.block_count') to plain Python values."""
    gguf_arch = meta.get("general.architecture")
    if gguf_arch is None:
        raise ConfigError(f"{source}: no 'general.architecture' key; not a model GGUF file")
    arch = GGUF_ARCHITECTURES.get(gguf_arch)
    if arch is None:
        raise ConfigError(
            f"{source}: unknown architecture {gguf_arch!r}; memra supports {', '.join(sorted(GGUF_ARCHITECTURES))}"
        )
    prefixed = {k[len(gguf_arch) + 1 :]: v for k, v in meta.items() if k.startswith(gguf_arch + ".")}
    get = _getter(source + f" ({gguf_arch}.*)", prefixed)

    hybrid = arch in HYBRID
    n_mtp = int(get("nextn_predict_layers", 0)) if hybrid else 0
    n_layers = int(get("block_count")) - n_mtp
    hidden = int(get("embedding_length"))
    n_heads = int(get("attention.head_count"))
    n_kv = get("attention.head_count_kv", n_heads)
    if isinstance(n_kv, (list, tuple)):
        if len(set(n_kv)) != 1:
            raise ConfigError(f"{source}: per-layer KV head counts {n_kv} are not supported")
        n_kv = n_kv[0]
    head_dim = int(get("attention.key_length", hidden // n_heads))

    if hybrid:
        recurrent = get("attention.recurrent_layers", None)
        if recurrent is not None:
            mixers = tuple("gdn" if r else "attention" for r in list(recurrent)[:n_layers])
        else:
            interval = int(get("full_attention_interval", 4))
            mixers = tuple("attention" if (i + 1) % interval == 0 else "gdn" for i in range(n_layers))
    else:
        mixers = ("attention",) * n_layers

    moe = None
    n_experts = int(get("expert_count", 0))
    if arch in ("qwen3_moe", "qwen3_next", "qwen3_5_moe"):
        if n_experts <= 0:
            raise ConfigError(f"{source}: {arch} needs '{gguf_arch}.expert_count' > 0")
        moe = MoeConfig(
            n_experts=n_experts,
            top_k=int(get("expert_used_count")),
            expert_ffn=int(get("expert_feed_forward_length")),
            shared_ffn=int(get("expert_shared_feed_forward_length", 0)),
            norm_topk=bool(get("expert_weights_norm", True)),
            shared_gate=arch != "qwen3_moe",
        )
    # qwen3next may keep dense layers (mlp_only_layers); the loader refines per-layer FFN kinds from
    # which tensors exist, so here every layer of an MoE architecture starts as "moe".
    ffns = ("moe" if moe else "dense",) * n_layers

    gdn = None
    if "gdn" in mixers:
        nk, nv = int(get("ssm.group_count")), int(get("ssm.time_step_rank"))
        state = int(get("ssm.state_size"))
        inner = int(get("ssm.inner_size", nv * state))
        gdn = GdnConfig(n_k_heads=nk, n_v_heads=nv, k_head_dim=state, v_head_dim=inner // nv,
                        conv_kernel=int(get("ssm.conv_kernel")))

    scaling = get("rope.scaling.type", None)
    scaling = None if scaling in (None, "none") else scaling
    rope = RopeConfig(
        theta=float(get("rope.freq_base", 10000.0)),
        dim=int(get("rope.dimension_count", head_dim)),
        scaling=scaling,
        factor=float(get("rope.scaling.factor", 1.0)),
        original_max_position=int(get("rope.scaling.original_context_length", 8192)),
    )
    attn = AttentionConfig(
        n_heads=n_heads,
        n_kv_heads=int(n_kv),
        head_dim=head_dim,
        qkv_bias=arch == "qwen2",
        qk_norm=arch not in ("llama", "qwen2"),
        output_gate=hybrid,
    )
    eps = float(get("attention.layer_norm_rms_epsilon", 1e-6))
    return ModelConfig(
        arch=arch,
        vocab_size=int(get("vocab_size", vocab_size if vocab_size is not None else 0)),
        hidden_size=hidden,
        n_layers=n_layers,
        mixers=mixers,
        ffns=ffns,
        intermediate_size=int(get("feed_forward_length", 0)),
        attn=attn,
        rope=rope,
        norm_eps=eps,
        zero_centered_norm=hybrid,
        tie_embeddings=False,  # decided by the loader: no output.weight means tied
        max_position=int(get("context_length", 4096)),
        gdn=gdn,
        moe=moe,
        n_mtp=n_mtp,
        extra={
            "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
            "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        },
    )


def rope_inv_freq_scaled(rope: RopeConfig, inv_freq: list[float]) -> list[float]:
    """Apply Llama-3 style frequency-dependent scaling (the 'llama3' rope type) to inverse frequencies."""
    if rope.scaling == "linear":
        return [f / rope.factor for f in inv_freq]
    if rope.scaling != "llama3":
        return inv_freq
    low_wavelen = rope.original_max_position / rope.low_freq_factor
    high_wavelen = rope.original_max_position / rope.high_freq_factor
    out = []
    for f in inv_freq:
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(f)
        elif wavelen > low_wavelen:
            out.append(f / rope.factor)
        else:
            smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
                rope.high_freq_factor - rope.low_freq_factor
            )
            out.append((1 - smooth) * f / rope.factor + smooth * f)
    return out
