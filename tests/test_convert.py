"""`memra convert`: HF directory -> GGUF in llama.cpp's naming; memra (and the gguf reader) read it back."""

import gguf
import pytest
import torch

import memra
from conftest import HF_ARCHS, hf_dir, reference, rel_err
from memra.convert import convert
from memra.errors import MemraError
from memra.loading.checkpoint import load_weights
from memra.model.hybrid import HybridModel
from test_gguf_quantized import rounded_hf_weights_for

CPU = torch.device("cpu")
TEXT = "ROMEO: <|im_start|>What light through yonder window breaks? 1234 ĀāĂ\n\n  Thou art"


@pytest.mark.parametrize("arch", HF_ARCHS)
def test_f32_round_trip_gives_the_same_weights_and_tokenizer(arch, tmp_path):
    out = convert(hf_dir(arch), tmp_path / f"{arch}.gguf", "f32")
    reader = gguf.GGUFReader(str(out))  # the gguf package accepts it
    assert reader.fields["general.architecture"].contents() in ("llama", "qwen2", "qwen3", "qwen3moe", "qwen3next", "qwen35", "qwen35moe")
    _, a, _ = load_weights(hf_dir(arch), CPU, torch.float32)
    _, b, _ = load_weights(out, CPU, torch.float32)
    assert set(b) - set(a) <= {"rope_freqs"}  # llama3 scaling travels as llama.cpp's frequency factors
    for k in a:
        assert torch.equal(a[k], b[k]), k
    hf_model, gguf_model = memra.load(hf_dir(arch)), memra.load(out)
    assert hf_model.tokenizer.encode(TEXT) == gguf_model.tokenizer.encode(TEXT)
    ids = reference(arch)["prompt2"]
    la = hf_model.prime(ids, hf_model.new_cache(128), all_logits=True)
    lb = gguf_model.prime(ids, gguf_model.new_cache(128), all_logits=True)
    assert rel_err(lb, la) <= 1e-6  # rope_freqs (llama_tied) may move the inverse frequencies by an ulp


@pytest.mark.parametrize("qtype", ["f16", "q8_0"])
def test_quantized_output_is_the_hf_weights_rounded(qtype, tmp_path):
    """f16 / q8_0: every matrix is the HF weight rounded to that type (per 32-value block, in the GGUF
    layout); a twin model built from exactly those rounded weights gives bit-identical logits."""
    arch = "qwen3_5"
    out = convert(hf_dir(arch), tmp_path / f"m-{qtype}.gguf", qtype)
    kinds = {t.tensor_type.name for t in gguf.GGUFReader(str(out)).tensors}
    assert kinds == ({"F32", "F16"} if qtype == "f16" else {"F32", "Q8_0"})  # every fixture row tiles into 32-blocks
    cfg, rounded = rounded_hf_weights_for(out, arch, qtype)
    twin = HybridModel(cfg, {k: v.contiguous().clone() for k, v in rounded.items()}, CPU, torch.float32)
    ours = memra.load(out, tokenizer=False)
    ids = reference(arch)["prompt0"]
    assert torch.equal(ours.prime(ids, ours.new_cache(64), all_logits=True), twin.prime(ids, twin.new_cache(64), all_logits=True))


def test_q4_k_output_loads_split_on_cpu_with_the_unpacked_bits(tmp_path):
    """q4_k: rows of whole 256-value super-blocks become Q4_K (memra.kernels.quant.quantize_q4_k). On
    CPU the model keeps them split (memra.kernels.split: about the file's bytes, not fp32) and computes
    the bits of the same file decoded at load. The fixture is 64 wide, so the model is a wider random
    Llama with the fixture's tokenizer."""
    import shutil

    transformers = pytest.importorskip("transformers")
    from memra.kernels.split import Q4KSplit
    from memra.loading.checkpoint import load

    src = tmp_path / "wide"
    shutil.copytree(hf_dir("llama"), src)
    (src / "model.safetensors").unlink()
    (src / "reference.safetensors").unlink()
    cfg = transformers.AutoConfig.from_pretrained(src)
    cfg.update(dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=64, num_hidden_layers=2))
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(src)
    out = convert(src, tmp_path / "wide-q4_k.gguf", "q4_k")
    kinds = {t.tensor_type.name for t in gguf.GGUFReader(str(out)).tensors}
    assert kinds == {"F32", "Q4_K"}
    packed, plain = (load(out, device="cpu", tokenizer=False, packed_weights=p) for p in (None, False))
    kept = {k for k, w in packed._weights.items() if isinstance(w, Q4KSplit)}
    assert "embed" in kept and any(k.endswith("wqkv") for k in kept) and any("gate_up" in k for k in kept)
    for k in kept:  # fp32 is 4 bytes a value, Q4_K split 0.59
        assert packed._weights[k].nbytes <= 0.16 * plain._weights[k].nbytes, k
    ids = [1, 5, 9, 200, 7]
    assert torch.equal(packed.prime(ids, packed.new_cache(32), all_logits=True),
                       plain.prime(ids, plain.new_cache(32), all_logits=True))


def test_convert_refuses_bad_input(tmp_path):
    with pytest.raises(MemraError, match="unknown GGUF type"):
        convert(hf_dir("llama"), tmp_path / "x.gguf", "q3_k")
    with pytest.raises(MemraError, match="Hugging Face model directory"):
        convert(tmp_path / "nothing.gguf", tmp_path / "x.gguf", "f16")
