"""Checkpoint variants that must load to the same model, and every way a checkpoint can be bad."""

import json
import shutil

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import memra
from conftest import gguf_file, hf_dir, reference
from gguf_edit import rewrite_gguf
from memra.config import from_hf_config
from memra.errors import CheckpointError, ConfigError, MemraError


def same_logits(a_path, b_path, arch):
    ids = reference(arch)["prompt0"]
    a = memra.load(a_path, tokenizer=False)
    b = memra.load(b_path, tokenizer=False)
    return torch.equal(a.prime(ids, a.new_cache(64), all_logits=True), b.prime(ids, b.new_cache(64), all_logits=True))


def copy_dir(arch, tmp_path):
    d = tmp_path / arch
    shutil.copytree(hf_dir(arch), d)
    (d / "reference.safetensors").unlink()
    return d


# --- variants that must give bit-identical logits ---------------------------------------------


def test_sharded_safetensors_with_index(tmp_path):
    d = copy_dir("qwen3_5", tmp_path)
    tensors = load_file(str(d / "model.safetensors"))
    (d / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for fname, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(d / fname))
        weight_map.update({k: fname for k in keys})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert same_logits(hf_dir("qwen3_5"), d, "qwen3_5")


def test_qwen35_vl_wrapper_config_and_prefix(tmp_path):
    """Released Qwen3.5 checkpoints nest the LM under text_config and model.language_model.*."""
    d = copy_dir("qwen3_5", tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    wrapped = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
               "tie_word_embeddings": False, "text_config": cfg, "vision_config": {"depth": 2}}
    (d / "config.json").write_text(json.dumps(wrapped))
    tensors = load_file(str(d / "model.safetensors"))
    renamed = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v for k, v in tensors.items()}
    renamed["model.visual.patch_embed.weight"] = torch.zeros(4, 4)
    save_file(renamed, str(d / "model.safetensors"))
    assert same_logits(hf_dir("qwen3_5"), d, "qwen3_5")


def test_fused_expert_tensors(tmp_path):
    """Qwen3.5-MoE exports may store experts fused: gate_up_proj [X, 2F, E], down_proj [X, E, F]."""
    d = copy_dir("qwen3_5_moe", tmp_path)
    tensors = load_file(str(d / "model.safetensors"))
    for layer in {k.split(".mlp.experts.")[0] for k in tensors if ".mlp.experts." in k}:
        p = layer + ".mlp.experts."
        n = len({k for k in tensors if k.startswith(p) and k.endswith("gate_proj.weight")})
        gate_up = [torch.cat((tensors.pop(f"{p}{x}.gate_proj.weight"), tensors.pop(f"{p}{x}.up_proj.weight"))) for x in range(n)]
        down = [tensors.pop(f"{p}{x}.down_proj.weight") for x in range(n)]
        tensors[p + "gate_up_proj"], tensors[p + "down_proj"] = torch.stack(gate_up), torch.stack(down)
    save_file(tensors, str(d / "model.safetensors"))
    assert same_logits(hf_dir("qwen3_5_moe"), d, "qwen3_5_moe")


def test_qwen3next_legacy_ssm_in(tmp_path):
    """Older qwen3next GGUFs hold HF's grouped in_proj_qkvz verbatim as ssm_in instead of attn_qkv + attn_gate."""
    hf = load_file(str(hf_dir("qwen3_next") / "model.safetensors"))
    reader = gguf.GGUFReader(str(gguf_file("qwen3_next-f32")))
    gdn_layers = [int(t.name.split(".")[1]) for t in reader.tensors if t.name.endswith("attn_gate.weight")]
    drop = tuple(f"blk.{i}.{n}.weight" for i in gdn_layers for n in ("attn_qkv", "attn_gate"))
    new = {f"blk.{i}.ssm_in.weight": hf[f"model.layers.{i}.linear_attn.in_proj_qkvz.weight"].numpy() for i in gdn_layers}
    out = rewrite_gguf(gguf_file("qwen3_next-f32"), tmp_path / "legacy.gguf", drop=drop, tensors=new)
    assert same_logits(gguf_file("qwen3_next-f32"), out, "qwen3_next")


def test_hf_dir_and_gguf_give_the_same_weights_for_every_arch():
    """The converter inversions, tensor by tensor: f32 GGUF weights equal the HF weights exactly."""
    from memra.loading.checkpoint import load_weights

    cpu = torch.device("cpu")
    for arch in ("llama", "qwen3", "qwen3_moe", "qwen3_next", "qwen3_5", "qwen3_5_moe"):
        _, a, _ = load_weights(hf_dir(arch), cpu, torch.float32)
        _, b, _ = load_weights(gguf_file(f"{arch}-f32"), cpu, torch.float32)
        assert a.keys() == b.keys(), arch
        for k in a:
            if k.endswith("a_neg"):  # converter computed -exp(A_log) in its own fp32 op: within 1 ulp
                assert torch.allclose(a[k], b[k], rtol=2e-7, atol=0), (arch, k)
            else:
                assert torch.equal(a[k], b[k]), (arch, k)


# --- configs ---------------------------------------------------------------------------------


def test_unknown_architecture_is_named():
    raw = json.loads((hf_dir("llama") / "config.json").read_text()) | {"model_type": "gpt_neox"}
    with pytest.raises(ConfigError, match="unknown architecture 'gpt_neox'"):
        from_hf_config(raw)


def test_missing_config_field_is_named():
    raw = json.loads((hf_dir("qwen3_next") / "config.json").read_text())
    del raw["linear_num_value_heads"]
    with pytest.raises(ConfigError, match="linear_num_value_heads"):
        from_hf_config(raw)


def test_bad_config_json(tmp_path):
    d = copy_dir("llama", tmp_path)
    (d / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        memra.load(d)


def test_gguf_unknown_architecture(tmp_path):
    out = rewrite_gguf(gguf_file("llama-f32"), tmp_path / "x.gguf", arch="mamba",
                       meta={"general.architecture": ("mamba", gguf.GGUFValueType.STRING)})
    with pytest.raises(ConfigError, match="unknown architecture 'mamba'"):
        memra.load(out)


def test_gguf_missing_metadata_key(tmp_path):
    reader = gguf.GGUFReader(str(gguf_file("llama-f32")))
    # rewrite without llama.block_count
    out = tmp_path / "x.gguf"
    w = gguf.GGUFWriter(str(out), "llama")
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "llama.block_count"):
            continue
        vt = f.types[0]
        w.add_key_value(key, f.contents(), vt, sub_type=f.types[-1] if vt == gguf.GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(ConfigError, match="block_count"):
        memra.load(out)


# --- broken files ----------------------------------------------------------------------------


def test_corrupt_safetensors(tmp_path):
    d = copy_dir("llama", tmp_path)
    (d / "model.safetensors").write_bytes(b"\x00garbage" * 100)
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        memra.load(d)


def test_truncated_safetensors(tmp_path):
    d = copy_dir("llama", tmp_path)
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        memra.load(d)


def test_truncated_gguf(tmp_path):
    data = gguf_file("qwen3_5-q8_0").read_bytes()
    out = tmp_path / "t.gguf"
    out.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match=r"t\.gguf"):
        memra.load(out)


def test_not_a_model_file(tmp_path):
    out = tmp_path / "notes.txt"
    out.write_text("hello")
    with pytest.raises(CheckpointError, match="not a GGUF file"):
        memra.load(out)
    with pytest.raises(MemraError, match="no such model"):
        memra.load(tmp_path / "missing")


def test_missing_tensor_is_named(tmp_path):
    d = copy_dir("qwen3", tmp_path)
    tensors = load_file(str(d / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.self_attn\.k_norm\.weight.*missing.*layer 1"):
        memra.load(d)


def test_wrong_shape_reports_expected_and_found(tmp_path):
    d = copy_dir("qwen3", tmp_path)
    tensors = load_file(str(d / "model.safetensors"))
    tensors["model.layers.0.mlp.up_proj.weight"] = torch.zeros(100, 64)
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"up_proj.*shape \[100, 64\], expected \[128, 64\]"):
        memra.load(d)


def test_missing_gguf_tensor(tmp_path):
    out = rewrite_gguf(gguf_file("qwen3_5-f32"), tmp_path / "m.gguf", drop=("blk.1.ssm_alpha.weight",))
    with pytest.raises(CheckpointError, match=r"blk\.1\.ssm_alpha\.weight.*missing"):
        memra.load(out)


def test_unsupported_quant_type(tmp_path):
    # IQ4_NL: 32 weights per 18-byte block — a real GGML type memra does not decode.
    raw = np.zeros((32, 2 * 18), dtype=np.uint8)  # [rows=32, 64 cols -> 2 blocks]
    out = rewrite_gguf(gguf_file("llama-f32"), tmp_path / "q.gguf", drop=("blk.0.attn_k.weight",),
                       tensors={"blk.0.attn_k.weight": (raw, gguf.GGMLQuantizationType.IQ4_NL)})
    with pytest.raises(CheckpointError, match=r"blk\.0\.attn_k\.weight.*IQ4_NL.*supported: "):
        memra.load(out)


def test_bad_device_and_dtype():
    with pytest.raises(MemraError, match="unknown dtype"):
        memra.load(hf_dir("llama"), dtype="int3")
    if not torch.cuda.is_available():
        with pytest.raises(MemraError, match="CUDA is not available"):
            memra.load(hf_dir("llama"), device="cuda:0")


def test_broken_tokenizer_fails_the_load_clearly(tmp_path):
    from memra.errors import TokenizerError

    d = copy_dir("qwen3", tmp_path)
    (d / "tokenizer.json").write_text("{ not json")
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        memra.load(d)
    assert memra.load(d, tokenizer=False).tokenizer is None  # the weights alone still load


def test_fast_gguf_reader_agrees_with_the_gguf_package():
    """memra reads GGUF headers itself (GGUFReader needs ~15 s for a 248k-token vocabulary); every key,
    value and tensor entry must equal what gguf.GGUFReader reports, on every fixture file."""
    from memra.loading.gguf_file import GgufFile

    files = sorted((gguf_file("llama-f32").parent).glob("*.gguf"))
    assert len(files) >= 12
    for path in files:
        ours, ref = GgufFile(path), gguf.GGUFReader(str(path))
        expected = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
        assert ours.metadata == expected, path.name
        assert list(ours.tensors) == [t.name for t in ref.tensors], path.name
        for t in ref.tensors:
            e = ours.tensors[t.name]
            assert (e.type_id, e.offset, e.n_bytes) == (int(t.tensor_type), t.data_offset, t.n_bytes), (path.name, t.name)
            assert e.shape == tuple(int(d) for d in reversed(t.shape))
            assert np.array_equal(ours.raw(t.name), np.asarray(ref.data[t.data_offset:t.data_offset + t.n_bytes]))
