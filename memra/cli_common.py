"""What every command that loads a model shares: the loading flags and the one call that uses them."""

from __future__ import annotations

import argparse

from memra.errors import MemraError

# --dtype's names (vLLM's included) -> memra.load's; auto: memra's per-device default
DTYPES = {"auto": None, "half": "float16", "float16": "float16", "bfloat16": "bfloat16", "float": "float32",
          "float32": "float32"}

# `memra bench`'s help line (memra.cli shows it without importing the benchmarks)
BENCH_HELP = ("benchmarks: serve (load-test a server), model (tokens/s against the roofline and HF), throughput "
              "(an offline batch through memra.LLM).")


def dtype_of(flag: str):
    """--dtype's value as memra.load takes it (memra's own names, bf16 and kin, pass as they are)."""
    return DTYPES.get(flag, flag)


def add_load_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default=None, help="cpu (default) or cuda[:N]")
    p.add_argument("--dtype", default="auto",
                   help="the weights' and activations' type: auto (the default) is float32 on CPU and bfloat16 on "
                        "CUDA; half and float are vLLM's names for float16 and float32")
    p.add_argument("--packed-weights", action=argparse.BooleanOptionalAction, default=None,
                   help="keep a GGUF's Q8_0 / Q4_K / Q5_K / Q6_K weights, or an FP8 / NVFP4 checkpoint's, packed in memory, "
                        "multiplied in int8 block dot products on CPU (GGUF; MEMRA_CPU_QDOT=0: decoded a tile at a time, the "
                        "output of --no-packed-weights) or decoded a tile at a time; --no-packed-weights decodes all at load; "
                        "default: packed on CPU, decoded at load on a GPU")
    p.add_argument("--check-tensors", action="store_true",
                   help="scan every weight for NaN / Inf while loading and name the first bad tensor (norms and "
                        "quantization scales are always checked)")
    p.add_argument("--kv-memory", type=float, default=None, metavar="GIB",
                   help="memory the KV cache and recurrent state may take, in GiB (default: --kv-fraction)")
    p.add_argument("--kv-fraction", type=float, default=0.9,
                   help="share of the device's free memory (after the weights) the caches may take when "
                        "--kv-memory is not given (default 0.9; on CPU, of the available RAM)")


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    """The sampling flags `memra generate` and `memra chat` share (SamplingParams' fields)."""
    p.add_argument("--max-tokens", type=int, default=max_tokens, help="tokens to generate at most (default %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below this share of the likeliest (0 = off)")
    p.add_argument("--seed", type=int, default=None,
                   help="sampling seed (the stream depends only on seed and step); default: a random one, "
                        "printed so the run can be repeated")
    p.add_argument("--stop", action="append", default=[], help="stop when this text appears (repeatable)")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="1 = off")


def sampling_params(args: argparse.Namespace, seed: int):
    """SamplingParams from add_sampling_args' flags; a bad value is SamplingParams' one-line error."""
    from memra.sampling import SamplingParams

    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                          seed=seed, max_tokens=args.max_tokens, stop=tuple(args.stop),
                          repetition_penalty=args.repetition_penalty)


def drawn_seed(args: argparse.Namespace) -> int:
    """--seed, or a fresh random one (which the command prints)."""
    import secrets

    return args.seed if args.seed is not None else secrets.randbelow(1 << 31)


def add_spec_args(p: argparse.ArgumentParser, where: str = "") -> None:
    """The speculative-decoding flags `memra generate`, `memra serve` and `memra bench serve --launch` share;
    `where` ends each help sentence (bench: " (with --launch: the server's)")."""
    p.add_argument("--speculative", choices=["mtp", "ngram"], default=None,
                   help="draft-and-verify decoding: the checkpoint's MTP head, or n-gram prompt lookup (the output "
                        f"is token-identical to plain decoding; only the speed changes){where}.")
    p.add_argument("--draft-k", type=int, default=4,
                   help=f"draft tokens per verify with --speculative (default 4){where}.")
    p.add_argument("--dynamic-k", action="store_true",
                   help="adapt the draft length (1..K) to how many drafted tokens the model has been accepting"
                        f"{where}.")


def spec_config(args: argparse.Namespace):
    """The SpecConfig the flags ask for (None without --speculative); a bad value is a one-line MemraError."""
    from memra.errors import MemraError
    from memra.spec import SpecConfig

    if args.speculative is None:
        if args.dynamic_k or args.draft_k != 4:
            raise MemraError("--draft-k and --dynamic-k need --speculative mtp|ngram")
        return None
    return SpecConfig(args.speculative, k=args.draft_k, dynamic_k=args.dynamic_k)


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="a Hugging Face model directory or a .gguf file")
    add_load_args(p)


def load_model(args: argparse.Namespace, path, tokenizer: bool = True):
    import memra

    from memra.pools import KvBudget

    util = getattr(args, "gpu_memory_utilization", None)  # memra serve's vLLM flag (memra.server.vllm_flags)
    budget = KvBudget(args.kv_memory, util, of_total=True) if util is not None else KvBudget(args.kv_memory,
                                                                                            args.kv_fraction)
    return memra.load(path, device=args.device, dtype=dtype_of(args.dtype), tokenizer=tokenizer,
                      check_tensors=args.check_tensors, kv_budget=budget, packed_weights=args.packed_weights,
                      settings=getattr(args, "settings", None))


def fit(params, prompt_tokens: int, max_position: int):
    """max_tokens cut to what the model's context leaves after the prompt (as offline generation stops at
    the end of the context), said in one line on stderr when it cuts; or a one-line refusal when the
    prompt alone fills the context."""
    import dataclasses
    import sys

    room = max_position - prompt_tokens
    if room < 1:
        raise MemraError(f"the prompt has {prompt_tokens} tokens; the model's context is {max_position}")
    if params.max_tokens > room:
        print(f"[--max-tokens {params.max_tokens} clipped to {room}: the model's context is {max_position} tokens "
              f"and the prompt takes {prompt_tokens}]", file=sys.stderr, flush=True)
    return dataclasses.replace(params, max_tokens=min(params.max_tokens, room))
