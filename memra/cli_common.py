"""What every command that loads a model shares: the loading flags and the one call that uses them."""

from __future__ import annotations

import argparse


def add_load_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default=None, help="cpu (default) or cuda[:N]")
    p.add_argument("--dtype", default=None, help="float32 (CPU default) | bfloat16 (CUDA default) | float16")
    p.add_argument("--packed-weights", action=argparse.BooleanOptionalAction, default=None,
                   help="keep a GGUF's Q8_0 and Q4_K weights packed in memory, decoded a tile at a time (the same "
                        "output); --no-packed-weights decodes all at load; default: both packed on CPU, decoded at load on a GPU")
    p.add_argument("--check-tensors", action="store_true",
                   help="scan every weight for NaN / Inf while loading and name the first bad tensor (norms and "
                        "quantization scales are always checked)")
    p.add_argument("--kv-memory", type=float, default=None, metavar="GIB",
                   help="memory the KV cache and recurrent state may take, in GiB (default: --kv-fraction)")
    p.add_argument("--kv-fraction", type=float, default=0.9,
                   help="share of the device's free memory (after the weights) the caches may take when "
                        "--kv-memory is not given (default 0.9; on CPU, of the available RAM)")


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="a Hugging Face model directory or a .gguf file")
    add_load_args(p)


def load_model(args: argparse.Namespace, path, tokenizer: bool = True):
    import memra

    from memra.pools import KvBudget

    return memra.load(path, device=args.device, dtype=args.dtype, tokenizer=tokenizer, check_tensors=args.check_tensors,
                      kv_budget=KvBudget(args.kv_memory, args.kv_fraction), packed_weights=args.packed_weights)
