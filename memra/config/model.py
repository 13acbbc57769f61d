"""The frozen dataclasses that describe a network: ModelConfig and its parts.

One normalized description, whatever file it came from (see memra.config.from_hf / from_gguf, which
check every value a file supplies before building these). Every architecture is expressed with the same
few knobs (per-layer mixer and FFN kind, head geometry, norm style, RoPE), so the model code has no
`if arch == ...` branches. The __post_init__ checks guard configs built in code (random_model, tests).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from memra.errors import ConfigError

# Canonical architecture names (HF model_type spelling) and what each one is made of.
ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "qwen3_next", "qwen3_5", "qwen3_5_moe", "gemma4",
                 "step3p5")

GDN_STATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # GdnConfig.state_dtype's values

HYBRID = frozenset({"qwen3_next", "qwen3_5", "qwen3_5_moe"})  # GDN + gated attention, (1+w) norms

# Canonical weights kept in fp32 whatever the model dtype: norm multipliers and the GDN gate parameters
# (the reference implementations compute all of these in fp32).
FP32_WEIGHTS = frozenset({"attn_norm", "ffn_norm", "final_norm", "q_norm", "k_norm", "norm", "enorm", "hnorm",
                          "a_neg", "dt_bias", "rope_freqs", "v_norm", "post_attn_norm", "post_ffn_norm", "ple_norm",
                          "ple_proj_norm", "router_bias"})


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    dim: int  # rotated channels per head (R); the rest of the head passes through
    scaling: str | None = None  # None | "linear" | "llama3"
    # Gemma 4's "proportional" RoPE: the last `zero_pairs` of the dim/2 frequencies are 0 (those channel pairs
    # pass unrotated), the others theta^(-2i/dim) with dim the whole head
    zero_pairs: int = 0
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    def __post_init__(self) -> None:
        if self.dim <= 0 or self.dim % 2:
            raise ConfigError(f"rotary dimension must be a positive even number, got {self.dim}")
        if not 0 <= self.zero_pairs < self.dim // 2:
            raise ConfigError(f"unrotated frequency pairs ({self.zero_pairs}) must be fewer than dim / 2 ({self.dim // 2})")
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
    head_gate: bool = False  # Step: a separate projection gives one sigmoid gate per head (rows after q, k, v)
    scale: float | None = None  # softmax scale; None = head_dim ** -0.5 (Gemma 4: 1.0)
    v_norm: bool = False  # Gemma 4: V RMS-normalised per head, no weight
    k_eq_v: bool = False  # Gemma 4 global layers: V is the K projection (before K's norm); no V rows
    kv_from: int | None = None  # Gemma 4 shared KV: this layer reads layer kv_from's K/V, projects none
    rope: int = 0  # which RoPE: 0 = ModelConfig.rope, j > 0 = ModelConfig.ropes[j - 1]

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
    # What the delta-rule state is stored in between calls (cache slots, snapshots, a verify's trail): fp32, or
    # bf16 at half the bytes each decode step reads and writes. Every kernel computes in fp32 and rounds the
    # state to this dtype wherever one path would store it (after each token, after each 64-token chunk), so
    # every path keeps one another's bits. The checkpoint's `mamba_ssm_dtype`, unless the setting overrides it.
    state_dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.n_v_heads % self.n_k_heads:
            raise ConfigError(f"GDN value heads ({self.n_v_heads}) must be a multiple of key heads ({self.n_k_heads})")
        if self.state_dtype not in GDN_STATE_DTYPES:
            raise ConfigError(f"GDN state dtype {self.state_dtype!r} is not one of {', '.join(GDN_STATE_DTYPES)}")

    @property
    def state_torch_dtype(self) -> torch.dtype:
        return GDN_STATE_DTYPES[self.state_dtype]

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
    # per layer: the sliding window W of an attention layer (a query at p sees p-W+1..p), or None (global);
    # () = every layer global
    windows: tuple[int | None, ...] = ()
    layer_attn: tuple[AttentionConfig, ...] = ()  # per layer, where layers differ (Gemma 4, Step); () = attn
    ropes: tuple[RopeConfig, ...] = ()  # further RoPEs some layers use (AttentionConfig.rope)
    ffn_act: str = "silu"  # the gated FFN's activation: "silu" | "gelu_tanh"
    ffn_widths: tuple[int, ...] = ()  # per layer dense FFN width, where layers differ (Gemma 4 double-wide)
    sandwich_norm: bool = False  # Gemma: norms after the mixer and after the FFN too, before each residual add
    embed_scale: float | None = None  # Gemma: token embeddings times this (in the model dtype)
    final_softcap: float | None = None  # logits = cap * tanh(logits / cap)
    ple_dim: int = 0  # Gemma 4 E-variants: per-layer input width (per-layer embeddings); 0 = none
    moe_scale: float = 1.0  # routed experts' sum times this (Step's moe_router_scaling_factor)
    swiglu_limits: tuple[float | None, ...] = ()  # Step: per layer clamp of the experts' gate/up (None: none)
    shared_limits: tuple[float | None, ...] = ()  # ... and of the shared expert's
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
        if self.windows and len(self.windows) != self.n_layers:
            raise ConfigError(f"per-layer sliding windows have {len(self.windows)} entries for {self.n_layers} layers")
        if any(w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1) for w in self.windows):
            raise ConfigError(f"a sliding window must be a positive number of positions or None, got {self.windows}")
        if self.layer_attn and len(self.layer_attn) != self.n_layers:
            raise ConfigError(f"per-layer attention has {len(self.layer_attn)} entries for {self.n_layers} layers")
        if self.ffn_act not in ("silu", "gelu_tanh"):
            raise ConfigError(f"unsupported FFN activation {self.ffn_act!r}; memra supports silu and gelu_tanh")
        for i in self.attention_layers:
            a = self.attn_of(i)
            if not 0 <= a.rope <= len(self.ropes):
                raise ConfigError(f"layer {i} names RoPE {a.rope}; the model has {len(self.ropes) + 1}")
            if (self.rope, *self.ropes)[a.rope].dim > a.head_dim:
                raise ConfigError(f"layer {i}: rotary dims exceed head_dim ({a.head_dim})")
            if a.kv_from is not None and not (0 <= a.kv_from < i and self.mixers[a.kv_from] == "attention"
                                              and self.attn_of(a.kv_from).kv_from is None
                                              and (self.attn_of(a.kv_from).n_kv_heads, self.attn_of(a.kv_from).head_dim)
                                              == (a.n_kv_heads, a.head_dim)):
                raise ConfigError(f"layer {i} shares the K/V of layer {a.kv_from}, which is not an earlier "
                                  "attention layer of its shape with K/V of its own")
        if self.rope.dim > self.attn.head_dim:
            raise ConfigError(f"rotary dims ({self.rope.dim}) exceed head_dim ({self.attn.head_dim})")

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, m in enumerate(self.mixers) if m == "attention")

    def attn_of(self, layer: int) -> AttentionConfig:
        """Layer `layer`'s attention geometry (MTP blocks past the trunk: the model's)."""
        return self.layer_attn[layer] if self.layer_attn and layer < self.n_layers else self.attn

    def rope_slot(self, layer: int) -> tuple[int, int, int]:
        """Where layer `layer`'s RoPE frequencies sit in the model's joined table (every RoPE's inverse
        frequencies, in order): (first, count, total), in frequencies (half the rotary channels)."""
        dims = [r.dim // 2 for r in (self.rope, *self.ropes)]
        j = self.attn_of(layer).rope
        return sum(dims[:j]), dims[j], sum(dims)

    @property
    def stream_width(self) -> int:
        """Width of the hidden state the layers pass on: hidden_size, plus every layer's per-layer input
        (Gemma 4's per-layer embeddings ride along, so a pipeline boundary carries them unchanged)."""
        return self.hidden_size + self.n_layers * self.ple_dim

    def ffn_width(self, layer: int) -> int:
        return self.ffn_widths[layer] if self.ffn_widths else self.intermediate_size

    def window(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window, or None (global attention; MTP blocks past the trunk too)."""
        return self.windows[layer] if self.windows and layer < self.n_layers else None

    @property
    def gdn_layers(self) -> tuple[int, ...]:
        return tuple(i for i, m in enumerate(self.mixers) if m == "gdn")

    def with_gdn_state(self, dtype: str) -> "ModelConfig":
        """This config with its GDN state stored in `dtype` (Settings.gdn_state_dtype; "auto" keeps the
        checkpoint's choice, and a model without GDN layers has no state to store)."""
        if dtype == "auto" or self.gdn is None or dtype == self.gdn.state_dtype:
            return self
        return replace(self, gdn=replace(self.gdn, state_dtype=dtype))

    def describe(self) -> str:
        kinds = "".join("A" if m == "attention" else "G" for m in self.mixers)
        windows = sorted({w for w in self.windows if w is not None})
        lines = [
            f"architecture   {self.arch}",
            *([f"sliding window {', '.join(map(str, windows))} positions on "
               f"{sum(w is not None for w in self.windows)} of {self.n_layers} layers"] if windows else []),
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
                f"  conv {g.conv_kernel}  state {g.state_dtype}"
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
            f"norm           eps {self.norm_eps:g}  "
            f"{('plain w, in fp32' if self.arch == 'gemma4' else '(1+w) zero-centred') if self.zero_centered_norm else 'plain'}"
            f"   tied embeddings: {'yes' if self.tie_embeddings else 'no'}"
        )
        return "\n".join(lines)


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
