"""The Hugging Face transformers peer of `memra bench model`: the same model, on the same device, run by
transformers' `generate` — so memra's tokens/s has a second yardstick beside the roofline.

The peer is built on the meta device and given memra's own tensors as its parameters (views: no second
copy in memory), by inverting memra's config and weight layout (hf_config, hf_state_dict). Where that is
impossible it falls back to HF's random init of the same config (same shapes, so the same speed) and
says so. It runs bf16 weights only: transformers has no kernels for memra's packed formats.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from memra.bench.memra_cells import prompt_ids
from memra.bench.roofline import trunk_weights
from memra.bench.timing import Timing, best_seconds, sync
from memra.config import ModelConfig
from memra.errors import MemraError


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


def _hf_generate_seconds(hf, ids: torch.Tensor, new_tokens: int, static: bool = False) -> float:
    sync(ids.device)
    t0 = time.perf_counter()
    cache = {"cache_implementation": "static"} if static else {}
    hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                min_new_tokens=new_tokens, do_sample=False, **cache)
    sync(ids.device)
    return time.perf_counter() - t0


def _hf_ids(vocab: int, batch: int, tokens: int, seed: int, device: torch.device) -> torch.Tensor:
    return torch.tensor([prompt_ids(vocab, tokens, i, seed) for i in range(batch)], device=device)


@torch.inference_mode()
def time_hf_decode(hf, vocab: int, batch: int, steps: int, warmup: int, prompt_tokens: int, device: torch.device,
                   seed: int = 0, static: bool = False) -> Timing:
    """HF decode tokens/s at B: generate(steps + 1 tokens) minus generate(1 token), each the best of three — the
    difference is `steps` decode steps, with the prompt's prefill and the first token taken out."""
    ids = _hf_ids(vocab, batch, prompt_tokens, seed, device)
    if warmup or static:  # the longest call first: a static cache keeps its length (and compiled forward) after it
        _hf_generate_seconds(hf, ids, steps + 1, static)
    # Best of three of each, interleaved: one noisy generate must not decide the difference of two.
    first = total = float("inf")
    for _ in range(3):
        first = min(first, _hf_generate_seconds(hf, ids, 1, static))
        total = min(total, _hf_generate_seconds(hf, ids, steps + 1, static))
    if total <= first:
        raise MemraError(f"HF generate of {steps + 1} tokens took {total:.4f} s, of 1 token {first:.4f} s: "
                         f"timing noise exceeds {steps} decode steps; use more --steps")
    return Timing((total - first) / steps, batch, steps, context=prompt_tokens + steps // 2)


@torch.inference_mode()
def time_hf_first_token(hf, vocab: int, tokens: int, repeats: int, device: torch.device, seed: int = 0,
                        static: bool = False) -> Timing:
    """HF prefill and TTFT: generate(1 token) from a `tokens`-token prompt, best of `repeats` (after an
    untimed call, which is where a static cache's compile happens)."""
    ids = _hf_ids(vocab, 1, tokens, seed, device)
    return Timing(best_seconds(lambda: _hf_generate_seconds(hf, ids, 1, static), device, repeats), tokens, repeats)
