"""Gemma 4 and Step-3.5 GGUF tensor names -> the canonical weights memra.loading.hf gives those models.

What llama.cpp's converter did to them, and what we do about it:
- norms: Gemma 4's are stored as they are (its RMSNorm multiplies by w); Step's have 1 added in fp32,
  which is the effective multiplier memra keeps (memra.loading.gguf), so both are used as stored.
- q/k rows are not permuted (both use NeoX RoPE), and nothing is reordered.
- Gemma 4: K-is-V global layers have no `attn_v`, KV-sharing layers no `attn_k`/`attn_v`; the per-layer
  input path is `inp_gate` / `proj` / `post_norm`; the layer scalar is `layer_output_scale`; the
  `rope_freqs` tensor is read into the config (memra.config.from_gguf_sliding), not used as weights.
- Step: the per-head gate is `attn_gate`; experts are `*_exps` stacks with the router's bias as
  `exp_probs_b.bias`; the shared expert is `*_shexp`.
"""

from __future__ import annotations

import torch

from memra.loading.gguf import GgufNames, cat_rows
from memra.loading.hf import sandwich_weights

# Gemma 4's per-layer weights besides the block's, as llama.cpp names them (memra.loading.hf.HF_SANDWICH's keys)
GGUF_SANDWICH = {"post_attn_norm": "post_attention_norm.weight", "post_ffn_norm": "post_ffw_norm.weight",
                 "layer_scalar": "layer_output_scale.weight", "ple_gate": "inp_gate.weight", "ple_proj": "proj.weight",
                 "ple_norm": "post_norm.weight"}


class SlidingGgufNames(GgufNames):
    def globals(self) -> dict[str, torch.Tensor]:
        c = self.cfg
        ve = (c.vocab_size, c.hidden_size)
        out = {"embed": self.proj("token_embd.weight", ve, "the token embedding"),
               "final_norm": self.norm("output_norm.weight", c.hidden_size, "the final norm")}
        if self.src.has("output.weight"):
            out["lm_head"] = self.proj("output.weight", ve, "the LM head")
        if c.ple_dim:  # Gemma 4 E-variants: per-layer embeddings
            lp, why = c.n_layers * c.ple_dim, "the per-layer embeddings"
            out["ple_embed"] = self.get("per_layer_token_embd.weight", (c.vocab_size, lp), why)
            out["ple_model_proj"] = self.get("per_layer_model_proj.weight", (lp, c.hidden_size), why)
            out["ple_proj_norm"] = self.norm("per_layer_proj_norm.weight", c.ple_dim, why)
        return out

    def layer(self, i: int) -> dict[str, torch.Tensor]:
        c, e = self.cfg, self.cfg.hidden_size
        p, why = f"blk.{i}.", f"layer {i}"
        out = {"attn_norm": self.norm(p + "attn_norm.weight", e, why), "ffn_norm": self.norm(p + "ffn_norm.weight", e, why)}
        out.update({"attn." + k: v for k, v in self._layer_attention(p, why, i).items()})
        if c.ffns[i] == "moe":
            out.update({"moe." + k: v for k, v in self._step_moe(p, why).items()})
        else:
            out.update({"mlp." + k: v for k, v in self._mlp(p, "", c.ffn_width(i), why).items()})
        if c.sandwich_norm:
            out.update(self._sandwich(p, why))
        return out

    def ffn_kind(self, i: int) -> str:
        return self.cfg.ffns[i]  # the config already says (leading dense blocks, then MoE)

    def _layer_attention(self, p: str, why: str, i: int) -> dict[str, torch.Tensor]:
        a, e = self.cfg.attn_of(i), self.cfg.hidden_size
        q_rows, kv_rows = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
        names = ["q"] + ([] if a.kv_from is not None else ["k"] if a.k_eq_v else ["k", "v"])
        parts = [self.proj(p + f"attn_{x}.weight", (q_rows if x == "q" else kv_rows, e), why) for x in names]
        if a.head_gate:
            parts.append(self.proj(p + "attn_gate.weight", (a.n_heads, e), why))
        out = {"wqkv": cat_rows(parts), "wo": self.proj(p + "attn_output.weight", (e, q_rows), why)}
        if a.qk_norm:
            out["q_norm"] = self.norm(p + "attn_q_norm.weight", a.head_dim, why)
            if a.kv_from is None:
                out["k_norm"] = self.norm(p + "attn_k_norm.weight", a.head_dim, why)
        if a.v_norm and a.kv_from is None:
            out["v_norm"] = torch.ones(a.head_dim)  # RMS only: the reference's norm has no weight
        return out

    def _sandwich(self, p: str, why: str) -> dict[str, torch.Tensor]:
        return sandwich_weights(self, p, why, GGUF_SANDWICH)

    def _step_moe(self, p: str, why: str) -> dict[str, torch.Tensor]:
        out = self._moe(p, why)  # router, expert stacks and the shared expert, as for Qwen MoE GGUFs
        out["router_bias"] = self.get(p + "exp_probs_b.bias", (self.cfg.moe.n_experts,), why).float()
        return out
