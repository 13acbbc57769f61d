"""No model file can crash the loader: every corruption of a GGUF file, a safetensors file or a config.json
ends in a one-line MemraError that names the file (and the field or tensor), never another exception type.

Each case corrupts a copy, in tmp_path, of a real fixture (tests/fixtures/gguf, tests/fixtures/hf, the bundled
demo); the fixtures themselves are never written. A seeded byte-flip fuzz over a GGUF header and over a
safetensors header closes the list: it may only end in a MemraError or in a model that loads.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import memra
from conftest import HF_ARCHS, gguf_file, hf_dir
from gguf_edit import layout, patched, rewrite_gguf, with_raw_kv
from memra.errors import CheckpointError, ConfigError, MemraError, TokenizerError

Q8 = gguf_file("llama-q8_0")  # Q8_0 matrices, F32 norms (output_norm.weight is the last tensor), a vocabulary
HYBRID_Q8 = gguf_file("qwen3_5-q8_0")
F16 = gguf_file("llama-f16")
GT, QT = gguf.GGUFValueType, gguf.GGMLQuantizationType
NAN_F16, INF_F16 = 0x7E00, 0x7C00


def fails(path, *needles, file: str | None = None, error: type = MemraError, **load_kw) -> str:
    """memra.load(path) must raise `error` (a MemraError) whose message is one line naming the file and each needle."""
    load_kw.setdefault("tokenizer", False)
    with pytest.raises(error) as info:
        memra.load(path, **load_kw)
    msg = str(info.value)
    assert "\n" not in msg, msg
    assert (file or Path(path).name) in msg, msg
    for needle in needles:
        assert str(needle) in msg, f"{needle!r} not in {msg!r}"
    return msg


def value_at(path: Path, key: str) -> int:
    return layout(path).kv[key][1]


def tensor(path: Path, name: str):
    return layout(path).tensors[name]


# --- positive controls ------------------------------------------------------------------------------


def test_untouched_fixtures_still_load(tmp_path):
    for path in sorted(Q8.parent.glob("*.gguf")):
        memra.load(path, tokenizer=False, check_tensors=True)
    for arch in HF_ARCHS:
        memra.load(hf_dir(arch), tokenizer=False, check_tensors=True)
    assert memra.load("demo", check_tensors=True).tokenizer is not None
    from memra.convert import convert

    demo_gguf = convert(Path(memra.__file__).parent / "assets" / "demo", tmp_path / "demo-q8_0.gguf", "q8_0")
    assert memra.load(demo_gguf, check_tensors=True).tokenizer is not None
    # general.alignment is honoured: the same tensors, laid out on 64-byte boundaries, load to the same weights
    from memra.loading.checkpoint import load_weights

    out = rewrite_gguf(Q8, tmp_path / "aligned64.gguf", alignment=64)
    cpu = torch.device("cpu")
    a, b = load_weights(Q8, cpu, torch.float32)[1], load_weights(out, cpu, torch.float32)[1]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# --- GGUF: the header --------------------------------------------------------------------------------


def header_cuts(path: Path) -> list[int]:
    """Every boundary of the header (and one byte inside each field), the start of the data, mid data."""
    lay = layout(path)
    cuts = {0, 2, 4, 6, 8, 16, 24, lay.data_start, lay.data_start + 1, (lay.data_start + lay.size) // 2, lay.size - 1}
    for start, val, end in lay.kv.values():
        cuts |= {start + 4, start + 8, val - 2, val, end - 1, end}
    for t in lay.tensors.values():
        cuts |= {t.n_dims_at, t.dims_at, t.dims_at + 4, t.type_at, t.offset_at, t.offset_at + 4, t.end}
    return sorted(cuts)


def test_gguf_truncated_at_every_header_boundary(tmp_path):
    data = Q8.read_bytes()
    for cut in header_cuts(Q8):
        out = tmp_path / f"cut{cut}.gguf"
        out.write_bytes(data[:cut])
        fails(out, error=CheckpointError)


def test_gguf_truncated_metadata_fails_the_tokenizer_reader_clearly(tmp_path):
    from memra.tokenizer.gguf_vocab import read_tokenizer_metadata_file

    data, lay = Q8.read_bytes(), layout(Q8)
    for cut in sorted({c for s, v, e in lay.kv.values() for c in (s + 4, v, e - 1)}):
        out = tmp_path / f"cut{cut}.gguf"
        out.write_bytes(data[:cut])
        with pytest.raises(TokenizerError, match=out.name) as info:
            read_tokenizer_metadata_file(out)
        assert "\n" not in str(info.value)


def _gguf_header_cases() -> dict[str, tuple[list, str | None]]:
    """case -> (edits, what the message must name); None where the edit makes the rest of the header misparse."""
    lay, t_q, t_last = layout(Q8), tensor(Q8, "blk.0.attn_q.weight"), tensor(Q8, "output_norm.weight")
    t_norm, t_k = tensor(Q8, "blk.0.attn_norm.weight"), tensor(Q8, "blk.0.attn_k.weight")
    tokens, types, name = lay.kv["tokenizer.ggml.tokens"], lay.kv["tokenizer.ggml.token_type"], lay.kv["general.name"]
    big, q = 1 << 60, "blk.0.attn_q.weight"
    cases = {
        "version 1": ([(4, "I", 1)], "version 1"), "version 4": ([(4, "I", 4)], "version 4"),
        "version 0xffff": ([(4, "I", 0xFFFF)], "version 65535"),
        "no tensors": ([(8, "Q", 0)], "it lists none"), "one tensor more": ([(8, "Q", len(lay.tensors) + 1)], None),
        "2^60 tensors": ([(8, "Q", big)], "tensor count"), "no keys": ([(16, "Q", 0)], None),
        "one key less": ([(16, "Q", len(lay.kv) - 1)], None), "2^60 keys": ([(16, "Q", big)], "key/value count"),
        "key length 2^60": ([(name[0], "Q", big)], "metadata pair 2"),
        "value string length 2^60": ([(name[1], "Q", big)], "general.name"),
        "value type 13": ([(name[1] - 4, "I", 13)], "general.name"),
        "value type 2^31": ([(name[1] - 4, "I", 1 << 31)], "general.name"),
        "array item type 13": ([(tokens[1], "I", 13)], "tokenizer.ggml.tokens"),
        "array count 2^60": ([(tokens[1] + 4, "Q", big)], "tokenizer.ggml.tokens"),
        "number array count 2^60": ([(types[1] + 4, "Q", big)], "tokenizer.ggml.token_type"),
        "array count +1000": ([(types[1] + 4, "Q", 2024)], None),
        "string not UTF-8": ([(name[1] + 8, "B", 0xFF)], "general.name"),
        "key not UTF-8": ([(name[0] + 8, "B", 0xC3)], "UTF-8"),
        "duplicate key": ([(lay.kv["general.type"][0] + 8 + 8, "4s", b"name")], "'general.name' appears twice"),
        "tensor name length 2^60": ([(t_q.start, "Q", big)], "name of tensor"),
        "tensor name not UTF-8": ([(t_q.start + 8, "B", 0xFF)], "UTF-8"),
        "duplicate tensor name": ([(t_k.start + 8 + len("blk.0.attn_"), "c", b"q")], f"'{q}' appears twice"),
        "n_dims 0": ([(t_q.n_dims_at, "I", 0)], q), "n_dims 5": ([(t_q.n_dims_at, "I", 5)], q),
        "n_dims 2^31": ([(t_q.n_dims_at, "I", 1 << 31)], q),
        "dim 0 zero": ([(t_q.dims_at, "Q", 0)], q), "dim 1 zero": ([(t_q.dims_at + 8, "Q", 0)], q),
        "dim 2^63": ([(t_q.dims_at + 8, "Q", 1 << 63)], q),
        "dims overflow": ([(t_q.dims_at, "Q", 1 << 40), (t_q.dims_at + 8, "Q", 1 << 40)], q),
        "offset +1": ([(t_q.offset_at, "Q", t_q.data_at - lay.data_start + 1)], q),
        "offset -1": ([(t_q.offset_at, "Q", t_q.data_at - lay.data_start - 1)], q),
        "first offset +32": ([(tensor(Q8, "output.weight").offset_at, "Q", 32)], "output.weight"),
        "last offset +32": ([(t_last.offset_at, "Q", t_last.data_at - lay.data_start + 32)], "output_norm.weight"),
        "offset 2^63": ([(t_q.offset_at, "Q", 1 << 63)], q),
    }
    for qtype in ("F32", "F16", "BF16", "Q4_0", "Q5_1", "Q4_K", "Q6_K", "I8"):
        cases[f"attn_q type {qtype}"] = ([(t_q.type_at, "I", QT[qtype])], q)
        if qtype != "F32":  # it is F32
            cases[f"last norm type {qtype}"] = ([(t_last.type_at, "I", QT[qtype])], "output_norm.weight")
    cases["middle norm type F16"] = ([(t_norm.type_at, "I", QT.F16)], "blk.0.attn_norm.weight")
    for bad in (4, 5, 31, 1000, 1 << 31):
        cases[f"type id {bad}"] = ([(t_q.type_at, "I", bad)], f"type id {bad}")
    return cases


GGUF_HEADER_CASES = _gguf_header_cases()


@pytest.mark.parametrize("case", list(GGUF_HEADER_CASES))
def test_gguf_header_corruption(case, tmp_path):
    edits, needle = GGUF_HEADER_CASES[case]
    fails(patched(Q8, tmp_path / "bad.gguf", *edits), *([needle] if needle else []), error=CheckpointError)


@pytest.mark.parametrize("key, fmt, value", [
    ("llama.attention.head_count", "I", 0), ("llama.attention.head_count_kv", "I", 0),
    ("llama.attention.head_count_kv", "I", 3), ("llama.block_count", "I", 0), ("llama.block_count", "I", 0xFFFFFFFF),
    ("llama.embedding_length", "I", 0), ("llama.attention.key_length", "I", 0), ("llama.context_length", "I", 0),
    ("llama.context_length", "I", 0xFFFFFFFF), ("llama.vocab_size", "I", 0), ("llama.feed_forward_length", "I", 0),
    ("llama.rope.dimension_count", "I", 0), ("llama.rope.dimension_count", "I", 3),
    ("llama.rope.dimension_count", "I", 1000),
    ("llama.attention.layer_norm_rms_epsilon", "f", math.nan),
    ("llama.attention.layer_norm_rms_epsilon", "f", math.inf),
    ("llama.attention.layer_norm_rms_epsilon", "f", 0.0), ("llama.attention.layer_norm_rms_epsilon", "f", -1e-6),
    ("llama.attention.layer_norm_rms_epsilon", "f", 2.0), ("llama.rope.freq_base", "f", math.nan),
    ("llama.rope.freq_base", "f", 0.0), ("llama.rope.freq_base", "f", -1.0), ("llama.rope.freq_base", "f", math.inf),
])
def test_gguf_bad_config_value_is_named(key, fmt, value, tmp_path):
    out = patched(Q8, tmp_path / "bad.gguf", (value_at(Q8, key), fmt, value))
    fails(out, key, error=ConfigError)


@pytest.mark.parametrize("key, value", [
    ("ssm.group_count", 0), ("ssm.group_count", 3), ("ssm.time_step_rank", 0), ("ssm.state_size", 0),
    ("ssm.inner_size", 0), ("ssm.inner_size", 63), ("ssm.conv_kernel", 0), ("nextn_predict_layers", 7),
    ("nextn_predict_layers", 100),
])
def test_gguf_bad_hybrid_geometry_is_named(key, value, tmp_path):
    out = patched(HYBRID_Q8, tmp_path / "bad.gguf", (value_at(HYBRID_Q8, "qwen35." + key), "I", value))
    fails(out, "qwen35.", error=ConfigError)


def test_gguf_value_of_the_wrong_type_is_named(tmp_path):
    at = value_at(Q8, "llama.block_count")
    fails(patched(Q8, tmp_path / "f.gguf", (at - 4, "I", GT.FLOAT32)), "llama.block_count", error=ConfigError)
    fails(patched(Q8, tmp_path / "b.gguf", (at - 4, "I", GT.BOOL)), error=MemraError)
    out = rewrite_gguf(Q8, tmp_path / "l.gguf", meta={"llama.attention.head_count": ([4, 4, 5], GT.ARRAY)})
    fails(out, "llama.attention.head_count", error=ConfigError)
    out = rewrite_gguf(Q8, tmp_path / "s.gguf", meta={"llama.rope.freq_base": ("big", GT.STRING)})
    fails(out, "llama.rope.freq_base", error=ConfigError)


@pytest.mark.parametrize("alignment", [0, 7, 48, 1 << 31])
def test_gguf_bad_alignment(alignment, tmp_path):
    out = with_raw_kv(Q8, tmp_path / "a.gguf", "general.alignment", GT.UINT32, struct.pack("<I", alignment))
    fails(out, "general.alignment", alignment, error=CheckpointError)


def test_gguf_deeply_nested_array(tmp_path):
    from memra.tokenizer.gguf_vocab import read_tokenizer_metadata_file

    nested = struct.pack("<IQ", GT.ARRAY, 1) * 20000 + struct.pack("<IQ", GT.UINT8, 0)
    out = with_raw_kv(Q8, tmp_path / "n.gguf", "general.nested", GT.ARRAY, nested)
    fails(out, "general.nested", "nested", error=CheckpointError)
    with pytest.raises(TokenizerError, match="general.nested"):
        read_tokenizer_metadata_file(out)
    shallow = struct.pack("<IQ", GT.ARRAY, 1) * 3 + struct.pack("<IQ", GT.UINT8, 1) + b"\x07"
    memra.load(with_raw_kv(Q8, tmp_path / "ok.gguf", "general.nested", GT.ARRAY, shallow), tokenizer=False)


TOKENIZER_CASES = {
    "tokens are numbers": {"tokenizer.ggml.tokens": ([1, 2, 3], GT.ARRAY)},
    "token types are strings": {"tokenizer.ggml.token_type": (["x"] * 1024, GT.ARRAY)},
    "merges name unknown tokens": {"tokenizer.ggml.merges": (["zz qq", "q z"], GT.ARRAY)},
    "merge without a space": {"tokenizer.ggml.merges": (["zz"], GT.ARRAY)},
    "pre is an array": {"tokenizer.ggml.pre": ([1, 2], GT.ARRAY)},
    "unknown model": {"tokenizer.ggml.model": ("bert", GT.STRING)},
    "bos out of range": {"tokenizer.ggml.bos_token_id": (1 << 30, GT.UINT32),
                         "tokenizer.ggml.add_bos_token": (True, GT.BOOL)},
    "NaN scores": {"tokenizer.ggml.model": ("llama", GT.STRING),
                   "tokenizer.ggml.scores": ([math.nan] * 1024, GT.ARRAY)},
}


@pytest.mark.parametrize("case", list(TOKENIZER_CASES))
def test_gguf_bad_tokenizer_metadata(case, tmp_path):
    out = rewrite_gguf(Q8, tmp_path / "tok.gguf", meta=TOKENIZER_CASES[case])
    fails(out, "tokenizer.", error=TokenizerError, tokenizer=True)
    memra.load(out, tokenizer=False)  # the weights alone still load


# --- GGUF: the tensor data ---------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [NAN_F16, INF_F16, 0xFC00, 0xFFFF])
def test_gguf_non_finite_q8_0_scale_fails_the_default_load(bits, tmp_path):
    t = tensor(Q8, "blk.1.ffn_down.weight")
    assert t.type_id == QT.Q8_0
    out = patched(Q8, tmp_path / "s.gguf", (t.data_at + 5 * 34, "H", bits))
    msg = fails(out, "blk.1.ffn_down.weight", "block 5", error=CheckpointError)
    assert "check-tensors" in msg


def test_scale_field_table_matches_the_decoders():
    """dequant.SCALE_FIELDS must list every fp16 field that scales a block: a non-finite value in any listed
    field makes the block decode to non-finite values; random bytes elsewhere never do."""
    from memra.loading import dequant

    rng = np.random.default_rng(0)
    scaled = {QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K}
    assert scaled <= set(dequant.SCALE_FIELDS)
    for qtype, fields in dequant.SCALE_FIELDS.items():
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, (512, size), dtype=np.uint8)
        for at in fields:
            raw[:, at:at + 2] = np.frombuffer(np.float16(0.5).tobytes(), np.uint8)
        decode = lambda r: dequant.dequantize(torch.from_numpy(r.copy()), qtype, (r.shape[0] * block,))
        assert decode(raw).isfinite().all(), qtype.name
        assert dequant.first_bad_scale(torch.from_numpy(raw), qtype) is None
        for at in fields:
            bad = raw.copy()
            bad[7, at:at + 2] = np.frombuffer(struct.pack("<H", NAN_F16), np.uint8)
            assert not decode(bad).view(-1, block)[7].isfinite().all(), (qtype.name, at)
            assert dequant.first_bad_scale(torch.from_numpy(bad), qtype) == 7, (qtype.name, at)


def test_gguf_non_finite_norm_fails_the_default_load(tmp_path):
    t = tensor(Q8, "blk.0.attn_norm.weight")
    out = patched(Q8, tmp_path / "n.gguf", (t.data_at + 12, "f", math.nan))
    assert "check-tensors" in fails(out, "blk.0.attn_norm.weight", error=CheckpointError)
    norm = np.ones(64, np.float16)
    norm[9] = np.inf
    out = rewrite_gguf(Q8, tmp_path / "f16.gguf", tensors={"output_norm.weight": norm})
    fails(out, "output_norm.weight", error=CheckpointError)


def test_gguf_non_finite_big_weight_needs_the_full_scan(tmp_path):
    t = tensor(F16, "blk.0.ffn_up.weight")
    assert t.type_id == QT.F16
    out = patched(F16, tmp_path / "w.gguf", *[(t.data_at + 2 * i, "H", NAN_F16) for i in (3, 500, 4000)])
    memra.load(out, tokenizer=False)  # the default checks read norms and scales only
    fails(out, "blk.0.ffn_up.weight", "3 non-finite", error=CheckpointError, check_tensors=True)


# --- Hugging Face directories ------------------------------------------------------------------------


def hf_copy(arch: str, tmp_path: Path) -> Path:
    d = tmp_path / arch
    shutil.copytree(hf_dir(arch), d, ignore=shutil.ignore_patterns("reference.safetensors"))
    return d


def set_field(raw: dict, key: str, value) -> None:
    *path, last = key.split(".")
    for k in path:
        raw = raw[k]
    raw[last] = value


HF_CONFIG_CASES = [
    ("llama", "num_attention_heads", v) for v in (0, -4, "4", True, 4.5, [4], {"n": 4}, 1 << 40)
] + [("llama", k, v) for k, v in (
    ("num_key_value_heads", 0), ("num_key_value_heads", 3), ("head_dim", 0), ("hidden_size", 0),
    ("hidden_size", "64"), ("num_hidden_layers", 0), ("num_hidden_layers", 1 << 40), ("num_hidden_layers", True),
    ("vocab_size", 0), ("vocab_size", 1 << 40), ("intermediate_size", 0), ("max_position_embeddings", 0),
    ("max_position_embeddings", 10**12), ("rms_norm_eps", math.nan), ("rms_norm_eps", math.inf), ("rms_norm_eps", 0),
    ("rms_norm_eps", -1e-6), ("rms_norm_eps", 1.5), ("rms_norm_eps", "1e-6"), ("rope_parameters.rope_theta", 0),
    ("rope_parameters.rope_theta", math.nan), ("rope_parameters.rope_theta", -1.0),
    ("rope_parameters.rope_theta", 1e300),
    ("rope_parameters.rope_type", 5), ("rope_parameters.rope_type", ["llama3"]), ("rope_parameters", [1]),
    ("rope_parameters", "x"), ("model_type", ["llama"]), ("model_type", 5), ("tie_word_embeddings", "yes"),
    ("attention_bias", "no"), ("eos_token_id", "x"),
)] + [("llama_tied", k, v) for k, v in (
    ("rope_parameters.factor", 0), ("rope_parameters.factor", math.nan), ("rope_parameters.low_freq_factor", 4.0),
    ("rope_parameters.high_freq_factor", 0.5), ("rope_parameters.original_max_position_embeddings", 0),
)] + [("qwen3_5", k, v) for k, v in (
    ("rope_parameters.partial_rotary_factor", 0), ("rope_parameters.partial_rotary_factor", 1.5),
    ("rope_parameters.partial_rotary_factor", math.nan), ("layer_types", "full_attention"),
    ("layer_types", [1, 2, 3, 4, 5, 6]), ("layer_types", ["linear_attention"] * 5), ("layer_types", [["x"]] * 6),
    ("linear_num_key_heads", 0), ("linear_num_value_heads", 0), ("linear_num_key_heads", 3),
    ("linear_conv_kernel_dim", 0), ("linear_key_head_dim", 0), ("mtp_num_hidden_layers", -1),
)] + [("qwen3_moe", k, v) for k, v in (
    ("num_experts_per_tok", 0), ("num_experts_per_tok", 100), ("moe_intermediate_size", 0), ("num_local_experts", -1),
    ("mlp_only_layers", "x"), ("mlp_only_layers", ["a"]), ("mlp_only_layers", [99]), ("decoder_sparse_step", 0),
)]


@pytest.mark.parametrize("arch, key, value", HF_CONFIG_CASES,
                         ids=[f"{a}-{k}={v!r}"[:60] for a, k, v in HF_CONFIG_CASES])
def test_hf_bad_config_field_is_named(arch, key, value, tmp_path):
    d = hf_copy(arch, tmp_path)
    raw = json.loads((d / "config.json").read_text())
    set_field(raw, key, value)
    (d / "config.json").write_text(json.dumps(raw))
    fails(d, key.split(".")[-1], file="config.json", error=ConfigError)


def test_hf_nested_objects_must_be_objects(tmp_path):
    d = hf_copy("qwen3_5", tmp_path)
    text = json.loads((d / "config.json").read_text())
    for bad in ([text], "qwen", 5):
        (d / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "text_config": bad}))
        fails(d, "text_config", file="config.json", error=ConfigError)
    (d / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "text_config": text}))
    memra.load(d, tokenizer=False)  # the wrapped form itself is fine


CONFIG_JSON_CASES = {
    "list": b"[1, 2]", "null": b"null", "string": b'"llama"', "number": b"42", "empty": b"",
    "binary": b"\x00\xff\xfe garbage \x9c", "utf-16": "{}".encode("utf-16"), "nested 100000 deep": b"[" * 100000,
    "5000-digit integer": b'{"hidden_size": ' + b"1" * 5000 + b"}", "truncated": b'{"model_type": "llama", ',
}


@pytest.mark.parametrize("content", CONFIG_JSON_CASES.values(), ids=CONFIG_JSON_CASES.keys())
def test_hf_config_json_not_an_object(content, tmp_path):
    d = hf_copy("llama", tmp_path)
    (d / "config.json").write_bytes(content)
    fails(d, file="config.json", error=ConfigError)


def test_hf_config_json_truncated_anywhere(tmp_path):
    d = hf_copy("qwen3_5", tmp_path)
    data = (d / "config.json").read_bytes()
    for cut in range(0, len(data) - 2, 7):
        (d / "config.json").write_bytes(data[:cut])
        fails(d, file="config.json", error=ConfigError)


def test_hf_config_json_unreadable(tmp_path):
    d = hf_copy("llama", tmp_path)
    (d / "config.json").unlink()
    (d / "config.json").mkdir()
    fails(d, file="config.json", error=MemraError)


def safetensors_header_end(path: Path) -> int:
    return 8 + struct.unpack("<Q", path.read_bytes()[:8])[0]


def test_safetensors_truncated_or_garbage_header(tmp_path):
    d = hf_copy("llama", tmp_path)
    st = d / "model.safetensors"
    data, end = st.read_bytes(), safetensors_header_end(hf_dir("llama") / "model.safetensors")
    header = json.loads(data[8:end])
    name = "model.layers.0.self_attn.q_proj.weight"
    variants = [data[:n] for n in (0, 4, 8, 9, end // 2, end, end + 100, len(data) // 2)]
    variants += [struct.pack("<Q", 1 << 60) + data[8:], struct.pack("<Q", end) + data[8:], b"\xff" * 64]
    variants += [data[:8] + data[8:end].replace(b"{", b"[", 1) + data[end:]]
    for field, value in (("dtype", "I32"), ("dtype", "F8_E4M3"), ("dtype", "ZZ"), ("shape", [128, 64]),
                         ("data_offsets", [0, 1 << 50]), ("data_offsets", [8, 0])):
        h = json.loads(json.dumps(header))
        h[name][field] = value
        raw = json.dumps(h).encode()
        variants.append(struct.pack("<Q", len(raw)) + raw + data[end:])
    for content in variants:
        st.write_bytes(content)
        fails(d, file="model.safetensors", error=CheckpointError)


def test_safetensors_index_json_garbage(tmp_path):
    d = hf_copy("llama", tmp_path)
    index = d / "model.safetensors.index.json"
    for content in (b"[1]", b"\xff\xfe\x00", b'{"weight_map": [1]}', b'{"weight_map": {"a": 5}}',
                    b'{"weight_map": {"model.norm.weight": "../llama/model.safetensors"}}', b"{" * 50000):
        index.write_bytes(content)
        fails(d, file="model.safetensors.index.json", error=CheckpointError)


def bf16_copy(tmp_path: Path, edit) -> Path:
    d = hf_copy("llama", tmp_path)
    tensors = {k: v.to(torch.bfloat16) for k, v in load_file(str(d / "model.safetensors")).items()}
    edit(tensors)
    save_file(tensors, str(d / "model.safetensors"))
    return d


def test_hf_non_finite_bf16_weight_needs_the_full_scan(tmp_path):
    name = "model.layers.1.self_attn.q_proj.weight"
    d = bf16_copy(tmp_path, lambda t: t[name].view(-1).index_fill_(0, torch.tensor([5, 77, 900, 2000]), math.nan))
    memra.load(d, tokenizer=False)  # the default checks read norms only
    fails(d, name, "4 non-finite", "model.safetensors", error=CheckpointError, check_tensors=True)


def test_hf_weight_that_overflows_the_model_dtype(tmp_path):
    name = "model.layers.0.mlp.down_proj.weight"
    d = bf16_copy(tmp_path, lambda t: t[name].view(-1)[11].fill_(1e30))
    memra.load(d, tokenizer=False, dtype="float16")
    fails(d, name, "float16", error=CheckpointError, check_tensors=True, dtype="float16")


def test_hf_non_finite_norm_and_gate_fail_the_default_load(tmp_path):
    name = "model.layers.2.post_attention_layernorm.weight"
    msg = fails(bf16_copy(tmp_path, lambda t: t[name].view(-1)[0].fill_(math.inf)), name, error=CheckpointError)
    assert "check-tensors" in msg
    d = hf_copy("qwen3_5", tmp_path)
    tensors = load_file(str(d / "model.safetensors"))
    tensors["model.layers.0.linear_attn.A_log"][1] = 100.0  # finite, but -exp(100) overflows fp32
    save_file(tensors, str(d / "model.safetensors"))
    fails(d, "model.layers.0.linear_attn.A_log", error=CheckpointError)


# --- fuzz --------------------------------------------------------------------------------------------


def mutations(rng: random.Random, region: int, n: int):
    for _ in range(n):
        edits = []
        for _ in range(rng.choice((1, 1, 2, 4))):
            at = rng.randrange(region)
            edits.append((at, rng.choice((rng.randrange(256), 0, 0xFF, None))))  # None: flip one bit
        yield edits


def apply(data: bytes, edits) -> bytes:
    out = bytearray(data)
    for at, value in edits:
        out[at] = out[at] ^ (1 << (at % 8)) if value is None else value
    return bytes(out)


def test_fuzz_gguf_header(tmp_path):
    """200 seeded mutations of the header of a GGUF file (tokenizer metadata included): each load ends in
    a one-line MemraError naming the file, or in a model."""
    data, region, rng = Q8.read_bytes(), layout(Q8).data_start, random.Random(18)
    for i, edits in enumerate(mutations(rng, region, 200)):
        out = tmp_path / f"fuzz{i}.gguf"
        out.write_bytes(apply(data, edits))
        try:
            memra.load(out)
        except MemraError as e:
            assert "\n" not in str(e) and out.name in str(e), (edits, str(e))
        out.unlink()


def test_fuzz_safetensors_header(tmp_path):
    d = hf_copy("llama", tmp_path)
    st = d / "model.safetensors"
    data, rng = st.read_bytes(), random.Random(18)
    for edits in mutations(rng, safetensors_header_end(st), 100):
        st.write_bytes(apply(data, edits))
        try:
            memra.load(d, tokenizer=False)
        except MemraError as e:  # a mangled tensor name is "missing" from the directory: named by the directory
            assert "\n" not in str(e) and str(d) in str(e), (edits, str(e))
