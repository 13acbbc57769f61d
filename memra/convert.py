"""memra convert: write a model as a GGUF file in llama.cpp's naming and layout.

The inverse of memra/loading/gguf.py: canonical weights -> the tensors llama.cpp's converter would
have written (q/k RoPE row permutation for llama, Qwen3.5's tiled value-head order, qwen3next's
per-key-head ssm_ba groups, norms stored as their effective 1 + w multiplier, A stored as
ssm_a = -exp(A_log)), plus the `{arch}.*` hyper-parameters and the tokenizer as `tokenizer.ggml.*`.
Writing goes through the gguf package's GGUFWriter; quantization through gguf.quants.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from pathlib import Path

import numpy as np
import torch

from memra.config import GGUF_ARCHITECTURES, HYBRID, ModelConfig
from memra.errors import MemraError
from memra.loading.checkpoint import load_weights, progress
from memra.model.hybrid import rope_inv_freq

GGUF_NAME = {v: k for k, v in GGUF_ARCHITECTURES.items()}  # memra arch -> llama.cpp arch
TYPES = ("f32", "f16", "q8_0", "q4_k")


def permute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp's q/k row order for adjacent-pair RoPE (the inverse of unpermute_rope_rows)."""
    rows, e = w.shape
    d = rows // n_heads
    return w.view(n_heads, 2, d // 2, e).transpose(1, 2).reshape(rows, e)


def tile_value_heads(t: torch.Tensor, dim: int, nk: int, r: int) -> torch.Tensor:
    """Qwen3.5 converter's value-head order along `dim`: grouped g*r + j -> tiled j*nk + g."""
    moved = t.movedim(dim, 0)
    blk = moved.shape[0] // (nk * r)
    tiled = moved.reshape(nk, r, blk, *moved.shape[1:]).transpose(0, 1).reshape(moved.shape)
    return tiled.movedim(0, dim)


def gguf_tensors(cfg: ModelConfig, w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Canonical weights -> {GGUF tensor name: tensor in torch (row-major) shape}."""
    out = {"token_embd.weight": w["embed"], "output_norm.weight": w["final_norm"]}
    if "lm_head" in w and not cfg.tie_embeddings:
        out["output.weight"] = w["lm_head"]
    if cfg.rope.scaling in ("llama3", "linear"):
        unscaled = rope_inv_freq(dataclasses.replace(cfg.rope, scaling=None, factor=1.0))
        out["rope_freqs.weight"] = unscaled / rope_inv_freq(cfg.rope)  # llama.cpp divides each frequency by these
    for i in range(cfg.n_layers):
        out.update(_block(cfg, w, f"layers.{i}.", f"blk.{i}.", cfg.mixers[i], cfg.ffns[i]))
    for j in range(cfg.n_mtp):
        p, b = f"mtp.{j}.", f"blk.{cfg.n_layers + j}."
        out[b + "nextn.eh_proj.weight"] = w[p + "fc"]
        out[b + "nextn.enorm.weight"] = w[p + "enorm"]
        out[b + "nextn.hnorm.weight"] = w[p + "hnorm"]
        out[b + "nextn.shared_head_norm.weight"] = w[p + "norm"]
        ffn = "moe" if p + "block.moe.router" in w else "dense"
        out.update(_block(cfg, w, p + "block.", b, "attention", ffn))
    return out


def _block(cfg: ModelConfig, w: dict[str, torch.Tensor], p: str, b: str, mixer: str, ffn: str) -> dict[str, torch.Tensor]:
    hybrid = cfg.arch in HYBRID
    out = {b + "attn_norm.weight": w[p + "attn_norm"],
           b + ("post_attention_norm.weight" if hybrid else "ffn_norm.weight"): w[p + "ffn_norm"]}
    if mixer == "attention":
        a = cfg.attn
        q_rows = a.n_heads * a.head_dim * (2 if a.output_gate else 1)
        kv_rows = a.n_kv_heads * a.head_dim
        q, k, v = w[p + "attn.wqkv"].split([q_rows, kv_rows, kv_rows])
        if cfg.arch == "llama":
            q, k = permute_rope_rows(q, a.n_heads), permute_rope_rows(k, a.n_kv_heads)
        out.update({b + "attn_q.weight": q, b + "attn_k.weight": k, b + "attn_v.weight": v,
                    b + "attn_output.weight": w[p + "attn.wo"]})
        if p + "attn.bqkv" in w:
            bq, bk, bv = w[p + "attn.bqkv"].split([q_rows, kv_rows, kv_rows])
            out.update({b + "attn_q.bias": bq, b + "attn_k.bias": bk, b + "attn_v.bias": bv})
        if p + "attn.q_norm" in w:
            out[b + "attn_q_norm.weight"], out[b + "attn_k_norm.weight"] = w[p + "attn.q_norm"], w[p + "attn.k_norm"]
    else:
        g = cfg.gdn
        nk, nv, r = g.n_k_heads, g.n_v_heads, g.n_v_heads // g.n_k_heads
        qkv, z, beta, alpha = w[p + "gdn.w_in"].split([g.conv_dim, g.value_dim, nv, nv])
        conv, a_neg, dt_bias, wo = w[p + "gdn.conv"], w[p + "gdn.a_neg"], w[p + "gdn.dt_bias"], w[p + "gdn.wo"]
        if cfg.arch == "qwen3_next":  # ssm_ba: per key head g, [b (r rows) | a (r rows)]
            e = beta.shape[-1]
            out[b + "ssm_ba.weight"] = torch.cat((beta.view(nk, r, e), alpha.view(nk, r, e)), dim=1).reshape(2 * nv, e)
        else:
            qk = 2 * g.key_dim
            qkv = torch.cat((qkv[:qk], tile_value_heads(qkv[qk:], 0, nk, r)))
            conv = torch.cat((conv[:qk], tile_value_heads(conv[qk:], 0, nk, r)))
            z, beta, alpha, a_neg, dt_bias = (tile_value_heads(x, 0, nk, r) for x in (z, beta, alpha, a_neg, dt_bias))
            wo = tile_value_heads(wo, 1, nk, r)
            out[b + "ssm_beta.weight"], out[b + "ssm_alpha.weight"] = beta, alpha
        out.update({b + "attn_qkv.weight": qkv, b + "attn_gate.weight": z, b + "ssm_conv1d.weight": conv,
                    b + "ssm_a": a_neg, b + "ssm_dt.bias": dt_bias, b + "ssm_norm.weight": w[p + "gdn.norm"],
                    b + "ssm_out.weight": wo})
    if ffn == "moe":
        f = cfg.moe.expert_ffn
        gate, up = w[p + "moe.w_gate_up"].split([f, f], dim=1)
        out.update({b + "ffn_gate_inp.weight": w[p + "moe.router"], b + "ffn_gate_exps.weight": gate,
                    b + "ffn_up_exps.weight": up, b + "ffn_down_exps.weight": w[p + "moe.w_down"]})
        if p + "moe.shared_gate_up" in w:
            sg, su = w[p + "moe.shared_gate_up"].chunk(2)
            out.update({b + "ffn_gate_shexp.weight": sg, b + "ffn_up_shexp.weight": su,
                        b + "ffn_down_shexp.weight": w[p + "moe.shared_down"]})
        if p + "moe.shared_gate" in w:
            out[b + "ffn_gate_inp_shexp.weight"] = w[p + "moe.shared_gate"]
    else:
        gate, up = w[p + "mlp.w_gate_up"].chunk(2)
        out.update({b + "ffn_gate.weight": gate, b + "ffn_up.weight": up, b + "ffn_down.weight": w[p + "mlp.w_down"]})
    return out


def _metadata(writer, cfg: ModelConfig, arch: str, name: str, file_type: int) -> None:
    a = cfg.attn
    writer.add_name(name)
    writer.add_block_count(cfg.n_layers + cfg.n_mtp)
    writer.add_context_length(cfg.max_position)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(a.n_heads)
    writer.add_head_count_kv(a.n_kv_heads)
    writer.add_key_length(a.head_dim)
    writer.add_value_length(a.head_dim)
    writer.add_rope_freq_base(cfg.rope.theta)
    writer.add_rope_dimension_count(cfg.rope.dim)
    writer.add_layer_norm_rms_eps(cfg.norm_eps)
    writer.add_file_type(file_type)
    if cfg.moe:
        writer.add_expert_count(cfg.moe.n_experts)
        writer.add_expert_used_count(cfg.moe.top_k)
        writer.add_expert_feed_forward_length(cfg.moe.expert_ffn)
        if cfg.moe.shared_ffn:
            writer.add_expert_shared_feed_forward_length(cfg.moe.shared_ffn)
    if cfg.gdn:
        g = cfg.gdn
        writer.add_ssm_conv_kernel(g.conv_kernel)
        writer.add_ssm_state_size(g.k_head_dim)
        writer.add_ssm_group_count(g.n_k_heads)
        writer.add_ssm_time_step_rank(g.n_v_heads)
        writer.add_ssm_inner_size(g.value_dim)
        recurrent = [m == "gdn" for m in cfg.mixers] + [False] * cfg.n_mtp
        writer.add_array(f"{arch}.attention.recurrent_layers", recurrent)
        attn = cfg.attention_layers
        interval = attn[0] + 1 if attn else cfg.n_layers
        writer.add_uint32(f"{arch}.full_attention_interval", interval)
    if cfg.arch in HYBRID and cfg.n_mtp:
        writer.add_uint32(f"{arch}.nextn_predict_layers", cfg.n_mtp)
    if arch in ("qwen35", "qwen35moe"):
        half = cfg.rope.dim // 2  # text-only: any split of the sections is the same rotation
        sections = [half - 2 * (half // 3), half // 3, half // 3, 0]
        writer.add_array(f"{arch}.rope.dimension_sections", sections)


def _tokenizer_metadata(writer, model_dir: Path) -> None:
    """A byte-level BPE tokenizer.json -> tokenizer.ggml.* (llama.cpp's 'gpt2' model)."""
    from memra.loading.gguf_pretokenizers import PRE_TOKENIZER_RULES
    from memra.tokenizer import Tokenizer

    tj = json.loads((model_dir / "tokenizer.json").read_text())
    model = tj.get("model", {})
    if model.get("type") != "BPE":
        raise MemraError(f"{model_dir}: only byte-level BPE tokenizers can be written to GGUF (found {model.get('type')!r})")
    pre = _pre_tokenizer_name(tj.get("pre_tokenizer") or {}, PRE_TOKENIZER_RULES, model_dir)
    vocab: dict[str, int] = dict(model["vocab"])
    specials = {t["content"]: t["id"] for t in tj.get("added_tokens", [])}
    vocab.update(specials)
    n = max(vocab.values()) + 1
    tokens = [f"[PAD{i}]" for i in range(n)]
    types = [gguf_token_type("unused")] * n
    for text, i in vocab.items():
        tokens[i] = text
        types[i] = gguf_token_type("control" if text in specials else "normal")
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    tok = Tokenizer.from_hf_dir(model_dir)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    if tok.eos_ids:
        writer.add_eos_token_id(tok.eos_ids[0])
    if tok.bos_id is not None:
        writer.add_bos_token_id(tok.bos_id)
    writer.add_add_bos_token(bool(tok.add_bos))
    if tok.chat_template:
        writer.add_chat_template(tok.chat_template)


def gguf_token_type(kind: str) -> int:
    import gguf

    return {"normal": gguf.TokenType.NORMAL, "control": gguf.TokenType.CONTROL, "unused": gguf.TokenType.UNUSED}[kind]


def _pre_tokenizer_name(pre: dict, rules, source) -> str:
    """Name the llama.cpp pre-tokenizer whose single regex is the one tokenizer.json splits with."""
    regexes = []

    def walk(node):
        if node.get("type") == "Sequence":
            for child in node.get("pretokenizers", []):
                walk(child)
        elif node.get("type") == "Split":
            regexes.append(node.get("pattern", {}).get("Regex"))

    walk(pre)
    for rule in rules:
        if len(rule.patterns) == 1 and regexes == [rule.patterns[0]]:
            return rule.names[0]
    raise MemraError(f"{source}: tokenizer.json's pre-tokenizer regex matches none llama.cpp knows; cannot name it in GGUF")


def _encode(t: torch.Tensor, qtype: str, name: str):
    """-> (numpy data, raw ggml type or None). 1-D tensors, norms, conv and gate parameters stay f32,
    like llama.cpp's converter; Q8_0 needs rows that are whole 32-value blocks, Q4_K whole 256-value
    super-blocks (else f16). Q4_K is memra.kernels.quant.quantize_q4_k (llama.cpp's search, every
    matrix in Q4_K: what llama.cpp's Q4_K_S does for most of them)."""
    import gguf

    arr = t.detach().float().cpu().numpy()
    small = arr.ndim < 2 or name.endswith(("ssm_conv1d.weight", "norm.weight", "ssm_a"))
    if qtype == "f32" or small:
        return arr.astype(np.float32), None
    if qtype == "q8_0" and arr.shape[-1] % 32 == 0:
        return gguf.quants.quantize(arr, gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0
    if qtype == "q4_k" and arr.ndim == 2 and arr.shape[-1] % 256 == 0:
        from memra.kernels.quant import quantize_q4_k

        return quantize_q4_k(torch.from_numpy(arr)).data.numpy(), gguf.GGMLQuantizationType.Q4_K
    return arr.astype(np.float16), None


def convert(model_path: str | Path, out_path: str | Path, qtype: str = "f16") -> Path:
    """Write the HF model directory `model_path` as a GGUF file at `out_path`.

    The destination is claimed first (a temporary file beside it), so a path that cannot be written
    fails before minutes of converting; the file appears under its name only once complete (rename),
    so a failure midway never leaves a truncated GGUF that looks like a model."""
    import gguf

    if qtype not in TYPES:
        raise MemraError(f"unknown GGUF type {qtype!r}; choose one of {', '.join(TYPES)}")
    src = Path(model_path)
    if not src.is_dir():
        raise MemraError(f"{src}: convert reads a Hugging Face model directory")
    out = Path(out_path)
    partial = _claim(out)
    try:
        cfg, weights, _ = load_weights(src, torch.device("cpu"), torch.float32)
        if cfg.arch not in GGUF_NAME or cfg.windows:  # llama.cpp's llama arch, say, has no sliding window
            raise MemraError(f"{src}: memra convert does not write {cfg.arch}"
                             + (" with a sliding window" if cfg.windows else "")
                             + f"; it writes {', '.join(sorted(GGUF_NAME))} (full attention)")
        arch = GGUF_NAME[cfg.arch]
        writer = gguf.GGUFWriter(str(partial), arch)
        file_type = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                     "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "q4_k": gguf.LlamaFileType.MOSTLY_Q4_K_S}[qtype]
        _metadata(writer, cfg, arch, src.name, int(file_type))
        _tokenizer_metadata(writer, src)
        tensors = gguf_tensors(cfg, weights)
        for name, t in progress(tensors.items(), len(tensors), f"writing {out.name}"):
            data, raw = _encode(t, qtype, name)
            writer.add_tensor(name, data, raw_dtype=raw)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(partial, out)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return out


def _claim(out: Path) -> Path:
    """A fresh temporary file in `out`'s directory (where the final rename happens), or a one-line
    MemraError saying why `out` cannot be written."""
    if out.is_dir():
        raise MemraError(f"{out} is a directory; give the GGUF file's name, e.g. {out / 'model.gguf'}")
    if not out.parent.is_dir():
        raise MemraError(f"{out.parent} does not exist; create it first or write somewhere else")
    try:
        fd, name = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".partial")
    except OSError as e:
        raise MemraError(f"cannot write to {out.parent} ({e.strerror}); choose another destination") from None
    os.close(fd)
    return Path(name)


__all__ = ["convert", "gguf_tensors", "permute_rope_rows", "tile_value_heads"]
