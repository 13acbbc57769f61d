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


CONVERTIBLE = [a for a in HF_ARCHS if a not in ("mistral", "gemma4", "step3p5")]  # sliding windows have no GGUF form memra writes


def test_sliding_window_models_are_refused_in_one_line(tmp_path):
    with pytest.raises(MemraError, match="does not write mistral with a sliding window"):
        convert(hf_dir("mistral"), tmp_path / "m.gguf", "f32")
    assert not list(tmp_path.iterdir())  # nothing half-written left behind


@pytest.mark.parametrize("arch", CONVERTIBLE)
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
    ours = memra.load(out, tokenizer=False).with_doors(MEMRA_CPU_QDOT="0")  # q8_0 packed: the tiled twin's bits
    ids = reference(arch)["prompt0"]
    assert torch.equal(ours.prime(ids, ours.new_cache(64), all_logits=True), twin.prime(ids, twin.new_cache(64), all_logits=True))


def _wide_llama(tmp_path):
    """A random Llama 256 wide (the fixtures are 64 wide: no whole K-quant super-blocks) with the
    fixture's tokenizer, as an HF directory."""
    import shutil

    transformers = pytest.importorskip("transformers")
    src = tmp_path / "wide"
    shutil.copytree(hf_dir("llama"), src)
    (src / "model.safetensors").unlink()
    (src / "reference.safetensors").unlink()
    cfg = transformers.AutoConfig.from_pretrained(src)
    cfg.update(dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=64, num_hidden_layers=2))
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(src)
    return src


def _split_on_cpu_with_the_unpacked_bits(path, qtypes: set[str]) -> None:
    """On CPU (by default) every projection, the embedding and the head of the GGUF at `path` stay
    packed in their CPU layouts (memra.kernels.split: a fraction of fp32's bytes). Through the tiled twin
    (MEMRA_CPU_QDOT=0) the model computes the bits of the same file decoded at load; through the
    integer-dot kernel (the default) its logits stay within 5% of the logit scale of those."""
    from memra.kernels.split import SPLIT_TYPES
    from memra.loading.checkpoint import load

    packed, plain = (load(path, device="cpu", tokenizer=False, packed_weights=p) for p in (None, False))
    kept = {k: w for k, w in packed._weights.items() if isinstance(w, SPLIT_TYPES)}
    layouts = [q for w in kept.values() for q in getattr(w, "parts", (w,))]  # SplitRows: row blocks of several
    assert {w.qtype.name for w in layouts} == qtypes
    projections = {k for k in packed._weights if k.endswith(("wqkv", "wo", "w_gate_up", "w_down"))}
    assert projections and projections <= set(kept) and {"embed", "lm_head"} <= set(kept)
    for k, w in kept.items():  # fp32 is 4 bytes a value; the splits hold 0.59-1.09
        assert w.nbytes <= 0.28 * plain._weights[k].nbytes, k
    ids = [1, 5, 9, 200, 7]
    tiled, want = packed.with_doors(MEMRA_CPU_QDOT="0"), plain.prime(ids, plain.new_cache(32), all_logits=True)
    assert torch.equal(tiled.prime(ids, tiled.new_cache(32), all_logits=True), want)
    assert packed.ops.qdot and rel_err(packed.prime(ids, packed.new_cache(32), all_logits=True), want) <= 0.05


def test_q4_k_output_loads_split_on_cpu_with_the_unpacked_bits(tmp_path):
    """q4_k: rows of whole 256-value super-blocks become Q4_K (memra.kernels.quant.quantize_q4_k)."""
    out = convert(_wide_llama(tmp_path), tmp_path / "wide-q4_k.gguf", "q4_k")
    assert {t.tensor_type.name for t in gguf.GGUFReader(str(out)).tensors} == {"F32", "Q4_K"}
    _split_on_cpu_with_the_unpacked_bits(out, {"Q4_K"})


def test_a_llama_cpp_q4_k_m_file_loads_split_on_cpu(tmp_path):
    """llama.cpp's own Q4_K_M (its quantizer, where llama_cpp is installed: a test-only peer) mixes
    Q4_K with Q6_K (the head, some value and down projections) and Q5_K / Q8_0 where it chooses: all of
    it stays packed on CPU with the decoded load's bits."""
    llama_cpp = pytest.importorskip("llama_cpp")
    f16 = convert(_wide_llama(tmp_path), tmp_path / "wide-f16.gguf", "f16")
    out = tmp_path / "wide-q4_k_m.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
    assert llama_cpp.llama_model_quantize(str(f16).encode(), str(out).encode(), params) == 0
    kinds = {t.tensor_type.name for t in gguf.GGUFReader(str(out)).tensors} - {"F32"}
    assert {"Q4_K", "Q6_K"} <= kinds
    _split_on_cpu_with_the_unpacked_bits(out, kinds)


def test_convert_refuses_bad_input(tmp_path):
    with pytest.raises(MemraError, match="unknown GGUF type"):
        convert(hf_dir("llama"), tmp_path / "x.gguf", "q3_k")
    with pytest.raises(MemraError, match="Hugging Face model directory"):
        convert(tmp_path / "nothing.gguf", tmp_path / "x.gguf", "f16")
