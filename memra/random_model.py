"""Random-weight models of real shapes, built directly on the device (no download, no file).

Used by the GPU gate and benchmarks: the numbers that matter there (bits, bytes moved, tokens/s)
depend on shapes, not on trained values. Weights are scaled so activations stay O(1) through depth.
"""

from __future__ import annotations

import torch

from memra.config import FP32_WEIGHTS, AttentionConfig, GdnConfig, ModelConfig, MoeConfig, RopeConfig
from memra.errors import MemraError


def _hybrid(n_layers, hidden, heads, kv, head_dim, nk, nv, dk, ffn, vocab, moe=None) -> ModelConfig:
    mixers = tuple("attention" if (i + 1) % 4 == 0 else "gdn" for i in range(n_layers))
    return ModelConfig(
        arch="qwen3_5_moe" if moe else "qwen3_5", vocab_size=vocab, hidden_size=hidden, n_layers=n_layers,
        mixers=mixers, ffns=("moe" if moe else "dense",) * n_layers, intermediate_size=ffn,
        attn=AttentionConfig(heads, kv, head_dim, qk_norm=True, output_gate=True),
        rope=RopeConfig(theta=1e7, dim=head_dim // 4), norm_eps=1e-6, zero_centered_norm=True,
        tie_embeddings=False, max_position=262144, gdn=GdnConfig(nk, nv, dk, dk, 4), moe=moe, n_mtp=1)


def _llama(n_layers, hidden, heads, kv, ffn, vocab) -> ModelConfig:
    return ModelConfig(
        arch="llama", vocab_size=vocab, hidden_size=hidden, n_layers=n_layers, mixers=("attention",) * n_layers,
        ffns=("dense",) * n_layers, intermediate_size=ffn, attn=AttentionConfig(heads, kv, hidden // heads),
        rope=RopeConfig(theta=500000.0, dim=hidden // heads), norm_eps=1e-5, zero_centered_norm=False,
        tie_embeddings=False, max_position=131072)


SHAPES = {
    "qwen3.5-9b": lambda layers=None: _hybrid(layers or 32, 4096, 16, 4, 256, 16, 32, 128, 12288, 248320),
    "qwen3.5-35b-a3b": lambda layers=None: _hybrid(layers or 40, 2048, 16, 2, 256, 16, 32, 128, 0, 248320,
                                                   moe=MoeConfig(256, 8, 512, 512, True, True)),
    "llama-3-8b": lambda layers=None: _llama(layers or 32, 4096, 32, 8, 14336, 128256),
}


def canonical_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every canonical weight name and shape (the layouts of memra/model/*.py)."""
    e, a = cfg.hidden_size, cfg.attn
    shapes: dict[str, tuple[int, ...]] = {"embed": (cfg.vocab_size, e), "final_norm": (e,), "lm_head": (cfg.vocab_size, e)}

    def block(p: str, mixer: str, ffn: str) -> None:
        shapes[p + "attn_norm"] = shapes[p + "ffn_norm"] = (e,)
        if mixer == "attention":
            q_rows = a.n_heads * a.head_dim * (2 if a.output_gate else 1)
            shapes[p + "attn.wqkv"] = (q_rows + 2 * a.n_kv_heads * a.head_dim, e)
            shapes[p + "attn.wo"] = (e, a.n_heads * a.head_dim)
            if a.qk_norm:
                shapes[p + "attn.q_norm"] = shapes[p + "attn.k_norm"] = (a.head_dim,)
        else:
            g = cfg.gdn
            shapes[p + "gdn.w_in"] = (g.conv_dim + g.value_dim + 2 * g.n_v_heads, e)
            shapes[p + "gdn.conv"] = (g.conv_dim, g.conv_kernel)
            shapes[p + "gdn.a_neg"] = shapes[p + "gdn.dt_bias"] = (g.n_v_heads,)
            shapes[p + "gdn.norm"] = (g.v_head_dim,)
            shapes[p + "gdn.wo"] = (e, g.value_dim)
        if ffn == "moe":
            m = cfg.moe
            shapes[p + "moe.router"] = (m.n_experts, e)
            shapes[p + "moe.w_gate_up"] = (m.n_experts, 2 * m.expert_ffn, e)
            shapes[p + "moe.w_down"] = (m.n_experts, e, m.expert_ffn)
            if m.shared_ffn:
                shapes[p + "moe.shared_gate_up"] = (2 * m.shared_ffn, e)
                shapes[p + "moe.shared_down"] = (e, m.shared_ffn)
                if m.shared_gate:
                    shapes[p + "moe.shared_gate"] = (1, e)
        else:
            shapes[p + "mlp.w_gate_up"] = (2 * cfg.intermediate_size, e)
            shapes[p + "mlp.w_down"] = (e, cfg.intermediate_size)

    for i in range(cfg.n_layers):
        block(f"layers.{i}.", cfg.mixers[i], cfg.ffns[i])
    for j in range(cfg.n_mtp):
        shapes[f"mtp.{j}.fc"] = (e, 2 * e)
        for n in ("enorm", "hnorm", "norm"):
            shapes[f"mtp.{j}.{n}"] = (e,)
        block(f"mtp.{j}.block.", "attention", "moe" if cfg.moe else "dense")
    return shapes


QUANTIZED_LEAVES = ("wqkv", "wo", "w_in", "w_gate_up", "w_down", "lm_head", "fc", "shared_gate_up", "shared_down")
QUANT_FORMATS = ("q8_0", "q4_k")


def _qtype(name: str):
    import gguf

    return {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_k": gguf.GGMLQuantizationType.Q4_K}[name]


@torch.inference_mode()
def random_weights(cfg: ModelConfig, device: str | torch.device = "cuda", dtype: torch.dtype = torch.bfloat16,
                   seed: int = 0, quant: str | None = None) -> dict[str, torch.Tensor]:
    """Seeded random canonical weights for `cfg` on `device` (see random_model)."""
    if quant is not None and quant not in QUANT_FORMATS:
        raise MemraError(f"unknown weight format {quant!r}; known: {', '.join(QUANT_FORMATS)} (or None for {dtype})")
    from memra.kernels.quant import quantize
    from memra.kernels.split import split_layout
    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(seed)
    weights = {}
    for k, shape in canonical_shapes(cfg).items():
        leaf = k.rsplit(".", 1)[-1]
        if leaf == "a_neg":
            t = -torch.empty(shape, device=dev).uniform_(1, 16, generator=gen)
        elif leaf == "dt_bias" or leaf in FP32_WEIGHTS:
            t = torch.ones(shape, device=dev)  # norm multipliers (1 + 0) and dt_bias
        elif leaf == "conv":
            t = torch.randn(shape, device=dev, generator=gen, dtype=torch.float32).mul_(0.5)
        else:
            fan_in = shape[-1]
            t = torch.randn(shape, device=dev, generator=gen, dtype=torch.float32).mul_(fan_in ** -0.5)
            if leaf in ("wo", "w_down", "shared_down"):
                t.mul_(0.5)
        weights[k] = t.to(torch.float32 if leaf in FP32_WEIGHTS else dtype)
        if quant is not None and leaf in QUANTIZED_LEAVES and t.dim() == 2:
            weights[k] = split_layout(quantize(weights[k], _qtype(quant), dtype))  # as the loader holds it
    return weights


def random_model(name: str, device: str | torch.device = "cuda", dtype: torch.dtype = torch.bfloat16,
                 n_layers: int | None = None, seed: int = 0, quant: str | None = None, settings=None):
    """A HybridModel of a named real shape with seeded random weights, built on `device`.

    quant="q8_0" | "q4_k" keeps every 2-D projection (QUANTIZED_LEAVES) packed in that GGUF format, in
    its split layout (memra.kernels.split), as the loader serves a quantized checkpoint; embeddings,
    norms, the conv, routers and the 3-D MoE expert stacks stay in `dtype`."""
    from memra.model.hybrid import HybridModel

    if name not in SHAPES:
        raise MemraError(f"unknown model shape {name!r}; known: {', '.join(SHAPES)}")
    cfg = SHAPES[name](n_layers)
    weights = random_weights(cfg, device, dtype, seed, quant)
    # the recipe memra.load takes back: with a layer count where it is not the shape's own
    source = f"random:{name}" if n_layers is None else f"random:{name}:{n_layers}"
    return HybridModel(cfg, weights, torch.device(device), dtype, source=source, settings=settings)
