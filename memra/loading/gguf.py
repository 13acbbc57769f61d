"""GGUF (llama.cpp) tensor names -> memra's canonical weights, undoing the converter's changes.

What llama.cpp's converter did, and what we do about it (docs: QWEN35.md §6):
- norm +1 folding (hybrids): GGUF stores 1 + w in fp32, which *is* our canonical effective
  multiplier (HF side: we add 1 in fp32 the same way), so the folded value is used as stored;
  `ssm_norm` was never folded and is a plain weight on both sides.
- `ssm_a = -exp(A_log)`: our canonical GDN parameter is A = -exp(A_log) itself (that is what every
  step multiplies by), so `ssm_a` is used as stored; going through log() and exp() again would only
  add rounding.
- conv squeeze: `ssm_conv1d` is [conv_dim, Kc], our layout already.
- qwen3next: `attn_qkv`/`attn_gate` are flat with grouped value heads (our order); `ssm_ba` and the
  legacy `ssm_in` are HF's per-key-head groups and are regrouped like HF's in_proj_ba / in_proj_qkvz.
- qwen35/qwen35moe V-head reorder: value heads were moved from grouped (g*r + j) to tiled (j*nk + g)
  order in attn_qkv's V rows, attn_gate, ssm_beta/alpha, ssm_a, ssm_dt, ssm_conv1d's V channels and
  ssm_out's columns; `untile_value_heads` moves them back.
- llama q/k RoPE permutation: rows were interleaved for adjacent-pair RoPE; `unpermute_rope_rows`
  restores HF's half-split (NeoX) order, the one our RoPE uses.
- expert stacking: `*_exps` tensors are [X, ...] stacks already; gate and up are concatenated.
- tied embeddings: no `output.weight` means the LM head is `token_embd`.

Packed (the loader's `packed`: by default Q8_0, Q4_K, Q5_K and Q6_K on CPU): the projections, the
embedding and the LM head that the file stores in a packed format stay GGUF bytes
(memra.kernels.quant.QuantWeight; on CPU split into quants and scales, memra.kernels.split), decoded a
tile at a time inside the linear, so memory tracks the file's size. Every reorder above that moves
whole rows runs on the packed rows (`rows`, `cat_rows`; a fused weight whose parts differ in format is
a quant.MixedRows); one that moves columns (qwen35's ssm_out) decodes that tensor at load.
"""

from __future__ import annotations

import torch

from memra.config import ModelConfig
from memra.kernels.quant import MixedRows, QuantWeight
from memra.loading.hf import ungroup_qkvz
from memra.loading.sources import GgufSource


def rows(w, fn):
    """fn (a move of whole rows of an [N, X] tensor) applied to a float weight or to a packed one's rows."""
    return w.map_rows(fn) if isinstance(w, QuantWeight) else fn(w)


def cat_rows(parts: list) -> torch.Tensor | QuantWeight | MixedRows:
    """Row-concatenation: packed where every part is packed (in one format, or MixedRows over several),
    else floats (fp32 decoding gives the values an unpacked load reads)."""
    packed = [q for p in parts for q in (p.parts if isinstance(p, MixedRows) else (p,))]
    if all(isinstance(p, QuantWeight) for p in packed) and len({p.shape[1] for p in packed}) == 1:
        return QuantWeight.cat_rows(packed) if len({p.qtype for p in packed}) == 1 else MixedRows(tuple(packed))
    return torch.cat([p if isinstance(p, torch.Tensor) else p.dequantize(torch.float32) for p in parts])


def untile_value_heads(t: torch.Tensor, dim: int, nk: int, r: int) -> torch.Tensor:
    """Inverse of the qwen35 converter's reorder along `dim`, which holds nv = nk*r equal blocks:
    block at tiled position j*nk + g goes back to grouped position g*r + j."""
    moved = t.movedim(dim, 0)
    blk = moved.shape[0] // (nk * r)
    rest = moved.shape[1:]
    grouped = moved.reshape(r, nk, blk, *rest).transpose(0, 1).reshape(nk * r * blk, *rest)
    return grouped.movedim(0, dim)


def unpermute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation: per head, rows were ordered (pair, member) -> back to (member, pair)."""
    rows, e = w.shape
    d = rows // n_heads
    return w.view(n_heads, d // 2, 2, e).transpose(1, 2).reshape(rows, e)


class GgufNames:
    def __init__(self, cfg: ModelConfig, src: GgufSource, gguf_arch: str):
        self.cfg, self.src, self.gguf_arch = cfg, src, gguf_arch
        self.tiled_v = gguf_arch in ("qwen35", "qwen35moe")
        self.packed: frozenset = frozenset()  # set by the loader: the formats kept as GGUF bytes (module doc)

    def get(self, name: str, shape: tuple[int, ...], why: str) -> torch.Tensor:
        return self.src.get(name, shape, why)

    def proj(self, name: str, shape: tuple[int, int], why: str) -> torch.Tensor | QuantWeight:
        """A weight read by a linear (or an embedding lookup): packed where this load packs and the file
        stores it in a packed format, else floats."""
        if self.src.has(name) and self.src.qtype(name) in self.packed:
            return self.src.packed(name, shape, why)
        return self.get(name, shape, why)

    def norm(self, name: str, dim: int, why: str) -> torch.Tensor:
        return self.get(name, (dim,), why).float()  # stored as the effective multiplier (see module doc)

    def globals(self) -> dict[str, torch.Tensor]:
        c = self.cfg
        ve = (c.vocab_size, c.hidden_size)
        out = {
            "embed": self.proj("token_embd.weight", ve, "the token embedding"),
            "final_norm": self.norm("output_norm.weight", c.hidden_size, "the final norm"),
        }
        if self.src.has("output.weight"):
            out["lm_head"] = self.proj("output.weight", ve, "the LM head")
        if self.src.has("rope_freqs.weight"):
            out["rope_freqs"] = self.get("rope_freqs.weight", (c.rope.dim // 2,), "RoPE frequency factors").float()
        return out

    def layer(self, i: int) -> dict[str, torch.Tensor]:
        return self._block(f"blk.{i}.", self.cfg.mixers[i], self.cfg.ffns[i], f"layer {i}")

    def mtp(self, j: int) -> dict[str, torch.Tensor]:
        e = self.cfg.hidden_size
        p, why = f"blk.{self.cfg.n_layers + j}.", f"MTP block {j}"
        out = {
            "fc": self.proj(p + "nextn.eh_proj.weight", (e, 2 * e), why),
            "enorm": self.norm(p + "nextn.enorm.weight", e, why),
            "hnorm": self.norm(p + "nextn.hnorm.weight", e, why),
            "norm": self.norm(p + "nextn.shared_head_norm.weight", e, why),
        }
        ffn = "moe" if self.src.has(p + "ffn_gate_inp.weight") else "dense"
        out.update({"block." + k: v for k, v in self._block(p, "attention", ffn, why).items()})
        return out

    def ffn_kind(self, i: int) -> str:
        """qwen3next may keep dense layers among MoE ones; the tensors present decide."""
        return "moe" if self.src.has(f"blk.{i}.ffn_gate_inp.weight") else "dense"

    def _block(self, p: str, mixer: str, ffn: str, why: str) -> dict[str, torch.Tensor]:
        e = self.cfg.hidden_size
        ffn_norm = p + ("post_attention_norm.weight" if self.src.has(p + "post_attention_norm.weight") else "ffn_norm.weight")
        out = {"attn_norm": self.norm(p + "attn_norm.weight", e, why), "ffn_norm": self.norm(ffn_norm, e, why)}
        mix = self._attention(p, why) if mixer == "attention" else self._gdn(p, why)
        out.update({("attn." if mixer == "attention" else "gdn.") + k: v for k, v in mix.items()})
        f = self._moe(p, why) if ffn == "moe" else self._mlp(p, "", self.cfg.intermediate_size, why)
        out.update({("moe." if ffn == "moe" else "mlp.") + k: v for k, v in f.items()})
        return out

    def _attention(self, p: str, why: str) -> dict[str, torch.Tensor]:
        a, e = self.cfg.attn, self.cfg.hidden_size
        q_rows = a.n_heads * a.head_dim * (2 if a.output_gate else 1)
        kv_rows = a.n_kv_heads * a.head_dim
        if self.src.has(p + "attn_qkv.weight"):
            wqkv = self.proj(p + "attn_qkv.weight", (q_rows + 2 * kv_rows, e), why)
            q, k, v = (rows(wqkv, lambda t, a=a, b=b: t[a:b])
                       for a, b in ((0, q_rows), (q_rows, q_rows + kv_rows), (q_rows + kv_rows, q_rows + 2 * kv_rows)))
        else:
            q = self.proj(p + "attn_q.weight", (q_rows, e), why)
            k = self.proj(p + "attn_k.weight", (kv_rows, e), why)
            v = self.proj(p + "attn_v.weight", (kv_rows, e), why)
        if self.gguf_arch == "llama":
            q = rows(q, lambda t: unpermute_rope_rows(t, a.n_heads))
            k = rows(k, lambda t: unpermute_rope_rows(t, a.n_kv_heads))
        out = {"wqkv": cat_rows([q, k, v]),
               "wo": self.proj(p + "attn_output.weight", (e, a.n_heads * a.head_dim), why)}
        if a.qkv_bias:
            out["bqkv"] = torch.cat([self.get(p + f"attn_{x}.bias", (r,), why) for x, r in (("q", q_rows), ("k", kv_rows), ("v", kv_rows))])
        if a.qk_norm:
            out["q_norm"] = self.norm(p + "attn_q_norm.weight", a.head_dim, why)
            out["k_norm"] = self.norm(p + "attn_k_norm.weight", a.head_dim, why)
        return out

    def _gdn(self, p: str, why: str) -> dict[str, torch.Tensor]:
        g, e = self.cfg.gdn, self.cfg.hidden_size
        nk, nv, r = g.n_k_heads, g.n_v_heads, g.n_v_heads // g.n_k_heads
        if self.src.has(p + "ssm_in.weight"):  # legacy qwen3next: HF's grouped in_proj_qkvz verbatim
            qkvz = self.get(p + "ssm_in.weight", (2 * g.key_dim + 2 * g.value_dim, e), why)
            q, k, v, z = ungroup_qkvz(qkvz, nk, g.k_head_dim, r * g.v_head_dim)
            qkv = torch.cat((q, k, v))
        else:
            qkv = self.proj(p + "attn_qkv.weight", (g.conv_dim, e), why)
            z = self.proj(p + "attn_gate.weight", (g.value_dim, e), why)
        ba_name = next((p + n for n in ("ssm_ba.weight", "ssm_beta_alpha.weight") if self.src.has(p + n)), None)
        if ba_name is not None:  # qwen3next: per-key-head groups [b (r) | a (r)]
            ba = self.proj(ba_name, (2 * nv, e), why)
            b = rows(ba, lambda t: t.view(nk, 2 * r, -1)[:, :r].reshape(nv, -1))
            a = rows(ba, lambda t: t.view(nk, 2 * r, -1)[:, r:].reshape(nv, -1))
        else:
            b = self.proj(p + "ssm_beta.weight", (nv, e), why)
            a = self.proj(p + "ssm_alpha.weight", (nv, e), why)
        conv = self.get(p + "ssm_conv1d.weight", (g.conv_dim, g.conv_kernel), why)
        a_neg = self.get(p + "ssm_a", (nv,), why).float()
        dt_bias = self.get(p + "ssm_dt.bias", (nv,), why).float()
        # qwen35 reorders ssm_out's columns: decoded at load (a packed row holds all of a row's columns),
        # unless there is one value head a key head (r = 1: tiled and grouped orders are the same)
        moved = self.tiled_v and r > 1
        wo = (self.get if moved else self.proj)(p + "ssm_out.weight", (e, g.value_dim), why)
        if moved:
            qk_rows = 2 * g.key_dim
            untile = lambda t: untile_value_heads(t, 0, nk, r)  # noqa: E731
            qkv = cat_rows([rows(qkv, lambda t: t[:qk_rows]), rows(qkv, lambda t: untile(t[qk_rows:]))])
            conv = torch.cat((conv[:qk_rows], untile_value_heads(conv[qk_rows:], 0, nk, r)))
            z, b, a = (rows(x, untile) for x in (z, b, a))
            a_neg, dt_bias = untile_value_heads(a_neg, 0, nk, r), untile_value_heads(dt_bias, 0, nk, r)
            wo = untile_value_heads(wo, 1, nk, r)
        return {
            "w_in": cat_rows([qkv, z, b, a]),
            "conv": conv,
            "a_neg": a_neg,
            "dt_bias": dt_bias,
            "norm": self.get(p + "ssm_norm.weight", (g.v_head_dim,), why).float(),
            "wo": wo,
        }

    def _mlp(self, p: str, suffix: str, width: int, why: str) -> dict[str, torch.Tensor]:
        e = self.cfg.hidden_size
        gate = self.proj(p + f"ffn_gate{suffix}.weight", (width, e), why)
        up = self.proj(p + f"ffn_up{suffix}.weight", (width, e), why)
        return {"w_gate_up": cat_rows([gate, up]), "w_down": self.proj(p + f"ffn_down{suffix}.weight", (e, width), why)}

    def _moe(self, p: str, why: str) -> dict[str, torch.Tensor]:
        m, e = self.cfg.moe, self.cfg.hidden_size
        x, f = m.n_experts, m.expert_ffn
        out = {"router": self.get(p + "ffn_gate_inp.weight", (x, e), why)}
        if self.src.has(p + "ffn_gate_up_exps.weight"):
            out["w_gate_up"] = self.get(p + "ffn_gate_up_exps.weight", (x, 2 * f, e), why)
        else:
            gate = self.get(p + "ffn_gate_exps.weight", (x, f, e), why)
            up = self.get(p + "ffn_up_exps.weight", (x, f, e), why)
            out["w_gate_up"] = torch.cat((gate, up), dim=1)
        out["w_down"] = self.get(p + "ffn_down_exps.weight", (x, e, f), why)
        if m.shared_ffn:
            shared = self._mlp(p, "_shexp", m.shared_ffn, why)
            out["shared_gate_up"], out["shared_down"] = shared["w_gate_up"], shared["w_down"]
            if m.shared_gate:
                out["shared_gate"] = self.get(p + "ffn_gate_inp_shexp.weight", (1, e), why)
        return out
