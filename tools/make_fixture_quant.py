"""Make tiny FP8 block-scaled and NVFP4 checkpoints by quantizing the repo's tiny HF fixtures.

How they are made: every 2-D `*proj*.weight` of tests/fixtures/hf/<arch>/model.safetensors (attention,
MLP, GDN and MTP projections; per-expert MoE projections too), less the set's exclusions, is quantized with memra's reference
quantizers (memra.loading.fp_reference, written after transformers' Fp8Quantize and modelopt's
NVFP4QTensor.quantize) and stored under the names and dtypes its writer uses; every other tensor
(embeddings, LM head, norms, GDN gates and conv, routers) is kept, cast to bf16 as real FP8/NVFP4
checkpoints ship them. config.json gets the writer's `quantization_config`; modelopt's export also
gets hf_quant_config.json. The tokenizer and generation files are copied. No randomness: the output is
a function of the input fixture, so tests build them on the fly (tests/test_fp_checkpoints.py) rather
than keep the bytes in the repository.

  fp8            {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                  "weight_block_size": [br, bc]}: X.weight (F8_E4M3), X.weight_scale_inv (F32)
  nvfp4-modelopt {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}: X.weight (U8),
                  X.weight_scale (F8_E4M3), X.weight_scale_2 (F32), X.input_scale (F32, unused)
  nvfp4-ct       compressed-tensors "nvfp4-pack-quantized": X.weight_packed (U8), X.weight_scale (F8_E4M3),
                  X.weight_global_scale (F32, = 1 / modelopt's weight_scale_2), X.input_global_scale

Run from the repo root:
  python tools/make_fixture_quant.py OUT_DIR              # the standard set (see SET) under OUT_DIR/
  python tools/make_fixture_quant.py OUT_DIR --arch qwen3 --format fp8 --block 128 128
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from memra.loading.fp_reference import fp8_block_quantize, nvfp4_quantize  # noqa: E402

HF = ROOT / "tests" / "fixtures" / "hf"
COPY = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
FORMATS = ("fp8", "nvfp4-modelopt", "nvfp4-ct")
# name -> (source fixture, format, FP8 block, projections kept bf16): Llama / Qwen3 / Qwen3.5 in each format
# family; one FP8 with blocks smaller than the matrices and ragged at the edges (128 x 64 in 32 x 48 blocks),
# one at 128 x 128; one keeping GDN's small in_proj_a / in_proj_b unquantized (a fused weight of mixed parts).
SET = {
    "llama_fp8": ("llama", "fp8", (128, 128), ()),
    "qwen3_5_fp8": ("qwen3_5", "fp8", (32, 48), ("in_proj_a.", "in_proj_b.")),
    "qwen3_nvfp4": ("qwen3", "nvfp4-modelopt", None, ()),
    "qwen3_5_nvfp4": ("qwen3_5", "nvfp4-ct", None, ()),
    "llama_nvfp4": ("llama", "nvfp4-ct", None, ()),
}


def quant_config(fmt: str, block: tuple[int, int] | None) -> dict:
    if fmt == "fp8":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(block)}
    if fmt == "nvfp4-modelopt":
        return {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
                "kv_cache_quant_algo": None, "exclude_modules": ["lm_head"]}
    group = {"targets": ["Linear"], "format": "nvfp4-pack-quantized",
             "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16,
                         "symmetric": True, "dynamic": False},
             "input_activations": {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16,
                                   "symmetric": True, "dynamic": "local"}}
    return {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
            "config_groups": {"group_0": group}, "ignore": ["lm_head"], "quantization_status": "compressed"}


def quantized(name: str, t: torch.Tensor, skip: tuple[str, ...]) -> bool:
    module = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else ""
    return name.endswith(".weight") and "proj" in module and t.dim() == 2 and not any(s in name for s in skip)


def quantize_tensors(tensors: dict[str, torch.Tensor], fmt: str, block: tuple[int, int] | None,
                     skip: tuple[str, ...] = ()) -> dict:
    out = {}
    for name, t in tensors.items():
        if not quantized(name, t, skip):
            out[name] = t.to(torch.bfloat16)
            continue
        base = name.removesuffix("weight")
        if fmt == "fp8":
            out[name], out[base + "weight_scale_inv"] = fp8_block_quantize(t, block)
            continue
        packed, scale, scale_2 = nvfp4_quantize(t)
        one = torch.ones((), dtype=torch.float32)
        if fmt == "nvfp4-modelopt":
            out.update({name: packed, base + "weight_scale": scale, base + "weight_scale_2": scale_2,
                        base + "input_scale": one})
        else:
            out.update({base + "weight_packed": packed, base + "weight_scale": scale,
                        base + "weight_global_scale": (1.0 / scale_2).reshape(1), base + "input_global_scale": one.reshape(1)})
    return out


def make(src: Path, out: Path, fmt: str, block: tuple[int, int] | None = (128, 128), skip: tuple[str, ...] = ()) -> Path:
    if fmt not in FORMATS:
        raise SystemExit(f"--format must be one of {', '.join(FORMATS)}")
    out.mkdir(parents=True, exist_ok=True)
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    save_file({k: v.contiguous() for k, v in quantize_tensors(tensors, fmt, block, skip).items()},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quant_config(fmt, block)
    config["dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if fmt == "nvfp4-modelopt":
        hq = {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "NVFP4", "group_size": 16,
                                                                "kv_cache_quant_algo": None, "exclude_modules": ["lm_head"]}}
        (out / "hf_quant_config.json").write_text(json.dumps(hq, indent=2) + "\n")
    for name in COPY:
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    return out


def make_set(root: Path) -> dict[str, Path]:
    return {name: make(HF / arch, root / name, fmt, block, skip) for name, (arch, fmt, block, skip) in SET.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--arch", help="one fixture of tests/fixtures/hf (default: the standard set)")
    ap.add_argument("--format", choices=FORMATS, default="fp8")
    ap.add_argument("--block", type=int, nargs=2, default=(128, 128), metavar=("ROWS", "COLS"))
    a = ap.parse_args()
    made = {a.arch: make(HF / a.arch, a.out, a.format, tuple(a.block))} if a.arch else make_set(a.out)
    for name, path in made.items():
        size = sum(p.stat().st_size for p in path.iterdir())
        print(f"{name:16s} {path}  ({size / 1024:.0f} KiB)")


if __name__ == "__main__":
    main()
