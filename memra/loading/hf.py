"""Hugging Face checkpoint names -> memra's canonical weights (see memra/model/*.py for the layouts).

What changes on the way in:
- zero-centred norms (hybrids) become their effective fp32 multiplier 1 + w, as the reference computes it;
- Qwen3-Next's per-key-head grouped `in_proj_qkvz` / `in_proj_ba` are regrouped into the flat
  [q | k | v | z | b | a] rows that Qwen3.5 stores (value heads keep the grouped order: head g*r + j);
- `A_log` becomes A = -exp(A_log) in fp32, exactly the value the reference computes every step;
- q/k/v, gate/up and expert projections are concatenated so each is one matmul;
- Qwen3.5's VL wrapper prefix `model.language_model.` is accepted, and experts stored per expert or fused.
"""

from __future__ import annotations

import torch

from memra.config import ModelConfig
from memra.errors import CheckpointError
from memra.loading.sources import TensorSource


class HfNames:
    def __init__(self, cfg: ModelConfig, src: TensorSource):
        self.cfg, self.src = cfg, src
        wrapped = any(n.startswith("model.language_model.") for n in src.names())
        self.root = "model.language_model." if wrapped else "model."
        self.pack = False  # set by the loader: keep FP8 / NVFP4 projections packed (memra.loading.fp_source)

    # --- helpers ---
    def get(self, name: str, shape: tuple[int, ...], why: str) -> torch.Tensor:
        return self.src.get(name, shape, why)

    def proj(self, name: str, shape: tuple[int, int], why: str, pack: bool):
        """A linear's weight: packed (memra.kernels.split.Fp8BlockSplit / Nvfp4Split) where `pack` and the
        checkpoint stores it FP8 / NVFP4, else floats."""
        if pack and getattr(self.src, "is_quantized", lambda _: False)(name):
            return self.src.packed(name, shape, why)
        return self.get(name, shape, why)

    def norm(self, name: str, dim: int, why: str) -> torch.Tensor:
        w = self.get(name, (dim,), why).float()
        return 1.0 + w if self.cfg.zero_centered_norm and self.cfg.arch != "gemma4" else w  # Gemma 4: plain w

    # --- the pieces ---
    def globals(self) -> dict[str, torch.Tensor]:
        c = self.cfg
        ve = (c.vocab_size, c.hidden_size)
        out = {
            "embed": self.get(self.root + "embed_tokens.weight", ve, "the token embedding"),
            "final_norm": self.norm(self.root + "norm.weight", c.hidden_size, "the final norm"),
        }
        if self.src.has("lm_head.weight") and not c.tie_embeddings:
            out["lm_head"] = self.get("lm_head.weight", ve, "the LM head")
        if c.ple_dim:  # Gemma 4 E-variants: per-layer embeddings
            lp, why = c.n_layers * c.ple_dim, "the per-layer embeddings"
            out["ple_embed"] = self.get(self.root + "embed_tokens_per_layer.weight", (c.vocab_size, lp), why)
            out["ple_model_proj"] = self.get(self.root + "per_layer_model_projection.weight", (lp, c.hidden_size), why)
            out["ple_proj_norm"] = self.norm(self.root + "per_layer_projection_norm.weight", c.ple_dim, why)
        return out

    def layer(self, i: int) -> dict[str, torch.Tensor]:
        out = self._block(f"{self.root}layers.{i}.", self.cfg.mixers[i], self.cfg.ffns[i], f"layer {i}", self.pack, i)
        if self.cfg.sandwich_norm:
            out.update(self._sandwich(f"{self.root}layers.{i}.", f"layer {i}"))
        return out

    def _sandwich(self, p: str, why: str) -> dict[str, torch.Tensor]:
        return sandwich_weights(self, p, why, HF_SANDWICH)

    def mtp(self, j: int) -> dict[str, torch.Tensor]:
        e = self.cfg.hidden_size
        why = f"MTP block {j}"
        out = {
            "fc": self.get("mtp.fc.weight", (e, 2 * e), why),
            "enorm": self.norm("mtp.pre_fc_norm_embedding.weight", e, why),
            "hnorm": self.norm("mtp.pre_fc_norm_hidden.weight", e, why),
            "norm": self.norm("mtp.norm.weight", e, why),
        }
        ffn = "moe" if self.src.has(f"mtp.layers.{j}.mlp.gate.weight") else "dense"
        for k, v in self._block(f"mtp.layers.{j}.", "attention", ffn, why).items():
            out["block." + k] = v
        return out

    def _block(self, p: str, mixer: str, ffn: str, why: str, pack: bool = False,
               layer: int | None = None) -> dict[str, torch.Tensor]:
        e, c = self.cfg.hidden_size, self.cfg
        out = {
            "attn_norm": self.norm(p + "input_layernorm.weight", e, why),
            # Gemma: the FFN's pre-norm has its own name (post_attention_layernorm norms the mixer's output)
            "ffn_norm": self.norm(p + ("pre_feedforward_layernorm.weight" if c.sandwich_norm
                                       else "post_attention_layernorm.weight"), e, why),
        }
        a = c.attn if layer is None else c.attn_of(layer)
        mix = (self._attention(p + "self_attn.", why, pack, a) if mixer == "attention"
               else self._gdn(p + "linear_attn.", why, pack))
        out.update({("attn." if mixer == "attention" else "gdn.") + k: v for k, v in mix.items()})
        width = c.intermediate_size if layer is None else c.ffn_width(layer)
        if ffn == "moe" and c.arch == "step3p5":
            f = self._step_moe(p, why)
        else:
            f = self._moe(p + "mlp.", why) if ffn == "moe" else self._mlp(p + "mlp.", width, why, pack)
        out.update({("moe." if ffn == "moe" else "mlp.") + k: v for k, v in f.items()})
        return out

    def _attention(self, p: str, why: str, pack: bool = False, a=None) -> dict[str, torch.Tensor]:
        """q | k | v (| Step's head gate) rows as one matrix; no K/V rows where the layer shares an earlier
        layer's KV, no V rows where K is V (Gemma 4). `a`: the layer's geometry (default the model's)."""
        a, e = a or self.cfg.attn, self.cfg.hidden_size
        q_rows = a.n_heads * a.head_dim * (2 if a.output_gate else 1)
        kv_rows = a.n_kv_heads * a.head_dim
        names = ["q"] + ([] if a.kv_from is not None else ["k"] if a.k_eq_v else ["k", "v"])
        rows = {"q": q_rows, "k": kv_rows, "v": kv_rows}
        parts = [self.proj(p + f"{x}_proj.weight", (rows[x], e), why, pack) for x in names]
        if a.head_gate:
            parts.append(self.proj(p + "g_proj.weight", (a.n_heads, e), why, pack))
        out = {"wqkv": cat_rows(parts), "wo": self.proj(p + "o_proj.weight", (e, a.n_heads * a.head_dim), why, pack)}
        if a.qkv_bias:
            out["bqkv"] = torch.cat([self.get(p + f"{x}_proj.bias", (rows[x],), why) for x in names])
        if a.qk_norm:
            out["q_norm"] = self.norm(p + "q_norm.weight", a.head_dim, why)
            if a.kv_from is None:
                out["k_norm"] = self.norm(p + "k_norm.weight", a.head_dim, why)
        if a.v_norm and a.kv_from is None:
            out["v_norm"] = torch.ones(a.head_dim)  # RMS only: the reference's norm has no weight
        return out

    def _gdn(self, p: str, why: str, pack: bool = False) -> dict[str, torch.Tensor]:
        g, e = self.cfg.gdn, self.cfg.hidden_size
        nk, nv, r = g.n_k_heads, g.n_v_heads, g.n_v_heads // g.n_k_heads
        if self.src.has(p + "in_proj_qkvz.weight"):  # Qwen3-Next: rows grouped per key head
            qkvz = self.get(p + "in_proj_qkvz.weight", (2 * g.key_dim + 2 * g.value_dim, e), why)
            q, k, v, z = ungroup_qkvz(qkvz, nk, g.k_head_dim, r * g.v_head_dim)
            ba = self.get(p + "in_proj_ba.weight", (2 * nv, e), why).view(nk, 2 * r, e)
            b, a = ba[:, :r].reshape(nv, e), ba[:, r:].reshape(nv, e)
            qkv = torch.cat((q, k, v))
        else:  # Qwen3.5: already flat
            qkv = self.proj(p + "in_proj_qkv.weight", (g.conv_dim, e), why, pack)
            z = self.proj(p + "in_proj_z.weight", (g.value_dim, e), why, pack)
            b = self.proj(p + "in_proj_b.weight", (nv, e), why, pack)
            a = self.proj(p + "in_proj_a.weight", (nv, e), why, pack)
        return {
            "w_in": cat_rows((qkv, z, b, a)),
            "conv": self.get(p + "conv1d.weight", (g.conv_dim, 1, g.conv_kernel), why)[:, 0, :],
            "a_neg": self._a_neg(p + "A_log", nv, why),
            "dt_bias": self.get(p + "dt_bias", (nv,), why).float(),
            "norm": self.get(p + "norm.weight", (g.v_head_dim,), why).float(),  # gated norm: plain weight
            "wo": self.proj(p + "out_proj.weight", (e, g.value_dim), why, pack),
        }

    def _a_neg(self, name: str, nv: int, why: str) -> torch.Tensor:
        """A = -exp(A_log). A finite A_log above ~88.7 overflows to -inf here, which no stored-value check
        would see, so this conversion checks itself."""
        a_log = self.get(name, (nv,), why).float()
        a_neg = -a_log.exp()
        if torch.isfinite(a_log).all() and not torch.isfinite(a_neg).all():
            raise CheckpointError(
                f"{self.src.file_of(name)}: tensor {name!r} holds values up to {a_log.max().item():g}, whose "
                "-exp() overflows fp32 (real checkpoints keep A_log within a few units): the file is corrupt; "
                "re-download or re-convert it"
            )
        return a_neg

    def _mlp(self, p: str, width: int, why: str, pack: bool = False) -> dict[str, torch.Tensor]:
        e = self.cfg.hidden_size
        gate = self.proj(p + "gate_proj.weight", (width, e), why, pack)
        up = self.proj(p + "up_proj.weight", (width, e), why, pack)
        return {"w_gate_up": cat_rows((gate, up)), "w_down": self.proj(p + "down_proj.weight", (e, width), why, pack)}

    def _moe(self, p: str, why: str) -> dict[str, torch.Tensor]:
        m, e = self.cfg.moe, self.cfg.hidden_size
        f = m.expert_ffn
        out = {"router": self.get(p + "gate.weight", (m.n_experts, e), why)}
        if self.src.has(p + "experts.gate_up_proj"):  # fused 3-D storage
            out["w_gate_up"] = self.get(p + "experts.gate_up_proj", (m.n_experts, 2 * f, e), why)
            out["w_down"] = self.get(p + "experts.down_proj", (m.n_experts, e, f), why)
        else:
            experts = [self._mlp(p + f"experts.{x}.", f, why) for x in range(m.n_experts)]
            out["w_gate_up"] = torch.stack([x["w_gate_up"] for x in experts])
            out["w_down"] = torch.stack([x["w_down"] for x in experts])
        if m.shared_ffn:
            shared = self._mlp(p + "shared_expert.", m.shared_ffn, why)
            out["shared_gate_up"], out["shared_down"] = shared["w_gate_up"], shared["w_down"]
            if m.shared_gate:
                out["shared_gate"] = self.get(p + "shared_expert_gate.weight", (1, e), why)
        return out


    def _step_moe(self, p: str, why: str) -> dict[str, torch.Tensor]:
        """Step's MoE as its checkpoints store it (`moe.gate`, `moe.router_bias`, per-projection expert stacks,
        `share_expert`), or as transformers' modules name it (`mlp.gate`, `mlp.experts.*`, `mlp.shared_experts`)."""
        m, e = self.cfg.moe, self.cfg.hidden_size
        x, f = m.n_experts, m.expert_ffn
        if not self.src.has(p + "moe.gate.weight"):  # transformers' module names
            out = self._moe(p + "mlp.", why)
            out["router_bias"] = self.get(p + "mlp.gate.e_score_correction_bias", (x,), why).float()
            shared = self._mlp(p + "mlp.shared_experts.", m.shared_ffn, why)
        else:
            gate = self.get(p + "moe.gate_proj.weight", (x, f, e), why)
            up = self.get(p + "moe.up_proj.weight", (x, f, e), why)
            out = {"router": self.get(p + "moe.gate.weight", (x, e), why), "w_gate_up": torch.cat((gate, up), dim=1),
                   "w_down": self.get(p + "moe.down_proj.weight", (x, e, f), why),
                   "router_bias": self.get(p + "moe.router_bias", (x,), why).float()}
            shared = self._mlp(p + "share_expert.", m.shared_ffn, why)
        out["shared_gate_up"], out["shared_down"] = shared["w_gate_up"], shared["w_down"]
        return out

# Gemma's per-layer weights besides the block's: canonical name -> the checkpoint's name in a layer
HF_SANDWICH = {"post_attn_norm": "post_attention_layernorm.weight", "post_ffn_norm": "post_feedforward_layernorm.weight",
               "layer_scalar": "layer_scalar", "ple_gate": "per_layer_input_gate.weight",
               "ple_proj": "per_layer_projection.weight", "ple_norm": "post_per_layer_input_norm.weight"}


def sandwich_weights(names, p: str, why: str, spelled: dict[str, str]) -> dict[str, torch.Tensor]:
    """Gemma's norms after each branch, its per-layer scalar and (E-variants) the per-layer input's path,
    through `names` (an HfNames or a GGUF one) with the file's own tensor names."""
    c, e = names.cfg, names.cfg.hidden_size
    out = {k: names.norm(p + spelled[k], e, why) for k in ("post_attn_norm", "post_ffn_norm")}
    if names.src.has(p + spelled["layer_scalar"]):
        out["layer_scalar"] = names.get(p + spelled["layer_scalar"], (1,), why)
    if c.ple_dim:
        out["ple_gate"] = names.get(p + spelled["ple_gate"], (c.ple_dim, e), why)
        out["ple_proj"] = names.get(p + spelled["ple_proj"], (e, c.ple_dim), why)
        out["ple_norm"] = names.norm(p + spelled["ple_norm"], e, why)
    return out


def cat_rows(parts):
    """Row-concatenation of float weights, or of packed FP8 / NVFP4 ones of one kind and width (kept
    packed); a mix decodes the packed parts to fp32, the values an unpacked load reads."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat(parts)
    from memra.kernels.split import fp_cat_rows

    if not any(isinstance(p, torch.Tensor) for p in parts) and (joined := fp_cat_rows(list(parts))) is not None:
        return joined
    return torch.cat([p if isinstance(p, torch.Tensor) else p.dequantize(torch.float32) for p in parts])


def ungroup_qkvz(qkvz: torch.Tensor, nk: int, dk: int, vz_per_group: int):
    """Qwen3-Next's in_proj_qkvz rows are nk groups [q_g (dk) | k_g (dk) | v_g (r*dv) | z_g (r*dv)];
    return flat q [nk*dk, E], k, v [nv*dv, E], z — value head g*r + j stays at row block g*r + j."""
    e = qkvz.shape[-1]
    groups = qkvz.view(nk, 2 * dk + 2 * vz_per_group, e)
    q, k, v, z = groups.split([dk, dk, vz_per_group, vz_per_group], dim=1)
    return (x.reshape(-1, e) for x in (q, k, v, z))
