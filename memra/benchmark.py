"""`memra bench model`: random-weight models of real shapes, measured against this device's own limits.

One process, one device, no download. For each model shape (memra.random_model.SHAPES) it measures:

- memra decode tokens/s at each batch width B (from primed caches, device-synced, after warm-up),
  in the exact mode and in the non-exact fast path (MEMRA_EXACT=0) — the exact overhead target is
  exact >= 0.9 x fast at every B;
- prefill tokens/s over one chunk (default 4096 tokens) and time to first token (prime of a prompt,
  then the first greedy token on the host);
- the same phases with Hugging Face transformers `generate` on the same weights (shared with memra's
  tensors, not copied) on the same device: the peer.

Every number gets two yardsticks measured in the same run:
- a roofline from two probes (read bandwidth: a sum over a large tensor; matmul peak: a large GEMM):
  decode is bound by the bytes a step must read (weights once + each sequence's KV/recurrent state),
  prefill by max(FLOPs / matmul peak, weight bytes / bandwidth);
- the HF peer's tokens/s for the same phase and batch.

Cells that do not fit the time budget are recorded as skipped, cells that fail as failed (with the
error) — the report always has every requested cell. Importable: `run_bench(BenchConfig(...))`.

Weights: "bf16", or "q8_0" / "q4_k": every 2-D projection kept packed in that GGUF format and run by
the fused dequantizing kernels (memra.kernels.quant); its roofline counts the packed bytes. The HF
peer runs only for bf16 (it has no kernels for these packed formats).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import platform
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from memra.cache import PRIME_CHUNK_MAX_TOKENS
from memra.config import ModelConfig
from memra.errors import MemraError
from memra.bench.timing import Timing
from memra.random_model import SHAPES, canonical_shapes
from memra.settings import process_env, show_progress

# --- configuration -------------------------------------------------------------------------------

# name -> (activation dtype, packed format for random_model(quant=...) or None)
WEIGHT_FORMATS = {"bf16": (torch.bfloat16, None), "q8_0": (torch.bfloat16, "q8_0"), "q4_k": (torch.bfloat16, "q4_k")}
MODES = ("exact", "fast")  # memra's exact path, and the non-exact stacked path (MEMRA_EXACT=0)
PATHS = ("engine", "newcache")  # the paths users run, timed beside the pooled step (memra.bench.user_paths)
GIB = 2**30


def check_weights(weights: str) -> torch.dtype:
    """The dtype a weights format builds, or a MemraError that says what is possible."""
    if weights in WEIGHT_FORMATS:
        return WEIGHT_FORMATS[weights][0]
    raise MemraError(f"unknown weights format {weights!r}; available: {', '.join(WEIGHT_FORMATS)}")


def tensor_bytes(t) -> int:
    """Bytes a weight occupies (and a step reads): packed bytes for a QuantWeight."""
    from memra.kernels.quant import QuantWeight

    return t.nbytes if isinstance(t, QuantWeight) else t.numel() * t.element_size()


def tensor_numel(t) -> int:
    return math.prod(tuple(t.shape))


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class BenchConfig:
    models: tuple[str, ...] = tuple(SHAPES)
    batches: tuple[int, ...] = (1, 8, 32, 128)
    prefill_chunk: int = 4096  # tokens primed as one chunk (at most PRIME_CHUNK_MAX_TOKENS)
    ttft_tokens: int = 512  # prompt length of the time-to-first-token cell
    prompt_tokens: int = 32  # each decode row's primed prompt (also the HF peer's prompt)
    decode_steps: int = 32  # timed decode steps per cell (the HF peer generates this many + 1)
    warmup: int = 2  # untimed decode steps first (kernel compile, decode-plan check); 0 = none
    repeats: int = 3  # prefill / TTFT / probes: best of this many
    layers: tuple[tuple[str, int], ...] = ()  # per-model layer count, e.g. (("qwen3.5-35b-a3b", 20),)
    weights: str = "bf16"
    peer_hf: bool = True
    exact_modes: tuple[str, ...] = MODES
    device: str = "cuda"
    json_path: str | None = None  # also write the report here (after each model, so a crash keeps results)
    budget_s: float | None = None  # start no cell after this many seconds; the rest are recorded as skipped
    seed: int = 0
    # Builds a model: (name, device, dtype, n_layers, seed) -> HybridModel. None = memra.random_model,
    # which knows only SHAPES; a factory may use other names (tests use tiny shapes this way).
    model_factory: Callable[..., Any] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        check_weights(self.weights)
        if not self.models:
            raise MemraError("no models to benchmark")
        known = set(SHAPES)
        if self.model_factory is None:
            for name in self.models:
                if name not in known:
                    raise MemraError(f"unknown model shape {name!r}; known: {', '.join(SHAPES)}")
        for name, n in self.layers:
            if name not in self.models:
                raise MemraError(f"a layer count is given for {name!r}, which is not among the models "
                                 f"({', '.join(self.models)})")
            if n <= 0:
                raise MemraError(f"layer count for {name!r} must be positive, got {n}")
        if not self.batches or min(self.batches) <= 0:
            raise MemraError(f"batch widths must be positive, got {self.batches}")
        if bad := [m for m in self.exact_modes if m not in MODES + PATHS]:
            raise MemraError(f"unknown mode(s) {bad}; modes are {', '.join(MODES + PATHS)}")
        if not 1 <= self.prefill_chunk <= PRIME_CHUNK_MAX_TOKENS:
            raise MemraError(f"prefill_chunk must be in 1..{PRIME_CHUNK_MAX_TOKENS}, got {self.prefill_chunk}")
        for name in ("ttft_tokens", "prompt_tokens", "decode_steps", "repeats"):
            if getattr(self, name) <= 0:
                raise MemraError(f"{name} must be positive, got {getattr(self, name)}")
        if self.warmup < 0:
            raise MemraError(f"warmup must be >= 0, got {self.warmup}")
        if self.budget_s is not None and self.budget_s < 0:
            raise MemraError(f"budget_s must be >= 0, got {self.budget_s}")

    @property
    def dtype(self) -> torch.dtype:
        return check_weights(self.weights)

    def layers_for(self, name: str) -> int | None:
        return dict(self.layers).get(name)

    def to_json(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "model_factory"}
        d["layers"] = dict(self.layers)
        f = self.model_factory
        d["model_factory"] = None if f is None else getattr(f, "__name__", type(f).__name__)
        return d

    @classmethod
    def from_json(cls, d: dict) -> "BenchConfig":
        """A config read back from JSON. A custom factory cannot be serialized: a config that had one
        comes back with a placeholder that refuses to build (so its model names are not checked
        against SHAPES), and compares equal to the original."""
        d = dict(d)
        factory = d.pop("model_factory", None)
        for k in ("models", "batches", "exact_modes"):
            d[k] = tuple(d[k])
        d["layers"] = tuple((k, int(v)) for k, v in d["layers"].items())
        return cls(**d, model_factory=None if factory is None else _UnserializedFactory(factory))


class _UnserializedFactory:
    """Stands in for a custom model factory in a config read back from JSON: keeps its name, refuses to build."""

    def __init__(self, name: str):
        self.__name__ = name

    def __call__(self, *args, **kwargs):
        raise MemraError(f"this config was read back from JSON; its model factory {self.__name__!r} was not saved")


# --- probes: what this device can do -------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_seconds(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """The fastest of `repeats` timed calls, after one untimed call (allocator, kernel load, clocks)."""
    fn()
    best = math.inf
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def measure_read_bandwidth(device: str | torch.device, nbytes: int | None = None, repeats: int = 5) -> float:
    """Read bandwidth in bytes/s: a sum over one large tensor (every byte read once, nothing written
    back but a scalar — the access pattern of a decode step's weight reads). Best of `repeats`.
    Default size 4 GiB on CUDA (far past any cache), 32 MiB on CPU (so it stays quick to test)."""
    dev = torch.device(device)
    n = nbytes or (4 * GIB if dev.type == "cuda" else 32 * 2**20)
    x = torch.ones(n // 4, dtype=torch.float32, device=dev)
    seconds = _best_seconds(lambda: x.sum(), dev, repeats)
    return (n // 4) * 4 / seconds


def measure_matmul_peak(device: str | torch.device, dtype: torch.dtype = torch.bfloat16, size: int | None = None,
                        repeats: int = 5) -> float:
    """Dense matmul throughput in FLOP/s: square GEMMs of `size` (default 8192 on CUDA, 256 on CPU),
    several per timed call on CUDA so launch overhead does not count. Best of `repeats`."""
    dev = torch.device(device)
    n = size or (8192 if dev.type == "cuda" else 256)
    inner = 8 if dev.type == "cuda" else 1
    gen = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(n, n, device=dev, generator=gen).to(dtype)
    b = torch.randn(n, n, device=dev, generator=gen).to(dtype)

    def run() -> None:
        for _ in range(inner):
            torch.mm(a, b)

    return 2 * n**3 * inner / _best_seconds(run, dev, repeats)


@dataclass(frozen=True)
class Probes:
    read_bytes_per_s: float
    matmul_flops_per_s: float
    matmul_dtype: str
    seconds: float  # how long the probes took

    @classmethod
    def measure(cls, device: str | torch.device, dtype: torch.dtype, repeats: int) -> "Probes":
        t0 = time.perf_counter()
        bw = measure_read_bandwidth(device, repeats=repeats)
        peak = measure_matmul_peak(device, dtype, repeats=repeats)
        return cls(bw, peak, str(dtype).removeprefix("torch."), time.perf_counter() - t0)


# --- the roofline: what a step must read and compute ---------------------------------------------


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
                             f"memra.benchmark.trunk_weights needs updating for this layout")
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


def _cache_parts(cfg: ModelConfig, dtype: torch.dtype, context: int) -> tuple[int, int]:
    """One sequence's cache (memra.cache layout): (K and V of `context` positions over the attention
    layers, the recurrent state of the GDN layers: fp32 delta-rule state + conv window) in bytes."""
    item = torch.empty((), dtype=dtype).element_size()
    kv = len(cfg.attention_layers) * context * 2 * cfg.attn.n_kv_heads * cfg.attn.head_dim * item
    rec = 0
    if cfg.gdn is not None:
        g = cfg.gdn
        per_layer = g.n_v_heads * g.k_head_dim * g.v_head_dim * 4 + g.conv_dim * (g.conv_kernel - 1) * item
        rec = len(cfg.gdn_layers) * per_layer
    return kv, rec


def state_bytes(cfg: ModelConfig, dtype: torch.dtype, context: int) -> int:
    """Bytes one sequence's decode step moves in its cache: the KV of `context` positions (read; the new
    token's K/V write is negligible) and the GDN recurrent state read and written back (it is replaced
    every step, so its write is as unavoidable as its read)."""
    kv, rec = _cache_parts(cfg, dtype, context)
    return kv + 2 * rec


def cache_bytes(cfg: ModelConfig, dtype: torch.dtype, context: int) -> int:
    """Memory one sequence's cache of `context` positions holds."""
    return sum(_cache_parts(cfg, dtype, context))


def decode_step_bytes(model, batch: int, context: int) -> float:
    """Bytes a decode step of `batch` sequences, each at `context` positions, must move."""
    return weight_bytes(model, batch) + batch * state_bytes(model.cfg, model.dtype, context)


def roofline_decode_tokens_per_s(model, batch: int, bandwidth: float, *, context: int) -> float:
    """The bandwidth bound of decode: batch tokens per (bytes that must be read / read bandwidth)."""
    return batch / (decode_step_bytes(model, batch, context) / bandwidth)


def prefill_flops(model, tokens: int, pos0: int = 0) -> float:
    """FLOPs of priming `tokens` tokens of one sequence from position pos0: 2 per weight per token for
    every matmul weight (the routed experts at top_k / n_experts of theirs, the embedding gather free),
    the LM head once (prime computes only the last position's logits), causal attention over the prefix,
    and an estimate of the chunked delta rule (state apply + update, and the intra-chunk products)."""
    from memra.kernels.reference import GDN_CHUNK

    cfg = model.cfg
    per_token = 0.0
    for name, t in trunk_weights(model).items():
        if name in ("embed", "lm_head") or len(t.shape) < 2 or name.endswith(".gdn.conv"):
            continue
        n = tensor_numel(t)  # a packed QuantWeight counts its logical [N, K]
        if name.endswith(ROUTED):
            n *= cfg.moe.top_k / cfg.moe.n_experts
        per_token += 2 * n
    flops = per_token * tokens + 2 * cfg.vocab_size * cfg.hidden_size
    a = cfg.attn
    # causal QK^T and PV: token at position p attends to p + 1 keys, 2 FLOPs per multiply-add, 2 products
    keys = tokens * pos0 + tokens * (tokens + 1) / 2
    flops += len(cfg.attention_layers) * 4 * a.n_heads * a.head_dim * keys
    if cfg.gdn is not None:
        g = cfg.gdn
        per_head = 6 * g.k_head_dim * g.v_head_dim + 2 * GDN_CHUNK * (g.k_head_dim + g.v_head_dim)
        flops += len(cfg.gdn_layers) * g.n_v_heads * per_head * tokens
    return flops


def roofline_prefill_tokens_per_s(model, tokens: int, bandwidth: float, matmul_flops: float, pos0: int = 0) -> float:
    """The prefill bound: tokens / max(FLOPs / matmul peak, weight bytes / read bandwidth)."""
    seconds = max(prefill_flops(model, tokens, pos0) / matmul_flops, weight_bytes(model, tokens) / bandwidth)
    return tokens / seconds


# --- memra timings -------------------------------------------------------------------------------


def mode_view(model, mode: str):
    """The model as one mode runs it: the exact path, or the fast one (MEMRA_EXACT=0) — a view with
    other settings over the same weights (HybridModel.with_settings), not a change to the environment."""
    exact = mode != "fast"
    return model if model.settings.exact == exact else model.with_settings(model.settings.replace(exact=exact))


def prompt_ids(vocab: int, n: int, row: int = 0, seed: int = 0) -> list[int]:
    """A seeded prompt, different per row (the values do not change the speed; distinct rows keep
    every sequence a real one)."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + row)
    return torch.randint(vocab, (n,), generator=gen).tolist()


def shared_caches(model, batch: int, max_ctx: int) -> list:
    """B sequences in one KV pool and one recurrent pool, as a server keeps them (and as CUDA graphs
    need them: memra.graphs), with the graphs' scratch block and slot set aside."""
    from memra.cache import BLOCK_SIZE, Cache, RecurrentPool, kv_pool
    from memra.graphs import reserve_scratch

    cfg = model.cfg
    kv = kv_pool(cfg, batch * -(-max_ctx // BLOCK_SIZE) + 1, model.dtype, model.device)
    rec = RecurrentPool(cfg, batch + 1, model.dtype, model.device) if cfg.gdn_layers else None
    reserve_scratch(model, kv, rec)
    return [Cache(kv=kv, rec=rec, max_ctx=max_ctx, slot=rec.allocate() if rec else None) for _ in range(batch)]


@torch.inference_mode()
def time_decode(model, batch: int, steps: int, warmup: int, prompt_tokens: int, seed: int = 0) -> Timing:
    """B sequences primed with their own prompts, then `warmup` untimed and `steps` timed decode steps
    of all B rows through decode_step_batch, each fed the previous step's greedy tokens (the host
    round-trip a real decode loop pays)."""
    from memra.decode_plan import decode_plan

    if model.settings.exact:
        decode_plan(model)  # resolve (and on-model verify, once per model) the exact plan before any timing
    vocab = model.cfg.vocab_size
    caches = shared_caches(model, batch, prompt_tokens + warmup + steps + 1)
    toks = [int(model.prime(prompt_ids(vocab, prompt_tokens, i, seed), c).argmax()) for i, c in enumerate(caches)]
    for _ in range(warmup):
        toks = model.decode_step_batch(toks, caches).argmax(-1).tolist()
    _sync(model.device)
    t0 = time.perf_counter()
    for _ in range(steps):
        toks = model.decode_step_batch(toks, caches).argmax(-1).tolist()
    _sync(model.device)
    seconds = (time.perf_counter() - t0) / steps
    return Timing(seconds, batch, steps, context=prompt_tokens + warmup + steps // 2)


@torch.inference_mode()
def time_prefill(model, tokens: int, repeats: int, seed: int = 0) -> Timing:
    """One prime of `tokens` tokens as a single chunk into an empty cache (best of `repeats`)."""
    ids = prompt_ids(model.cfg.vocab_size, tokens, 0, seed)
    cache = model.new_cache(tokens)

    def run() -> None:
        cache.reset()
        model.prime(ids, cache, chunk_size=tokens)

    return Timing(_best_seconds(run, model.device, repeats), tokens, repeats)


@torch.inference_mode()
def time_ttft(model, tokens: int, repeats: int, seed: int = 0) -> Timing:
    """Time to first token: prime a `tokens`-token prompt and take its greedy token on the host — the
    wall time until a client could see it (cache allocation excluded: a server keeps pools). Best of
    `repeats`."""
    ids = prompt_ids(model.cfg.vocab_size, tokens, 1, seed)
    cache = model.new_cache(tokens + 1)

    def run() -> None:
        cache.reset()
        int(model.prime(ids, cache).argmax())

    return Timing(_best_seconds(run, model.device, repeats), tokens, repeats)


# --- the Hugging Face peer -----------------------------------------------------------------------

HF_CLASSES = {  # memra arch -> (transformers config class, model class)
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM"),
}


def _mrope_section(half: int) -> list[int]:
    """Qwen3.5's 3-way split of the rotary frequencies (text, height, width). Text-only positions are
    the same in all three, so any split that sums to R/2 gives plain RoPE; this one is the checkpoints'
    [11, 11, 10] at R = 64."""
    c = -(-half // 3)
    return [c, min(c, half - c), max(0, half - 2 * c)]


def hf_config(cfg: ModelConfig):
    """The transformers config of a memra ModelConfig (the inverse of memra.config.from_hf_config for
    the architectures in HF_CLASSES). Raises MemraError naming what transformers cannot express."""
    import transformers

    if cfg.arch not in HF_CLASSES:
        raise MemraError(f"no Hugging Face peer for architecture {cfg.arch!r} (supported: {', '.join(HF_CLASSES)})")
    config_cls = getattr(transformers, HF_CLASSES[cfg.arch][0], None)
    if config_cls is None:
        raise MemraError(f"transformers {transformers.__version__} has no {HF_CLASSES[cfg.arch][0]}")
    a, r = cfg.attn, cfg.rope
    rope: dict[str, Any] = {"rope_type": r.scaling or "default", "rope_theta": r.theta}
    if r.scaling in ("linear", "llama3"):
        rope["factor"] = r.factor
    if r.scaling == "llama3":
        rope.update(low_freq_factor=r.low_freq_factor, high_freq_factor=r.high_freq_factor,
                    original_max_position_embeddings=r.original_max_position)
    common = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.n_layers,
                  num_attention_heads=a.n_heads, num_key_value_heads=a.n_kv_heads, head_dim=a.head_dim,
                  rms_norm_eps=cfg.norm_eps, max_position_embeddings=cfg.max_position,
                  tie_word_embeddings=cfg.tie_embeddings, attention_bias=a.qkv_bias, pad_token_id=0)
    if cfg.arch == "llama":
        if r.dim != a.head_dim or a.qk_norm or a.output_gate:
            raise MemraError("a llama peer needs full-head RoPE, no qk-norm and no output gate")
        return config_cls(**common, intermediate_size=cfg.intermediate_size, rope_parameters=rope)
    if not (a.qk_norm and a.output_gate and cfg.zero_centered_norm):
        raise MemraError(f"transformers' {cfg.arch} always has qk-norm, an output gate and (1+w) norms")
    g = cfg.gdn
    rope.update(partial_rotary_factor=r.dim / a.head_dim, mrope_section=_mrope_section(r.dim // 2),
                mrope_interleaved=True)
    hybrid = dict(layer_types=["full_attention" if m == "attention" else "linear_attention" for m in cfg.mixers],
                  linear_conv_kernel_dim=g.conv_kernel, linear_key_head_dim=g.k_head_dim,
                  linear_value_head_dim=g.v_head_dim, linear_num_key_heads=g.n_k_heads,
                  linear_num_value_heads=g.n_v_heads, rope_parameters=rope)
    if cfg.arch == "qwen3_5":
        return config_cls(**common, **hybrid, intermediate_size=cfg.intermediate_size)
    m = cfg.moe
    if not (m.norm_topk and m.shared_gate and m.shared_ffn):
        raise MemraError("transformers' qwen3_5_moe always renormalizes top-k and has a gated shared expert")
    return config_cls(**common, **hybrid, num_experts=m.n_experts, num_experts_per_tok=m.top_k,
                      moe_intermediate_size=m.expert_ffn, shared_expert_intermediate_size=m.shared_ffn)


def hf_state_dict(cfg: ModelConfig, w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """memra's canonical trunk weights (trunk_weights) under Hugging Face names — the inverse of
    memra.loading.hf. Fused matrices are split into row views, so the big tensors share memra's
    memory; only the small ones change value: (1+w) norms back to w, a_neg back to A_log = log(-a_neg),
    the depthwise conv back to [C, 1, K]."""
    zc = cfg.zero_centered_norm
    norm = (lambda t: t - 1.0) if zc else (lambda t: t)
    out = {"model.embed_tokens.weight": w["embed"], "model.norm.weight": norm(w["final_norm"]),
           "lm_head.weight": w["lm_head"]}
    a = cfg.attn
    for i in range(cfg.n_layers):
        p, q = f"layers.{i}.", f"model.layers.{i}."
        out[q + "input_layernorm.weight"] = norm(w[p + "attn_norm"])
        out[q + "post_attention_layernorm.weight"] = norm(w[p + "ffn_norm"])
        if cfg.mixers[i] == "attention":
            q_rows = a.n_heads * a.head_dim * (2 if a.output_gate else 1)
            qkv = w[p + "attn.wqkv"].split([q_rows, a.n_kv_heads * a.head_dim, a.n_kv_heads * a.head_dim])
            for name, t in zip(("q_proj", "k_proj", "v_proj"), qkv):
                out[q + f"self_attn.{name}.weight"] = t
            out[q + "self_attn.o_proj.weight"] = w[p + "attn.wo"]
            if a.qk_norm:
                out[q + "self_attn.q_norm.weight"] = norm(w[p + "attn.q_norm"])
                out[q + "self_attn.k_norm.weight"] = norm(w[p + "attn.k_norm"])
        else:
            g = cfg.gdn
            qkv, z, b, a_ = w[p + "gdn.w_in"].split([g.conv_dim, g.value_dim, g.n_v_heads, g.n_v_heads])
            la = q + "linear_attn."
            out.update({la + "in_proj_qkv.weight": qkv, la + "in_proj_z.weight": z, la + "in_proj_b.weight": b,
                        la + "in_proj_a.weight": a_, la + "conv1d.weight": w[p + "gdn.conv"][:, None, :],
                        la + "A_log": torch.log(-w[p + "gdn.a_neg"].float()), la + "dt_bias": w[p + "gdn.dt_bias"],
                        la + "norm.weight": w[p + "gdn.norm"], la + "out_proj.weight": w[p + "gdn.wo"]})
        if cfg.ffns[i] == "moe":
            out.update({q + "mlp.gate.weight": w[p + "moe.router"],
                        q + "mlp.experts.gate_up_proj": w[p + "moe.w_gate_up"],
                        q + "mlp.experts.down_proj": w[p + "moe.w_down"]})
            if cfg.moe.shared_ffn:
                gate, up = w[p + "moe.shared_gate_up"].chunk(2)
                out.update({q + "mlp.shared_expert.gate_proj.weight": gate, q + "mlp.shared_expert.up_proj.weight": up,
                            q + "mlp.shared_expert.down_proj.weight": w[p + "moe.shared_down"]})
                if cfg.moe.shared_gate:
                    out[q + "mlp.shared_expert_gate.weight"] = w[p + "moe.shared_gate"]
        else:
            gate, up = w[p + "mlp.w_gate_up"].chunk(2)
            out.update({q + "mlp.gate_proj.weight": gate, q + "mlp.up_proj.weight": up,
                        q + "mlp.down_proj.weight": w[p + "mlp.w_down"]})
    return out


def _rebuild_meta_buffers(module: torch.nn.Module, device: torch.device) -> None:
    """Buffers computed at construction (the rotary inverse frequencies) are empty on the meta device;
    build those modules again, for real, on `device`."""
    for name, child in list(module.named_modules()):
        if any(b.is_meta for b in child.buffers(recurse=False)):
            if not hasattr(child, "config") or not name:
                raise MemraError(f"cannot rebuild {name or 'the model'} ({type(child).__name__}): buffers on meta")
            parent = module.get_submodule(name.rsplit(".", 1)[0]) if "." in name else module
            with torch.device(device):
                setattr(parent, name.rsplit(".", 1)[-1], type(child)(child.config))


def hf_peer(model) -> tuple[Any, str]:
    """A transformers model with memra's own weights: built on the meta device (no allocation), then
    memra's tensors assigned as its parameters (views: no second copy of the model in memory).
    -> (hf_model, how). If that is impossible, HF's own random init of the same config on the same
    device (same shapes, so the same speed; the values differ) and `how` says so. Raises MemraError
    when transformers cannot build the architecture at all."""
    try:
        import transformers
    except ImportError:
        raise MemraError("transformers is not installed (pip install transformers)") from None
    cfg, dtype, device = model.cfg, model.dtype, model.device
    config = hf_config(cfg)
    model_cls = getattr(transformers, HF_CLASSES[cfg.arch][1], None)
    if model_cls is None:
        raise MemraError(f"transformers {transformers.__version__} has no {HF_CLASSES[cfg.arch][1]}")
    try:
        with torch.device("meta"):
            hf = model_cls._from_config(config, dtype=dtype)
        # memra's weights are inference tensors (built under inference_mode): they can become only
        # parameters that never ask for a gradient
        hf.requires_grad_(False)
        want = {k: v.dtype for k, v in hf.state_dict().items()}
        sd = {k: v if v.dtype == want.get(k, v.dtype) else v.to(want[k])
              for k, v in hf_state_dict(cfg, trunk_weights(model)).items()}
        hf.load_state_dict(sd, strict=True, assign=True)
        _rebuild_meta_buffers(hf, device)
        if any(t.is_meta for t in (*hf.parameters(), *hf.buffers())):
            raise MemraError("tensors left on the meta device")
        how = "memra's weights (shared tensors)"
    except (MemraError, RuntimeError, KeyError, TypeError, ValueError) as e:
        with torch.device(device):
            hf = model_cls._from_config(config, dtype=dtype)
        how = f"HF random init of the same config (sharing memra's weights failed: {type(e).__name__}: {e})"
    hf.eval()
    hf.generation_config.pad_token_id = 0
    hf.generation_config.eos_token_id = None  # random weights must not stop early: every row makes N tokens
    return hf, how


def hf_notes(hf, cfg: ModelConfig) -> str:
    """Which kernels the HF peer runs, where that decides its speed."""
    import importlib.util

    notes = [f"HF attention: {getattr(hf.config, '_attn_implementation', None) or 'default'}"]
    if cfg.gdn is not None:
        missing = [m for m in ("fla", "causal_conv1d") if importlib.util.find_spec(m) is None]
        if missing:
            notes.append(f"HF GDN: torch fallback ({', '.join(missing)} not installed)")
    return "; ".join(notes)


def _hf_generate_seconds(hf, ids: torch.Tensor, new_tokens: int) -> float:
    _sync(ids.device)
    t0 = time.perf_counter()
    hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                min_new_tokens=new_tokens, do_sample=False)
    _sync(ids.device)
    return time.perf_counter() - t0


def _hf_ids(vocab: int, batch: int, tokens: int, seed: int, device: torch.device) -> torch.Tensor:
    return torch.tensor([prompt_ids(vocab, tokens, i, seed) for i in range(batch)], device=device)


@torch.inference_mode()
def time_hf_decode(hf, vocab: int, batch: int, steps: int, warmup: int, prompt_tokens: int, device: torch.device,
                   seed: int = 0) -> Timing:
    """HF decode tokens/s at B: generate(steps + 1 tokens) minus generate(1 token) — the difference is
    `steps` decode steps, with the prompt's prefill and the first token taken out."""
    ids = _hf_ids(vocab, batch, prompt_tokens, seed, device)
    if warmup:
        _hf_generate_seconds(hf, ids, 2)
    first = _hf_generate_seconds(hf, ids, 1)
    total = _hf_generate_seconds(hf, ids, steps + 1)
    if total <= first:
        raise MemraError(f"HF generate of {steps + 1} tokens took {total:.4f} s, of 1 token {first:.4f} s: "
                         f"timing noise exceeds {steps} decode steps; use more --steps")
    return Timing((total - first) / steps, batch, steps, context=prompt_tokens + steps // 2)


@torch.inference_mode()
def time_hf_first_token(hf, vocab: int, tokens: int, repeats: int, device: torch.device, seed: int = 0) -> Timing:
    """HF prefill and TTFT: generate(1 token) from a `tokens`-token prompt, best of `repeats`."""
    ids = _hf_ids(vocab, 1, tokens, seed, device)
    return Timing(_best_seconds(lambda: _hf_generate_seconds(hf, ids, 1), device, repeats), tokens, repeats)


# --- results -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BenchResult:
    """One cell: a model, a mode (exact | fast | hf) and a phase (decode at batch B, prefill, ttft)."""

    model: str
    weights: str
    mode: str
    phase: str
    batch: int
    status: str = "ok"  # ok | skipped | failed
    tokens: int = 0  # per operation: B (decode), the chunk (prefill), the prompt (ttft)
    seconds: float | None = None  # one operation: a decode step, a chunk, a first token
    tokens_per_s: float | None = None
    roofline_tokens_per_s: float | None = None
    vs_roofline: float | None = None  # tokens_per_s / roofline_tokens_per_s (<= 1 unless the model is wrong)
    vs_hf: float | None = None  # tokens_per_s / the HF peer's, same phase and batch
    vs_fast: float | None = None  # exact rows: exact / fast tokens/s (the exactness overhead target: >= 0.9)
    vs_pooled: float | None = None  # engine / newcache rows: tokens/s / the exact pooled step's, same B
    context: int = 0  # decode: mean context length the roofline assumes
    note: str = ""

    @property
    def key(self) -> tuple[str, str, int]:
        return (self.model, self.phase, self.batch)


@dataclass(frozen=True)
class ModelInfo:
    name: str
    arch: str
    layers: int
    full_layers: int | None  # the shape's real layer count (None for a custom factory's model)
    params: int  # trunk parameters (MTP blocks excluded)
    weight_bytes: int  # trunk bytes in memory
    build_s: float
    hf_peer: str  # how the peer was built, or why there is none
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class BenchReport:
    config: BenchConfig
    probes: Probes
    environment: dict
    models: tuple[ModelInfo, ...]
    rows: tuple[BenchResult, ...]
    wall_s: float

    def row(self, model: str, mode: str, phase: str, batch: int = 1) -> BenchResult:
        for r in self.rows:
            if (r.model, r.mode, r.phase, r.batch) == (model, mode, phase, batch):
                return r
        raise KeyError((model, mode, phase, batch))

    @property
    def failed(self) -> list[BenchResult]:
        return [r for r in self.rows if r.status == "failed"]

    def to_json(self) -> dict:
        return {"schema": 1, "config": self.config.to_json(), "probes": dataclasses.asdict(self.probes),
                "environment": self.environment, "models": [dataclasses.asdict(m) for m in self.models],
                "rows": [dataclasses.asdict(r) for r in self.rows], "wall_s": self.wall_s}

    @classmethod
    def from_json(cls, d: dict) -> "BenchReport":
        models = tuple(ModelInfo(**{**m, "notes": tuple(m["notes"])}) for m in d["models"])
        return cls(BenchConfig.from_json(d["config"]), Probes(**d["probes"]), d["environment"], models,
                   tuple(BenchResult(**r) for r in d["rows"]), d["wall_s"])

    def write_json(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_json(), f, indent=1)

    def table(self) -> str:
        p, env = self.probes, self.environment
        lines = [f"{env.get('device_name', '?')} | torch {env.get('torch')} | transformers {env.get('transformers')}"
                 f" | weights {self.config.weights} | {self.wall_s:.0f} s",
                 f"probes: read {_si(p.read_bytes_per_s)}B/s (sum over a large tensor), "
                 f"{p.matmul_dtype} matmul {_si(p.matmul_flops_per_s)}FLOP/s (square GEMM) — the roofline's inputs"]
        if env.get("doors"):
            lines.append("doors: " + " ".join(f"{k}={v}" for k, v in sorted(env["doors"].items())))
        for m in self.models:
            layers = f"{m.layers} of {m.full_layers}" if m.full_layers else str(m.layers)
            lines.append(f"{m.name}: {m.arch}, {layers} layers, {_si(m.params)} trunk params, "
                         f"{_si(m.weight_bytes)}B; HF peer: {m.hf_peer}")
            lines += [f"  note: {n}" for n in m.notes]
        head = ("model", "mode", "phase", "B", "tok/s", "ms/op", "roofline", "of roof", "vs HF", "exact/fast",
                "of pooled", "notes")
        body = [head]
        fmt = lambda x, spec: "-" if x is None else format(x, spec)
        for r in self.rows:
            tps = r.status if r.status != "ok" else fmt(r.tokens_per_s, ".1f")
            body.append((r.model, r.mode, r.phase, str(r.batch), tps,
                         fmt(None if r.seconds is None else r.seconds * 1e3, ".2f"),
                         fmt(r.roofline_tokens_per_s, ".1f"), fmt(r.vs_roofline, ".1%"),
                         fmt(r.vs_hf, ".2f") + ("x" if r.vs_hf else ""),
                         fmt(r.vs_fast, ".3f"), fmt(r.vs_pooled, ".3f"), r.note))
        widths = [max(len(row[i]) for row in body) for i in range(len(head) - 1)]
        lines.append("")
        for row in body:
            lines.append("  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
                         + "  " + row[-1])
        lines.append("")
        lines.append("roofline: decode = B / (bytes a step must read / read bandwidth) — weights once (routed experts: "
                     "expected share under uniform routing), KV of the context, GDN state read+written; prefill/ttft = "
                     "tokens / max(FLOPs / matmul peak, weight bytes / bandwidth). ms/op: one decode step of the batch, "
                     "one prefill chunk, one first token.")
        return "\n".join(lines)


def _si(x: float) -> str:
    """1.23 G, 45.6 M, ...: a number with an SI prefix (the unit follows)."""
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= factor:
            return f"{x / factor:.2f} {prefix}"
    return f"{x:.2f} "


def link_ratios(rows: Sequence[BenchResult]) -> tuple[BenchResult, ...]:
    """Fill vs_hf (each memra row against the HF row of the same model, phase and batch) and vs_fast
    (each exact row against the fast row of the same cell) — both from this run's rows only."""
    by = {(r.mode, *r.key): r for r in rows if r.status == "ok" and r.tokens_per_s}
    out = []
    for r in rows:
        if r.status == "ok" and r.tokens_per_s and r.mode != "hf":
            hf, fast = by.get(("hf", *r.key)), by.get(("fast", *r.key))
            pooled = by.get(("exact", *r.key)) if r.mode in PATHS else None
            r = dataclasses.replace(r, vs_hf=r.tokens_per_s / hf.tokens_per_s if hf else None,
                                    vs_fast=r.tokens_per_s / fast.tokens_per_s if fast and r.mode == "exact" else None,
                                    vs_pooled=r.tokens_per_s / pooled.tokens_per_s if pooled else None)
        out.append(r)
    return tuple(out)


# --- the run -------------------------------------------------------------------------------------


def _environment(device: torch.device) -> dict:
    try:
        import transformers

        tf = transformers.__version__
    except ImportError:
        tf = None
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or platform.machine())
    from memra import __version__

    return {"device": str(device), "device_name": name, "torch": torch.__version__, "transformers": tf,
            "memra": __version__, "python": platform.python_version(), "cuda": torch.version.cuda,
            # the MEMRA_* doors set for this run (each cell's mode sets MEMRA_EXACT for its own view)
            "doors": {k: v for k, v in process_env().items() if k.startswith("MEMRA_") and k != "MEMRA_EXACT"}}


def _shape_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes random_model allocates for a config (MTP included): fp32 norms/gates, the rest in dtype."""
    from memra.config import FP32_WEIGHTS

    item = torch.empty((), dtype=dtype).element_size()
    return sum(math.prod(s) * (4 if k.rsplit(".", 1)[-1] in FP32_WEIGHTS else item)
               for k, s in canonical_shapes(cfg).items())


RESERVE_BYTES = 8 * GIB  # activations, HF's caches, allocator slack — kept free beyond weights and memra's caches


def fit_layers(name: str, requested: int | None, cfg: BenchConfig, free_bytes: int) -> tuple[int, str | None]:
    """The layer count to build `name` with: the requested one, or the shape's own if it fits in
    free_bytes with the largest batch's caches and a reserve; else the most layers that fit (a multiple
    of 4 for hybrids, keeping their 3 GDN : 1 attention pattern) and a note saying so."""
    full = requested or SHAPES[name]().n_layers
    dtype, decode_ctx = cfg.dtype, cfg.prompt_tokens + cfg.warmup + cfg.decode_steps + 1
    long_ctx = max(cfg.prefill_chunk, cfg.ttft_tokens + 1)

    def need(n: int) -> int:  # weights + the widest decode cell's caches + one long prompt's cache + reserve
        shape = SHAPES[name](n)
        return (_shape_bytes(shape, dtype) + max(cfg.batches) * cache_bytes(shape, dtype, decode_ctx)
                + cache_bytes(shape, dtype, long_ctx) + RESERVE_BYTES)

    if requested is not None or need(full) <= free_bytes:
        return full, None
    step = 4 if "gdn" in SHAPES[name]().mixers else 1
    fits = [n for n in range(step, full, step) if need(n) <= free_bytes]
    if not fits:
        raise MemraError(f"{name}: not even {step} layer(s) fit in {free_bytes / 1e9:.1f} GB free")
    return fits[-1], (f"built with {fits[-1]} of {full} layers: the full model needs ~{need(full) / 1e9:.0f} GB "
                      f"(weights, caches, reserve) and {free_bytes / 1e9:.0f} GB are free; "
                      f"every number and roofline here is for the reduced model")


class _Progress:
    """A tqdm bar on an interactive terminal only: in CI or a log file it is noise."""

    def __init__(self, total: int, enabled: bool | None):
        if enabled is None:
            enabled = show_progress()
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc="bench", unit="cell", file=sys.stderr)

    def step(self, label: str) -> None:
        if self.bar is not None:
            self.bar.set_description(label)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def planned_cells(cfg: BenchConfig, model: str) -> list[tuple[str, str, int]]:
    """Every (mode, phase, batch) cell of one model, in run order: memra modes first, then the peer."""
    modes = [m for m in cfg.exact_modes if m in MODES] + (["hf"] if cfg.peer_hf else [])
    cells = [(mode, phase, b) for mode in modes
             for phase, batches in (("decode", cfg.batches), ("prefill", (1,)), ("ttft", (1,))) for b in batches]
    return cells + [(mode, "decode", b) for mode in cfg.exact_modes if mode in PATHS for b in cfg.batches]


class _Run:
    """One benchmark run's state: the rows so far, the clock and the budget."""

    def __init__(self, cfg: BenchConfig, clock: Callable[[], float], log: Callable[[str], None], progress: bool | None):
        self.cfg, self.clock, self.log = cfg, clock, log
        self.start = clock()
        self.rows: list[BenchResult] = []
        self.models: list[ModelInfo] = []
        self.bar = _Progress(sum(len(planned_cells(cfg, m)) for m in cfg.models), progress)

    def over_budget(self) -> bool:
        return self.cfg.budget_s is not None and self.clock() - self.start >= self.cfg.budget_s

    def record(self, row: BenchResult) -> None:
        self.rows.append(row)
        self.bar.step(f"{row.model} {row.mode} {row.phase}" + (f" B={row.batch}" if row.phase == "decode" else ""))

    def cell(self, name: str, mode: str, phase: str, batch: int, measure: Callable[[], Timing],
             roofline: Callable[[Timing], float] | None, note: str = "") -> None:
        base = dict(model=name, weights=self.cfg.weights, mode=mode, phase=phase, batch=batch)
        if self.over_budget():
            self.record(BenchResult(**base, status="skipped",
                                    note=f"time budget of {self.cfg.budget_s:g} s spent before this cell"))
            return
        try:
            t = measure()
        except Exception as e:  # noqa: BLE001 — a failed cell is recorded with its error, and the run goes on
            error = f"{type(e).__name__}: {e}"[:300]
        else:
            error = None
        if error is not None:
            _free_device(torch.device(self.cfg.device))  # here, once the traceback no longer holds the cell's tensors
            self.record(BenchResult(**base, status="failed", note=error))
            return
        tps = t.tokens / t.seconds
        roof = roofline(t) if roofline is not None else None
        self.record(BenchResult(**base, tokens=t.tokens, seconds=t.seconds, tokens_per_s=tps,
                                roofline_tokens_per_s=roof, vs_roofline=tps / roof if roof else None,
                                context=t.context, note=note))

    def skip_model(self, name: str, why: str, status: str = "skipped") -> None:
        for mode, phase, b in planned_cells(self.cfg, name):
            self.record(BenchResult(name, self.cfg.weights, mode, phase, b, status=status, note=why))


def _free_device(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_bench(cfg: BenchConfig, *, clock: Callable[[], float] = time.perf_counter,
              log: Callable[[str], None] | None = None, progress: bool | None = None) -> BenchReport:
    """Run every cell of `cfg` and return the report (also written to cfg.json_path when set).

    `clock` measures the budget (tests pass a fake one); `log` receives one line per event (model
    built, peer built); `progress` forces the tqdm bar on or off (default: on a TTY outside CI)."""
    log = log or (lambda line: None)
    device = torch.device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise MemraError("--device cuda but CUDA is not available here; use --device cpu")
    run = _Run(cfg, clock, log, progress)
    probes = Probes.measure(device, cfg.dtype, cfg.repeats)
    log(f"probes: read {_si(probes.read_bytes_per_s)}B/s, matmul {_si(probes.matmul_flops_per_s)}FLOP/s")
    env = _environment(device)

    def report() -> BenchReport:
        return BenchReport(cfg, probes, env, tuple(run.models), link_ratios(run.rows), clock() - run.start)

    try:
        for i, name in enumerate(cfg.models):
            _bench_model(run, name, device, probes)
            _free_device(device)  # the model (and its HF peer) went out of scope with _bench_model
            if cfg.json_path and i < len(cfg.models) - 1:  # a partial report, so a later crash keeps these numbers
                report().write_json(cfg.json_path)
    finally:
        run.bar.close()
    final = report()
    if cfg.json_path:
        final.write_json(cfg.json_path)
    return final


def _build(run: _Run, name: str, device: torch.device):
    cfg = run.cfg
    requested, note = cfg.layers_for(name), None
    if cfg.model_factory is None and device.type == "cuda":
        _free_device(device)
        requested, note = fit_layers(name, requested, cfg, torch.cuda.mem_get_info(device)[0])
    factory = cfg.model_factory
    if factory is None:
        from memra.random_model import random_model

        quant = WEIGHT_FORMATS[cfg.weights][1]
        factory = lambda *a: random_model(*a, quant=quant)  # noqa: E731
    t0 = time.perf_counter()
    model = factory(name, device, cfg.dtype, requested, cfg.seed)
    _sync(device)
    return model, time.perf_counter() - t0, note


def _bench_model(run: _Run, name: str, device: torch.device, probes: Probes) -> None:
    cfg = run.cfg
    if run.over_budget():
        run.skip_model(name, f"time budget of {cfg.budget_s:g} s spent before this model was built")
        return
    try:
        model, build_s, fit_note = _build(run, name, device)
    except (MemraError, RuntimeError) as e:
        _free_device(device)
        run.skip_model(name, f"could not build: {type(e).__name__}: {e}"[:300], status="failed")
        return
    run.log(f"built {model!r} in {build_s:.1f} s")
    mcfg, bw, peak = model.cfg, probes.read_bytes_per_s, probes.matmul_flops_per_s
    trunk = trunk_weights(model)
    notes = [fit_note] if fit_note else []
    full = SHAPES[name]().n_layers if name in SHAPES else None

    # Rooflines depend only on the model and the probes; computed now, while memra's model is alive.
    decode_roof = lambda t: roofline_decode_tokens_per_s(model, t.tokens, bw, context=t.context)
    prefill_roof = lambda t: roofline_prefill_tokens_per_s(model, t.tokens, bw, peak)
    roofs = {("decode", b): roofline_decode_tokens_per_s(model, b, bw, context=cfg.prompt_tokens + cfg.decode_steps // 2)
             for b in cfg.batches}
    roofs[("prefill", 1)] = roofline_prefill_tokens_per_s(model, cfg.prefill_chunk, bw, peak)
    roofs[("ttft", 1)] = roofline_prefill_tokens_per_s(model, cfg.ttft_tokens, bw, peak)

    for mode in (m for m in cfg.exact_modes if m in MODES):
        view = mode_view(model, mode)
        for b in cfg.batches:
            run.cell(name, mode, "decode", b,
                     lambda: time_decode(view, b, cfg.decode_steps, cfg.warmup, cfg.prompt_tokens, cfg.seed),
                     decode_roof)
        run.cell(name, mode, "prefill", 1, lambda: time_prefill(view, cfg.prefill_chunk, cfg.repeats, cfg.seed),
                 prefill_roof)
        run.cell(name, mode, "ttft", 1, lambda: time_ttft(view, cfg.ttft_tokens, cfg.repeats, cfg.seed),
                 prefill_roof)

    _bench_paths(run, name, model, decode_roof)
    if any(r.model == name and r.mode == "exact" and r.phase == "decode" and r.status == "ok" for r in run.rows):
        notes.append(f"exact decode plan: {_exact_plan(model)}")  # already resolved (and cached) by those cells
    hf_how = "off (--no-hf)"
    if cfg.peer_hf and WEIGHT_FORMATS[cfg.weights][1] is not None:
        hf_how = f"off (the HF peer runs bf16 weights; these are {cfg.weights})"
    elif cfg.peer_hf:
        hf_how = _bench_peer(run, name, model, roofs)
    run.models.append(ModelInfo(name, mcfg.arch, mcfg.n_layers, full, sum(tensor_numel(t) for t in trunk.values()),
                                sum(tensor_bytes(t) for t in trunk.values()), build_s, hf_how,
                                tuple(notes)))


def _bench_paths(run: _Run, name: str, model, decode_roof) -> None:
    """The engine and new_cache cells (memra.bench.user_paths), in the exact mode."""
    from memra.bench.user_paths import time_engine_decode, time_new_cache_decode

    cfg, model = run.cfg, mode_view(model, "exact")
    timers = {"engine": time_engine_decode, "newcache": time_new_cache_decode}
    for mode in (m for m in cfg.exact_modes if m in PATHS):
        for b in cfg.batches:
            prompts = [prompt_ids(model.cfg.vocab_size, cfg.prompt_tokens, i, cfg.seed) for i in range(b)]
            run.cell(name, mode, "decode", b,
                     lambda: timers[mode](model, b, cfg.decode_steps, cfg.warmup, prompts), decode_roof)


def _exact_plan(model) -> str:
    """The plan exact decode used (memra.decode_plan: row | stacked | bucket) — it decides exact speed."""
    from memra.decode_plan import decode_plan

    try:
        return decode_plan(mode_view(model, "exact"))
    except MemraError as e:
        return f"refused ({e})"


def _bench_peer(run: _Run, name: str, model, roofs: dict) -> str:
    """The HF peer's cells for one model. -> how the peer was built (or why it was not)."""
    cfg, device, mcfg = run.cfg, model.device, model.cfg
    hf_cells = [(phase, b) for mode, phase, b in planned_cells(cfg, name) if mode == "hf"]
    if run.over_budget():
        for phase, b in hf_cells:
            run.record(BenchResult(name, cfg.weights, "hf", phase, b, status="skipped",
                                   note=f"time budget of {cfg.budget_s:g} s spent before the peer was built"))
        return "skipped (time budget)"
    try:
        hf, how = hf_peer(model)
    except (MemraError, RuntimeError) as e:
        why = f"no HF peer: {e}"[:300]
        for phase, b in hf_cells:
            run.record(BenchResult(name, cfg.weights, "hf", phase, b, status="skipped", note=why))
        return why
    run.log(f"HF peer for {name}: {how}")
    note = hf_notes(hf, mcfg)
    vocab = mcfg.vocab_size
    fixed = lambda key: (lambda t: roofs[key])
    for b in cfg.batches:
        run.cell(name, "hf", "decode", b,
                 lambda: time_hf_decode(hf, vocab, b, cfg.decode_steps, cfg.warmup, cfg.prompt_tokens, device, cfg.seed),
                 fixed(("decode", b)), note)
    run.cell(name, "hf", "prefill", 1, lambda: time_hf_first_token(hf, vocab, cfg.prefill_chunk, cfg.repeats, device,
                                                                    cfg.seed), fixed(("prefill", 1)), note)
    run.cell(name, "hf", "ttft", 1, lambda: time_hf_first_token(hf, vocab, cfg.ttft_tokens, cfg.repeats, device,
                                                                 cfg.seed + 1), fixed(("ttft", 1)), note)
    return how


# --- the CLI -------------------------------------------------------------------------------------


def _int_list(text: str, what: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise MemraError(f"{what} {text!r} is not a comma-separated list of numbers") from None


def parse_layers(text: str | None, models: Sequence[str]) -> tuple[tuple[str, int], ...]:
    """--layers N (every model) or --layers name=N,name=N."""
    if not text:
        return ()
    try:
        if "=" not in text:
            return tuple((m, int(text)) for m in models)
        pairs = [p.split("=", 1) for p in text.split(",") if p.strip()]
        return tuple((k.strip(), int(v)) for k, v in pairs)
    except ValueError:
        raise MemraError(f"--layers {text!r}: give N, or name=N pairs separated by commas") from None


def add_model_parser(kinds) -> None:
    """`memra bench model` on the `memra bench` subparsers (memra.server.bench wires it)."""
    d = BenchConfig()
    p = kinds.add_parser("model", help="random-weight models of real shapes: decode/prefill tokens/s vs this "
                                       "device's roofline and HF transformers")
    p.add_argument("--models", default=",".join(d.models), help="comma-separated shapes (default: %(default)s)")
    p.add_argument("--batches", default=",".join(map(str, d.batches)), help="decode batch widths (default %(default)s)")
    p.add_argument("--layers", default=None, help="build with fewer layers: N for every model, or name=N,...")
    p.add_argument("--device", default=None, help="cuda (default where available) or cpu")
    p.add_argument("--weights", default=d.weights, help="weight format: bf16 | q8_0 | q4_k (projections packed, fused dequant kernels)")
    p.add_argument("--modes", default=",".join(d.exact_modes),
                   help="exact and/or fast (MEMRA_EXACT=0); engine (the loop memra generate / memra.LLM / the server "
                        "run) and newcache (decode_step_batch over model.new_cache caches), timed beside exact")
    p.add_argument("--steps", type=int, default=d.decode_steps, help="timed decode steps per cell")
    p.add_argument("--warmup", type=int, default=d.warmup, help="untimed decode steps first")
    p.add_argument("--repeats", type=int, default=d.repeats, help="prefill/TTFT/probe repeats (best of)")
    p.add_argument("--prefill-chunk", type=int, default=d.prefill_chunk)
    p.add_argument("--ttft-tokens", type=int, default=d.ttft_tokens)
    p.add_argument("--prompt-tokens", type=int, default=d.prompt_tokens, help="each decode row's primed prompt")
    p.add_argument("--no-hf", action="store_true", help="skip the HF transformers peer")
    p.add_argument("--budget", type=float, default=None, metavar="S",
                   help="start no cell after S seconds; the rest are recorded as skipped")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--json", metavar="PATH", default=None, help="write the report as JSON")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    models = tuple(m.strip() for m in args.models.split(",") if m.strip())
    return BenchConfig(models=models, batches=_int_list(args.batches, "--batches"),
                       layers=parse_layers(args.layers, models), device=args.device or default_device(),
                       weights=args.weights, exact_modes=tuple(m.strip() for m in args.modes.split(",") if m.strip()),
                       decode_steps=args.steps, warmup=args.warmup, repeats=args.repeats,
                       prefill_chunk=args.prefill_chunk, ttft_tokens=args.ttft_tokens,
                       prompt_tokens=args.prompt_tokens, peer_hf=not args.no_hf, budget_s=args.budget,
                       seed=args.seed, json_path=args.json)


def cmd_model(args: argparse.Namespace) -> int:
    """Exit 0 when every cell ran or was skipped for the budget; 1 when any failed."""
    report = run_bench(config_from_args(args), log=lambda line: print(line, file=sys.stderr, flush=True))
    print(report.table())
    return 1 if report.failed else 0
