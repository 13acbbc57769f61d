"""The `memra` command line: generate | inspect.

Every user-facing failure is a MemraError and is printed as one line, `error: ...`, with exit code 2 —
never a traceback.
"""

from __future__ import annotations

import argparse
import sys

from memra.errors import MemraError


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="a Hugging Face model directory or a .gguf file")
    p.add_argument("--device", default=None, help="cpu (default) or cuda[:N]")
    p.add_argument("--dtype", default=None, help="float32 (CPU default) | bfloat16 (CUDA default) | float16")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="memra", description="memra: exact LLM inference")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text from a prompt, streaming it as it is produced")
    _add_model_args(gen)
    gen.add_argument("prompt", help="the prompt text (with --chat: the user message)")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=0, help="sampling seed (the stream depends only on seed and step)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt with the model's chat template")
    gen.add_argument("--system", default=None, help="system message for --chat")

    ins = sub.add_parser("inspect", help="print a checkpoint's config, tensors and tokenizer")
    ins.add_argument("model", help="a Hugging Face model directory or a .gguf file")
    return parser


def cmd_generate(args: argparse.Namespace) -> int:
    import memra
    from memra.generate import GenerationStats, generate_tokens
    from memra.sampling import SamplingParams
    from memra.tokenizer import IncrementalDetokenizer

    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                            seed=args.seed, max_tokens=args.max_tokens)
    model = memra.load(args.model, device=args.device, dtype=args.dtype)
    tok = model.tokenizer
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        messages.append({"role": "user", "content": args.prompt})
        ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True), add_special=False)
    else:
        ids = tok.encode(args.prompt, add_special=True)
    stats = GenerationStats()
    detok = IncrementalDetokenizer(tok, skip_special=True)
    out = sys.stdout
    if not args.chat:
        out.write(args.prompt)
    for token in generate_tokens(model, ids, params, stats, eos_ids=tok.eos_ids):
        out.write(detok.push(token))
        out.flush()
    out.write(detok.flush() + "\n")
    out.flush()
    print(
        f"[{stats.prompt_tokens} prompt tokens in {stats.prefill_seconds:.2f}s, {stats.generated_tokens} generated"
        f" at {stats.decode_tokens_per_second:.1f} tok/s, finish: {stats.finish_reason}]",
        file=sys.stderr,
    )
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from memra.loading.checkpoint import inspect_checkpoint

    print(inspect_checkpoint(args.model))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return {"generate": cmd_generate, "inspect": cmd_inspect}[args.command](args)
    except MemraError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
