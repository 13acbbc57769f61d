"""f16 / q8_0 GGUF files made by llama.cpp's converter.

The claim we can make exactly: after undoing the converter's layout changes, every weight we load
equals the HF weight rounded the way the converter rounded it (f16 cast, or Q8_0 quantize+dequantize
per 32-element row block — row reorders commute with it). So the q8_0/f16 logits differ from HF's only
by weight rounding, and a model built from HF weights rounded that way reproduces them to fp32 accuracy.
Against HF's fp32 logits the weight rounding alone moves the logits (random-weight hybrids amplify it);
we bound that by llama.cpp's own disagreement with HF on the same file (FIXTURES.md), x1.5.
"""

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from conftest import DEVICE, GGUF_QUANTIZED, gguf_file, hf_dir, reference, rel_err
from memra.loading.checkpoint import load_weights
from memra.convert import tile_value_heads
from memra.loading.gguf import untile_value_heads
from memra.model.hybrid import HybridModel

CPU = torch.device("cpu")


def converter_rounding(w: torch.Tensor, qtype: str) -> torch.Tensor:
    if qtype == "f16" or w.shape[-1] % 32:  # llama.cpp stores rows that Q8_0 blocks can't tile as f16
        return w.half().float()
    q = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q8_0)
    return torch.from_numpy(gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0)).reshape(w.shape).clone()


def rounded_hf_weights(name: str):
    arch, qtype = name.rsplit("-", 1)
    return rounded_hf_weights_for(gguf_file(name), arch, qtype)


def rounded_hf_weights_for(path, arch: str, qtype: str):
    """-> (cfg, HF weights with every tensor that the GGUF at `path` stores rounded, rounded independently)."""
    cfg, q_weights, _ = load_weights(path, CPU, torch.float32)
    _, hf_weights, _ = load_weights(hf_dir(arch), CPU, torch.float32)
    assert q_weights.keys() == hf_weights.keys()
    rounded, n_rounded = {}, 0
    for k, hf_w in hf_weights.items():
        q_w = q_weights[k]
        if torch.equal(q_w, hf_w):
            rounded[k] = hf_w  # kept in f32 by the converter (norms, conv, gates, ...)
        else:
            if cfg.arch == "qwen3_5" and k.endswith("gdn.wo"):
                # ssm_out's *columns* were reordered before quantization, so its Q8_0 blocks run
                # along the tiled order: round there, then move back.
                nk, r_ = cfg.gdn.n_k_heads, cfg.gdn.n_v_heads // cfg.gdn.n_k_heads
                r = untile_value_heads(converter_rounding(tile_value_heads(hf_w, 1, nk, r_), qtype), 1, nk, r_)
            else:
                r = converter_rounding(hf_w, qtype)
            assert torch.equal(q_w, r), f"{path}: {k} is neither the HF weight nor its {qtype} rounding"
            rounded[k], n_rounded = r, n_rounded + 1
    assert n_rounded > 0
    return cfg, rounded


@pytest.mark.parametrize("name", GGUF_QUANTIZED)
def test_quantized_weights_are_exactly_the_converters_rounding(name, load_model):
    cfg, rounded = rounded_hf_weights(name)
    ours = load_model(gguf_file(name)).with_doors(MEMRA_CPU_QDOT="0")  # packed on CPU: the tiled twin's bits
    dev = torch.device(DEVICE)
    twin = HybridModel(cfg, {k: v.to(dev).contiguous().clone() for k, v in rounded.items()}, dev, torch.float32)
    ref = reference(name.rsplit("-", 1)[0])
    for i in range(3):
        a = ours.prime(ref[f"prompt{i}"], ours.new_cache(128), all_logits=True)
        b = twin.prime(ref[f"prompt{i}"], twin.new_cache(128), all_logits=True)
        assert torch.equal(a, b)


@pytest.mark.parametrize("arch", ["llama", "qwen3_next", "qwen3_5"])
def test_a_cpu_load_keeps_q8_0_packed_with_the_unpacked_bits(arch):
    """On CPU (by default) a Q8_0 GGUF's projections, embedding and head stay packed (memory tracks the
    file). Through the tiled twin (MEMRA_CPU_QDOT=0) the model computes the same bits as the same file
    decoded at load (the integer-dot kernel, the default, is held to llama.cpp's agreement with HF below
    and to the dequantized product in tests/test_cpu_qdot.py)."""
    from memra.kernels.split import Q8Split
    from memra.loading.checkpoint import load

    path = gguf_file(f"{arch}-q8_0")
    packed, plain = (load(path, device="cpu", tokenizer=False, packed_weights=p) for p in (None, False))  # None: CPU default
    kept = {k for k, w in packed._weights.items() if isinstance(w, Q8Split)}  # Q8_0 split for the CPU
    assert "embed" in kept and any(k.endswith(("wqkv", "w_in")) for k in kept) and any("gate_up" in k for k in kept)
    for k in kept:  # fp32 is 4 bytes a value, Q8_0 split 1.125
        assert packed._weights[k].nbytes <= 0.29 * plain._weights[k].nbytes, k
    ids = reference(arch)["prompt1"]
    packed = packed.with_doors(MEMRA_CPU_QDOT="0")
    ca, cb = packed.new_cache(128), plain.new_cache(128)
    a, b = packed.prime(ids, ca, all_logits=True), plain.prime(ids, cb, all_logits=True)
    assert torch.equal(a, b)
    tok = int(a[-1].argmax())
    for _ in range(4):
        a, b = packed.decode_step(tok, ca), plain.decode_step(tok, cb)
        assert torch.equal(a, b)
        tok = int(a.argmax())


@pytest.mark.parametrize("name", GGUF_QUANTIZED)
def test_quantized_logits_within_llamacpp_agreement(name, load_model):
    arch = name.rsplit("-", 1)[0]
    ref, lcpp = reference(arch), load_file(str(gguf_file(name).with_suffix(".llamacpp.safetensors")))
    model = load_model(gguf_file(name))
    ours = max(rel_err(model.prime(ref[f"prompt{i}"], model.new_cache(128), all_logits=True), ref[f"logits{i}"]) for i in range(3))
    theirs = max(rel_err(lcpp[f"logits{i}"], ref[f"logits{i}"]) for i in range(3))
    assert ours <= 1.5 * theirs, f"memra {ours:.3g} vs llama.cpp {theirs:.3g} (relative to HF fp32)"


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "BF16"])
def test_more_quant_types_load_end_to_end(qtype, tmp_path, load_model):
    """Requantize every matrix of the f32 llama GGUF with the gguf package, load it, and check that each
    weight is exactly the rounding of the f32 weight and the model runs to sensible logits."""
    from gguf_edit import rewrite_gguf

    q = gguf.GGMLQuantizationType[qtype]
    reader = gguf.GGUFReader(str(gguf_file("llama-f32")))
    new = {}
    for t in reader.tensors:
        data = np.asarray(t.data)
        if data.ndim == 2 and data.shape[-1] % 32 == 0:
            new[t.name] = (gguf.quants.quantize(data, q), q)
    out = rewrite_gguf(gguf_file("llama-f32"), tmp_path / f"llama-{qtype}.gguf", tensors=new)
    cpu = torch.device("cpu")
    _, loaded, _ = load_weights(out, cpu, torch.float32)
    _, exact, _ = load_weights(gguf_file("llama-f32"), cpu, torch.float32)
    for k, w in exact.items():
        if w.dim() == 2 and w.shape[-1] % 32 == 0:
            rounded = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(w.numpy(), q), q)).reshape(w.shape)
            assert torch.equal(loaded[k], rounded), k
        else:
            assert torch.equal(loaded[k], w), k
    ref = reference("llama")
    logits = load_model(out).prime(ref["prompt2"], load_model(out).new_cache(128), all_logits=True)
    # Weight rounding alone moves the random-weight fixture's logits this far (measured: bf16 ~5e-3,
    # Q5_x 0.25-0.36, Q4_x 0.49-0.51); the bound catches a broken dequantizer or layout, which gives O(1)+.
    bound = {"BF16": 2e-2, "Q5_0": 0.45, "Q5_1": 0.45, "Q4_0": 0.65, "Q4_1": 0.65}[qtype]
    assert rel_err(logits, ref["logits2"]) <= bound
