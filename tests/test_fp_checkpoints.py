"""FP8 block-scaled and NVFP4 HF checkpoints, end to end: made from the tiny fixtures by
tools/make_fixture_quant.py (deterministic, so built here rather than stored), loaded through memra.load,
equal bit for bit to their dequantized twin, gated, generated, and refused when corrupt."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import memra
from conftest import reference
from cuda_marks import cuda_only
from memra import counters
from memra.errors import CheckpointError
from memra.gate import run_battery
from memra.loading.fp_reference import fp8_block_reference, nvfp4_reference

ROOT = Path(__file__).resolve().parent.parent


def _tool():
    spec = importlib.util.spec_from_file_location("make_fixture_quant", ROOT / "tools" / "make_fixture_quant.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


TOOL = _tool()
NAMES = list(TOOL.SET)  # llama_fp8, qwen3_5_fp8, qwen3_nvfp4 (modelopt), qwen3_5_nvfp4 / llama_nvfp4 (c-t)


@pytest.fixture(scope="session")
def quant_dirs(tmp_path_factory) -> dict[str, Path]:
    return TOOL.make_set(tmp_path_factory.mktemp("quant"))


def reference_twin(src: Path, out: Path) -> Path:
    """The checkpoint with every quantized weight replaced by its float32 value from the *reference*
    dequantizer (memra.loading.fp_reference), and no quantization_config: a plain float checkpoint."""
    shutil.copytree(src, out)
    config = json.loads((src / "config.json").read_text())
    qc = config.pop("quantization_config")
    (out / "hf_quant_config.json").unlink(missing_ok=True)
    (out / "config.json").write_text(json.dumps(config))
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}
    plain = {}
    for k, v in t.items():
        if qc["quant_method"] == "fp8" and v.dtype == torch.float8_e4m3fn:
            plain[k] = fp8_block_reference(v, t[k + "_scale_inv"], tuple(qc["weight_block_size"]))
        elif qc["quant_method"] == "modelopt" and v.dtype == torch.uint8:
            plain[k] = nvfp4_reference(v, t[k + "_scale"], t[k + "_scale_2"], inverted_global=False)
        elif k.endswith(".weight_packed"):
            b = k.removesuffix("_packed")
            plain[b] = nvfp4_reference(v, t[b + "_scale"], t[b + "_global_scale"], inverted_global=True)
        elif v.dtype not in (torch.float8_e4m3fn, torch.uint8) and "scale" not in k.rsplit(".", 1)[-1]:
            plain[k] = v
    save_file(plain, str(out / "model.safetensors"))
    return out


@pytest.mark.parametrize("name", NAMES)
def test_logits_equal_the_dequantized_twin(name, quant_dirs, tmp_path):
    """A quantized checkpoint IS its float twin: packed (the CPU default: decoded a tile at a time inside
    each linear) and dequantized at load, its logits equal the twin's bit for bit (tolerance 0), fp32 and
    bf16 alike; the liveness counter shows the quantized path ran."""
    twin = reference_twin(quant_dirs[name], tmp_path / "twin")
    prompt = reference("llama")["prompt0"]
    kind = "fp8_block_weights_loaded" if "fp8" in name else "nvfp4_weights_loaded"
    for dtype in ("float32", "bfloat16"):
        p = memra.load(twin, dtype=dtype, tokenizer=False)
        want = p.prime(prompt, p.new_cache(64), all_logits=True)
        for packed in (None, False):
            before = counters.snapshot()[kind]
            q = memra.load(quant_dirs[name], dtype=dtype, tokenizer=False, packed_weights=packed)
            assert counters.snapshot()[kind] > before
            assert torch.equal(q.prime(prompt, q.new_cache(64), all_logits=True), want), (dtype, packed)


@cuda_only
@pytest.mark.parametrize("name", ["qwen3_5_fp8", "qwen3_5_nvfp4"])
def test_cuda_bf16_twin_and_gate(name, quant_dirs, tmp_path):
    """On a GPU (bf16, the Triton kernels): dequantized at load (the default), logits equal the twin's; packed
    (packed_weights=True), within bf16 summation-order error of them; gate strict ALL GREEN on both."""
    twin = reference_twin(quant_dirs[name], tmp_path / "twin")
    prompt = reference("llama")["prompt2"]
    q, p = (memra.load(d, device="cuda", dtype="bfloat16", tokenizer=False) for d in (quant_dirs[name], twin))
    want = p.prime(prompt, p.new_cache(128), all_logits=True)
    assert torch.equal(q.prime(prompt, q.new_cache(128), all_logits=True), want)
    lines = []
    assert run_battery(q, steps=6, batch=4, mode="strict", plen=12, out=lines.append), "\n".join(lines)
    # packed on the GPU (the door: packed_weights=True; memra.kernels.triton.quant): its weight values are the
    # same bits (tests/test_fp_kernel.py), its sums run in another order than the dense kernel's
    k = memra.load(quant_dirs[name], device="cuda", dtype="bfloat16", tokenizer=False, packed_weights=True)
    got = k.prime(prompt, k.new_cache(128), all_logits=True)
    assert ((got.float() - want.float()).abs().max() / want.float().abs().max()).item() <= 5e-2
    lines = []
    assert run_battery(k, steps=6, batch=4, mode="strict", plen=12, out=lines.append), "\n".join(lines)


def test_packed_on_cpu_by_default(quant_dirs):
    from memra.kernels.split import Fp8BlockSplit, Nvfp4Split
    from memra.loading.checkpoint import load_weights

    cpu = torch.device("cpu")
    _, w, _ = load_weights(quant_dirs["qwen3_5_nvfp4"], cpu, torch.float32, packed=None)
    assert isinstance(w["layers.0.gdn.w_in"], Nvfp4Split) and isinstance(w["layers.2.attn.wqkv"], Nvfp4Split)
    assert isinstance(w["layers.0.mlp.w_down"], Nvfp4Split) and isinstance(w["embed"], torch.Tensor)
    _, w, _ = load_weights(quant_dirs["qwen3_5_fp8"], cpu, torch.bfloat16, packed=None)
    assert isinstance(w["layers.0.gdn.wo"], Fp8BlockSplit) and w["layers.0.gdn.wo"].dtype == torch.bfloat16
    assert isinstance(w["layers.0.gdn.w_in"], torch.Tensor)  # in_proj_a / _b kept bf16: a mixed fused weight decodes
    _, w, _ = load_weights(quant_dirs["llama_fp8"], cpu, torch.float32, packed=False)
    assert all(isinstance(t, torch.Tensor) for t in w.values())


SLOW = pytest.mark.slow  # the same batch-invariant dense path as the two in the default suite


@pytest.mark.parametrize("mode", ["config", "strict"])
@pytest.mark.parametrize("name", ["llama_fp8", "qwen3_5_nvfp4", pytest.param("qwen3_5_fp8", marks=SLOW),
                                  pytest.param("qwen3_nvfp4", marks=SLOW), pytest.param("llama_nvfp4", marks=SLOW)])
def test_gate_all_green(name, mode, quant_dirs, load_model):
    lines = []
    assert run_battery(load_model(quant_dirs[name]), steps=6, batch=3, mode=mode, plen=12, out=lines.append), \
        "\n".join(lines)
    assert lines[-1].startswith("ALL GREEN")
    assert sum(line.endswith(": PASS") for line in lines) == 5


@pytest.mark.parametrize("mode", ["config", "strict"])
def test_canary_must_fail(mode, quant_dirs, load_model):
    lines = []
    model = load_model(quant_dirs["qwen3_5_nvfp4"]).with_doors(MEMRA_GATE_CANARY="1")
    assert not run_battery(model, steps=6, batch=3, mode=mode, plen=12, out=lines.append)
    assert any(l.startswith("gate1 (") and l.endswith("FAIL") for l in lines)
    assert lines[-1].startswith("FAILED")


def memra_cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "memra", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


@pytest.mark.parametrize("mode", ["strict", pytest.param("config", marks=SLOW)])
def test_cli_gate(mode, quant_dirs):
    """`memra gate MODEL --mode M` on an FP8 checkpoint: ALL GREEN exits 0, its canary exits 1."""
    base = ["gate", str(quant_dirs["llama_fp8"]), "--mode", mode, "--steps", "4", "--batch", "2"]
    ok = memra_cli(*base)
    assert ok.returncode == 0 and "ALL GREEN" in ok.stdout, ok.stdout + ok.stderr
    bad = memra_cli(*base, env={"MEMRA_GATE_CANARY": "1"})
    assert bad.returncode == 1 and "FAILED" in bad.stdout


def test_cli_generate_and_inspect(quant_dirs):
    from memra.loading.checkpoint import inspect_checkpoint

    r = memra_cli("generate", str(quant_dirs["qwen3_5_nvfp4"]), "ROMEO:", "--max-tokens", "8")
    assert r.returncode == 0 and r.stdout.startswith("ROMEO:") and "8 generated" in r.stderr, r.stderr
    assert "NVFP4 (modelopt): 21" in inspect_checkpoint(quant_dirs["qwen3_nvfp4"])
    assert "FP8 e4m3, 32x48 blocks" in inspect_checkpoint(quant_dirs["qwen3_5_fp8"])


# --- corrupt or inconsistent checkpoints: refused in one line naming the tensor --------------------------------


def edited(src: Path, out: Path, edit) -> Path:
    shutil.copytree(src, out)
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}
    edit(t)
    save_file(t, str(out / "model.safetensors"))
    return out


def refused(path: Path, match: str) -> str:
    with pytest.raises(CheckpointError, match=match) as e:
        memra.load(path, tokenizer=False)
    assert "\n" not in str(e.value)
    return str(e.value)


Q = "model.layers.1.self_attn.q_proj."


def nan_at(t: torch.Tensor, code: int = 0x7F) -> torch.Tensor:
    b = t.contiguous().view(torch.uint8).clone()
    b.view(-1)[3] = code
    return b.view(t.dtype)


@pytest.mark.parametrize("name,tensor,value", [
    ("llama_fp8", Q + "weight_scale_inv", float("nan")),
    ("llama_fp8", Q + "weight_scale_inv", float("inf")),
    ("qwen3_nvfp4", Q + "weight_scale", "nan-code"),
    ("qwen3_nvfp4", Q + "weight_scale_2", float("inf")),
    ("qwen3_5_nvfp4", "model.layers.2.self_attn.q_proj.weight_global_scale", float("nan")),
])
def test_non_finite_scales_are_refused(name, tensor, value, quant_dirs, tmp_path):
    def edit(t):
        if value == "nan-code":
            t[tensor] = nan_at(t[tensor], 0xFF)
        else:
            t[tensor] = t[tensor].clone().reshape(-1).index_fill(0, torch.tensor([0]), value).reshape(t[tensor].shape)

    msg = refused(edited(quant_dirs[name], tmp_path / "bad", edit), rf"scale tensor '{tensor}' holds 1 non-finite value")
    assert "model.safetensors" in msg and "re-download or re-quantize" in msg


def test_fp8_nan_code_in_a_weight_is_refused(quant_dirs, tmp_path):
    d = edited(quant_dirs["llama_fp8"], tmp_path / "bad", lambda t: t.update({Q + "weight": nan_at(t[Q + "weight"])}))
    refused(d, rf"tensor '{Q}weight' \(FP8 e4m3, 128x128 blocks\) dequantizes to 1 non-finite value")


def test_inconsistent_checkpoints_are_refused(quant_dirs, tmp_path):
    d = edited(quant_dirs["llama_fp8"], tmp_path / "a", lambda t: t.pop(Q + "weight_scale_inv"))
    refused(d, rf"'{Q}weight' is stored as FP8 .* its scale '{Q}weight_scale_inv' is missing")
    d = edited(quant_dirs["llama_fp8"], tmp_path / "b", lambda t: t.update({Q + "weight_scale_inv": torch.ones(2, 1)}))
    refused(d, rf"'{Q}weight_scale_inv' has shape \[2, 1\], expected shape \[1, 1\]")
    d = edited(quant_dirs["qwen3_nvfp4"], tmp_path / "c", lambda t: t.update({Q + "weight_scale": t[Q + "weight_scale"].float()}))
    refused(d, rf"'{Q}weight_scale' is stored as F32; NVFP4 \(modelopt\) stores it as F8_E4M3")
    # a config declaring FP8 over a float checkpoint, and FP8 tensors with no config saying so
    plain = tmp_path / "plain"
    shutil.copytree(ROOT / "tests" / "fixtures" / "hf" / "llama", plain)
    cfg = json.loads((plain / "config.json").read_text())
    (plain / "config.json").write_text(json.dumps({**cfg, "quantization_config": TOOL.quant_config("fp8", (128, 128))}))
    refused(plain, "config declares FP8 e4m3, 128x128 blocks weights but no tensor is stored in that format")
    undeclared = tmp_path / "undeclared"
    shutil.copytree(quant_dirs["llama_fp8"], undeclared)
    cfg = json.loads((undeclared / "config.json").read_text())
    cfg.pop("quantization_config")
    (undeclared / "config.json").write_text(json.dumps(cfg))
    refused(undeclared, "is stored as F8_E4M3; memra reads float weights")
