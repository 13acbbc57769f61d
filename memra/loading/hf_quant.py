"""Which weight format an HF checkpoint declares: config.json's `quantization_config`, or modelopt's
hf_quant_config.json beside it. memra reads three (memra.loading.fp_formats says what each stores):

  FP8 block-scaled     {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                        "weight_block_size": [128, 128]}                       (DeepSeek, Qwen "-FP8")
  NVFP4, modelopt      {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}, or
                        hf_quant_config.json {"quantization": {"quant_algo": "NVFP4", ...}}
  NVFP4, compressed-tensors  {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
                        "config_groups": {...: {"weights": {"num_bits": 4, "type": "float",
                        "group_size": 16}}}}                                    (llm-compressor)

Anything else that declares a quantization is refused in one line naming the field, rather than loaded
wrong. What is deliberately not used: activation quantization (`activation_scheme` dynamic, modelopt's
`input_scale`, compressed-tensors' `input_activations`) -- memra dequantizes the weights and computes
with the model dtype's activations, as vLLM's weight-only (Marlin) path does on GPUs without FP4 -- and a
KV-cache quantization hint (`kv_cache_quant_algo`), which vLLM also applies only when asked
(--kv-cache-dtype); memra's KV cache stays in the model dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memra.errors import ConfigError
from memra.loading.fp_formats import NVFP4_GROUP
from memra.loading.json_file import read_json_object

FP8_BLOCK, NVFP4_MODELOPT, NVFP4_CT = "fp8-block", "nvfp4-modelopt", "nvfp4-compressed-tensors"
_READS = ("fp8 with weight_block_size (FP8 block-scaled), modelopt NVFP4, compressed-tensors "
          "nvfp4-pack-quantized")


@dataclass(frozen=True)
class WeightFormat:
    kind: str  # FP8_BLOCK, NVFP4_MODELOPT or NVFP4_CT
    block: tuple[int, int] = (128, 128)  # FP8: rows x columns per scale

    def describe(self) -> str:
        return f"FP8 e4m3, {self.block[0]}x{self.block[1]} blocks" if self.kind == FP8_BLOCK else \
            f"NVFP4 ({'modelopt' if self.kind == NVFP4_MODELOPT else 'compressed-tensors'})"


def weight_format(raw: dict[str, Any], directory: Path, source: str) -> WeightFormat | None:
    """The declared format, None for plain float weights; ConfigError for one memra does not read."""
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}
    qc = raw.get("quantization_config", text.get("quantization_config"))
    modelopt_file = directory / "hf_quant_config.json"
    if qc is None and modelopt_file.exists():
        hq = read_json_object(modelopt_file, ConfigError, "fix hf_quant_config.json or re-download the model")
        return _modelopt(hq.get("quantization"), str(modelopt_file), "quantization")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ConfigError(f"{source}: 'quantization_config' must be an object, found {type(qc).__name__}")
    method = qc.get("quant_method")
    if method == "fp8":
        return _fp8(qc, source)
    if method == "modelopt":
        return _modelopt(qc.get("quantization", qc), source, "quantization_config")
    if method == "compressed-tensors":
        return _compressed_tensors(qc, source)
    raise ConfigError(f"{source}: quantization_config.quant_method = {method!r} is not a weight format memra "
                      f"reads; it reads {_READS} (or use an unquantized checkpoint)")


def _fp8(qc: dict[str, Any], source: str) -> WeightFormat:
    where = f"{source}: quantization_config"
    if qc.get("fmt", "e4m3") != "e4m3":
        raise ConfigError(f"{where}.fmt = {qc.get('fmt')!r}; memra reads FP8 e4m3 weights only")
    block = qc.get("weight_block_size")
    if block is None:
        raise ConfigError(f"{where} has no weight_block_size: per-tensor FP8 is not read; memra reads "
                          "block-scaled FP8 (weight_block_size, e.g. [128, 128])")
    if (not isinstance(block, list) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and 1 <= b <= 1 << 16 for b in block)):
        raise ConfigError(f"{where}.weight_block_size = {block!r}; expected two positive integers, e.g. [128, 128]")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ConfigError(f"{where}.activation_scheme = {scheme!r}; memra reads block-scaled FP8 with dynamic "
                          "activations (its activations stay in the model dtype)")
    return WeightFormat(FP8_BLOCK, (block[0], block[1]))


def _modelopt(q: Any, source: str, label: str) -> WeightFormat:
    if not isinstance(q, dict):
        raise ConfigError(f"{source}: '{label}' must be an object naming quant_algo")
    algo = q.get("quant_algo")
    if algo != "NVFP4":
        raise ConfigError(f"{source}: {label}.quant_algo = {algo!r}; of modelopt's formats memra reads NVFP4")
    group = q.get("group_size", NVFP4_GROUP)
    if group != NVFP4_GROUP:
        raise ConfigError(f"{source}: {label}.group_size = {group!r}; NVFP4 groups are {NVFP4_GROUP} values")
    return WeightFormat(NVFP4_MODELOPT)


def _compressed_tensors(qc: dict[str, Any], source: str) -> WeightFormat:
    where = f"{source}: quantization_config"
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ConfigError(f"{where}.config_groups must be a non-empty object")
    for name, g in groups.items():
        fmt = (g.get("format") if isinstance(g, dict) else None) or qc.get("format")
        if fmt != "nvfp4-pack-quantized":
            raise ConfigError(f"{where}.config_groups.{name} has format {fmt!r}; of compressed-tensors' formats "
                              "memra reads nvfp4-pack-quantized")
        w = g.get("weights") if isinstance(g, dict) else None
        want = {"num_bits": 4, "type": "float", "group_size": NVFP4_GROUP}
        if not isinstance(w, dict) or any(w.get(k) != v for k, v in want.items()):
            raise ConfigError(f"{where}.config_groups.{name}.weights = {w!r}; nvfp4-pack-quantized needs "
                              f"{want}")
    return WeightFormat(NVFP4_CT)
