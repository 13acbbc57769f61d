"""Write the CPU benchmark's GGUFs: random weights of two real shapes, quantized, for `memra bench model --gguf`.

    python tools/make_cpu_bench_gguf.py OUT_DIR [--shapes qwen3-300m,llama-507m] [--types q8_0,q4_k,q4_k_m]

Shapes (docs/PERFORMANCE.md, issue 48), each with the llama fixture's 1,024-token vocabulary:
  qwen3-300m  Qwen3: hidden 1024, 24 layers, FFN 3072, 16 heads / 8 KV heads of 64, q/k norms
  llama-507m  Llama: hidden 1536, 20 layers, FFN 4096, 12 heads / 4 KV heads of 128
  qwen35-500m Qwen3.5 (a GDN hybrid, Qwen3.5-0.8B's layers): hidden 1024, 24 layers (every 4th full
              attention: 8 heads / 2 KV heads of 256, gated), GDN 16 key / 16 value heads of 128, FFN 3584
q8_0 and q4_k are `memra convert`'s; q4_k_m is llama.cpp's quantizer (llama_cpp.llama_model_quantize, from
memra convert's f16 file: a Q6_K head and some v / down rows, as llama.cpp ships Q4_K_M), so it needs
llama-cpp-python. Writes OUT_DIR/{shape}-{type}.gguf; an existing file is kept.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

import torch

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "hf"  # its llama and qwen3 fixtures
SHAPES = {
    "qwen3-300m": ("qwen3", dict(hidden_size=1024, intermediate_size=3072, num_attention_heads=16,
                                 num_key_value_heads=8, head_dim=64, num_hidden_layers=24)),
    "llama-507m": ("llama", dict(hidden_size=1536, intermediate_size=4096, num_attention_heads=12,
                                 num_key_value_heads=4, head_dim=128, num_hidden_layers=20)),
    "qwen35-500m": ("qwen3_5", dict(hidden_size=1024, intermediate_size=3584, num_attention_heads=8,
                                    num_key_value_heads=2, head_dim=256, num_hidden_layers=24,
                                    linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
                                    linear_value_head_dim=128, max_position_embeddings=4096)),
}


def hf_dir(shape: str, root: Path) -> Path:
    """A random HF directory of `shape` (the fixture's tokenizer and config, widened)."""
    import transformers

    fixture, dims = SHAPES[shape]
    src = root / shape
    if src.exists():
        return src
    shutil.copytree(FIXTURES / fixture, src, ignore=shutil.ignore_patterns("*.safetensors"))
    cfg = transformers.AutoConfig.from_pretrained(src)
    cfg.update(dict(dims, initializer_range=0.02))
    if fixture == "qwen3_5":  # every 4th layer full attention; RoPE over a quarter of the head in three sections
        cfg.layer_types = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(cfg.num_hidden_layers)]
        cfg.rope_parameters = dict(cfg.rope_parameters, mrope_section=[11, 11, 10])
    elif getattr(cfg, "layer_types", None):
        cfg.layer_types = [cfg.layer_types[0]] * cfg.num_hidden_layers
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(src)
    return src


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--types", default="q8_0,q4_k,q4_k_m")
    args = p.parse_args()
    from memra.convert import convert

    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.out) as tmp:
        for shape in args.shapes.split(","):
            for qtype in args.types.split(","):
                out = args.out / f"{shape}-{qtype}.gguf"
                if out.exists():
                    continue
                src = hf_dir(shape, Path(tmp))
                if qtype != "q4_k_m":
                    convert(src, out, qtype)
                    continue
                import llama_cpp

                f16 = convert(src, Path(tmp) / f"{shape}-f16.gguf", "f16")
                params = llama_cpp.llama_model_quantize_default_params()
                params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
                if llama_cpp.llama_model_quantize(str(f16).encode(), str(out).encode(), params) != 0:
                    raise SystemExit(f"llama.cpp's quantizer failed on {f16}")
            print(f"{shape}: done")


if __name__ == "__main__":
    main()
