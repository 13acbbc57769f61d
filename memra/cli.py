"""The `memra` command line: generate | chat | serve | bench | inspect | convert | eval-ppl | gate.

Every user-facing failure — a MemraError, or an OSError about a file or socket the user named — is
printed as one line, `error: ...`, with exit code 2, never a traceback. (A traceback means a bug.)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from memra.cli_common import (
    BENCH_HELP, add_load_args, add_model_args, add_sampling_args, add_spec_args, drawn_seed, fit as _fit, load_model, sampling_params,
    spec_config,
)
from memra.errors import MemraError


def build_parser(command: str | None = "bench") -> argparse.ArgumentParser:
    """The whole command line. command: the subcommand about to run; `bench`'s flags are built only when it
    is the one (they need torch, which `memra --version` and `--help` should not wait for)."""
    parser = argparse.ArgumentParser(prog="memra", description="memra: exact LLM inference")
    parser.add_argument("--version", action="version", version=f"memra {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text from a prompt, streaming it as it is produced",
                         usage="memra generate [options] [MODEL] PROMPT  (or -f FILE, or the prompt on stdin)")
    gen.add_argument("args", nargs="*", metavar="[MODEL] PROMPT",
                     help="a Hugging Face model directory, .gguf file or hub name ORG/NAME[:FILE.gguf] (default: "
                          "the bundled demo model), then the prompt text (with --chat: the user message)")
    gen.add_argument("-f", "--file", default=None, help="read the prompt from this file ('-': standard input)")
    add_load_args(gen)
    add_sampling_args(gen, max_tokens=128)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt with the model's chat template")
    gen.add_argument("--system", default=None, help="system message for --chat")
    add_spec_args(gen)

    chat = sub.add_parser("chat", help="talk to a model turn by turn (chat template applied); /help lists the "
                                       "commands (/reset, /exit); a line ending in \\ continues, and \"\"\" opens and "
                                       "closes a multi-line message.")
    chat.add_argument("model", nargs="?", default="demo",
                      help="model directory, .gguf file or hub name ORG/NAME[:FILE.gguf] (default: the demo)")
    add_load_args(chat)
    chat.add_argument("--system", default=None, help="system message")
    add_sampling_args(chat, max_tokens=256)
    chat.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                      help="resume each turn from the conversation's cached prompt pages (exact, E8; default on)")

    ins = sub.add_parser("inspect", help="print a checkpoint's config, tensors and tokenizer")
    ins.add_argument("model", help="a Hugging Face model directory or a .gguf file ('demo' = the bundled model)")

    conv = sub.add_parser("convert", help="write a Hugging Face model directory as a GGUF file (llama.cpp naming)")
    conv.add_argument("model", help="a Hugging Face model directory ('demo' = the bundled model)")
    conv.add_argument("out", help="the .gguf file to write")
    conv.add_argument("--type", default="f16", choices=["f32", "f16", "q8_0", "q4_k"],
                      help="tensor type of the projections (default %(default)s; norms stay f32)")

    ppl = sub.add_parser("eval-ppl", help="perplexity of a model over a text file")
    add_model_args(ppl)
    ppl.add_argument("file", help="a UTF-8 text file")
    ppl.add_argument("--ctx", type=int, default=512, help="tokens per scored window (default 512)")
    ppl.add_argument("--mtp", action="store_true", help="also report how often the MTP head's t+2 draft equals the model's own greedy token")
    from memra.server.serve_command import add_serve_parser

    add_serve_parser(sub)
    if command == "bench":
        from memra.bench.command import add_bench_parser

        add_bench_parser(sub)
    else:
        sub.add_parser("bench", help=BENCH_HELP)
    gate = sub.add_parser("gate", help="run the exactness battery (exit code 1 on any failure)")
    add_model_args(gate)
    gate.add_argument("--steps", type=int, default=None, help="decode steps (default 32; pp mode 8); ppspec: verify rounds (default 6)")
    gate.add_argument("--batch", default=None, help="batch width (default 4); pp and prefix modes: a list, e.g. 1,4,8 "
                                                    "(default; prefix: 1,2,4)")
    gate.add_argument("--mode", default="config", choices=["config", "strict", "pp", "ppspec", "score", "prefix", "train"],
                      help="score: scored logprobs == sampled ones (E9); --steps tokens per completion. prefix: a "
                           "prefix-cache hit == a cold server, bit for bit (E8). train: the training forward's logprobs "
                           "== the sampled ones, any packing (E11)")
    gate.add_argument("--stages", type=int, default=2, help="pp/ppspec mode: pipeline stages (MEMRA_PP_SPLITS may set the fence)")
    gate.add_argument("--reps", type=int, default=2, help="pp/ppspec mode: repetitions of the split arm")
    gate.add_argument("--ts", default="2,5,9", help="ppspec mode: verify widths T = K+1 (default 2,5,9: K = 1, 4, 8)")
    gate.add_argument("--plen", type=int, default=20, help="base prompt length (rows get +5 tokens each)")
    gate.add_argument("--transport", default="local", choices=["local", "dist"],
                      help="pp mode: stages as threads of this process (local, default) or one process per stage "
                           "over torch.distributed (dist: ranks 1..N-1 spawned here; default --batch 1,4)")
    return parser


def cmd_gate(args: argparse.Namespace) -> int:
    pp, prefix = args.mode == "pp", args.mode == "prefix"
    steps = args.steps if args.steps is not None else {"pp": 8, "ppspec": 6, "score": 24, "prefix": 8, "train": 16}.get(args.mode, 32)
    dist = args.transport == "dist"
    if dist and not pp:
        raise MemraError("--transport dist runs the pp battery across processes; use it with --mode pp")
    try:
        batches = tuple(int(b) for b in (args.batch or ("1,4" if dist else "1,4,8" if pp else "1,2,4" if prefix
                                                        else "4")).split(","))
    except ValueError:
        raise MemraError(f"--batch {args.batch!r} is not a number or a comma-separated list of numbers") from None
    try:
        ts = tuple(int(t) for t in args.ts.split(","))
    except ValueError:
        raise MemraError(f"--ts {args.ts!r} is not a comma-separated list of verify widths") from None
    if steps <= 0 or args.plen <= 0 or args.reps <= 0 or min(batches) <= 0 or min(ts) <= 0:
        raise MemraError("--steps, --batch, --ts, --plen and --reps must be positive")
    if not (pp or prefix) and len(batches) != 1:
        raise MemraError("--batch takes one width outside --mode pp and --mode prefix")
    model = load_model(args, args.model, tokenizer=False)
    bar = _gate_bar()
    out = (lambda line: print(line, flush=True)) if bar is None else (lambda line: (bar.write(line), bar.update()))
    try:
        ok = _run_gate(args, model, out, pp, prefix, dist, steps, batches, ts)
    finally:
        if bar is not None:
            bar.close()
    return 0 if ok else 1


def _gate_bar():
    """A tqdm bar of the gate's checks (lines written above it) on an interactive terminal; None when piped."""
    from memra.settings import show_progress

    if not show_progress():
        return None
    from tqdm import tqdm

    return tqdm(desc="gate", unit="check", file=sys.stderr, leave=False)


def _run_gate(args, model, out, pp: bool, prefix: bool, dist: bool, steps: int, batches, ts) -> bool:
    if pp and dist:
        from memra.gate.pp_battery import run_pp_dist_battery

        ok = run_pp_dist_battery(model, stages=args.stages, batches=batches, steps=steps, reps=args.reps,
                                 plen=args.plen, out=out)
    elif pp:
        from memra.gate.pp_battery import run_pp_battery

        ok = run_pp_battery(model, stages=args.stages, batches=batches, steps=steps, reps=args.reps,
                            plen=args.plen, out=out)
    elif args.mode == "score":
        from memra.gate.score_arm import run_score_battery

        ok = run_score_battery(model, steps=steps, plen=args.plen, out=out)
    elif args.mode == "train":
        from memra.gate.train_arm import run_train_battery

        ok = run_train_battery(model, steps=steps, plen=args.plen, out=out)
    elif prefix:
        from memra.gate.prefix_battery import run_prefix_battery

        ok = run_prefix_battery(model, batches=batches, steps=steps, out=out)
    elif args.mode == "ppspec":
        from memra.gate.ppspec_battery import run_ppspec_battery

        ok = run_ppspec_battery(model, stages=args.stages, ts=ts, rounds=steps, reps=args.reps, plen=args.plen, out=out)
    else:
        from memra.gate import run_battery

        ok = run_battery(model, steps=steps, batch=batches[0], mode=args.mode, plen=args.plen, out=out)
    return ok


def cmd_generate(args: argparse.Namespace) -> int:
    model_path, prompt = _model_and_prompt(args.args, args.file)  # a missing prompt before any slow import
    from memra.engine.llm import LLM
    from memra.generate import GenerationStats, generate_tokens
    from memra.tokenizer import TextStream

    seed = drawn_seed(args)
    params = sampling_params(args, seed)
    from memra.spec import check_model

    spec = spec_config(args)
    model = load_model(args, model_path)
    tok = model.tokenizer
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        messages.append({"role": "user", "content": prompt})
        ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True), add_special=False)
    else:
        ids = tok.encode(prompt, add_special=True)
    stats = GenerationStats()
    out = sys.stdout
    if not args.chat:
        out.write(prompt)
    if spec is not None:  # draft-and-verify runs one sequence on its own loop (memra.spec): the same tokens
        check_model(model, spec)
        text = TextStream(tok, params.stop)
        pieces = (text.push(t) for t in generate_tokens(model, ids, params, stats, eos_ids=tok.eos_ids,
                                                        speculative=spec) if not text.stopped)
    else:
        params = _fit(params, len(ids), model.cfg.max_position)
        llm = LLM(model, max_batch=1, max_ctx=len(ids) + params.max_tokens, warm_up=False)
        t0 = time.perf_counter()
        llm.engine.warm_up()  # first-use costs, apart from the generation they would otherwise hide in
        warm_s = time.perf_counter() - t0
        pieces = llm.stream(ids, params, stats)
    for piece in pieces:
        out.write(piece)
        out.flush()
    if spec is not None:
        stats.finish_reason = "stop" if text.stopped else stats.finish_reason
        out.write(text.finish())
    out.write("\n")
    out.flush()
    warm = f"warm-up {warm_s:.2f}s (kernels, decode plan check, graphs); " if spec is None else ""
    seeded = f", seed {seed}" if not params.greedy else ""  # --seed N repeats this run
    print(f"[{warm}{stats.prompt_tokens} prompt tokens in {stats.prefill_seconds:.2f}s, {stats.generated_tokens} "
          f"generated at {stats.decode_tokens_per_second:.1f} tok/s, finish: {stats.finish_reason}{seeded}]",
          file=sys.stderr)
    if stats.spec is not None:
        print(f"[{stats.spec.summary()}]", file=sys.stderr)
    return 0


def _names_model(word: str) -> bool:
    """Whether one word names a model rather than being a prompt: an existing path, a .gguf file name,
    a hub name ORG/NAME[:FILE.gguf], random:SHAPE or demo."""
    from memra.loading.hub import looks_like_hub_name

    return (word in ("demo",) or word.startswith("random:") or word.endswith(".gguf") or Path(word).exists()
            or looks_like_hub_name(word))


def _model_and_prompt(words: list[str], file: str | None) -> tuple[str, str]:
    """generate's [MODEL] PROMPT: two words are both; one word is the prompt to the demo model, unless it
    names a model (_names_model: then the prompt comes from -f or standard input, or it is a one-line
    error, never taken for the prompt); the prompt comes from -f FILE, or from standard input when it is
    not a terminal."""
    if len(words) > 2 or (file is not None and len(words) > 1):
        raise MemraError(f"generate takes [MODEL] PROMPT, got {len(words)} arguments (quote the prompt)")
    if len(words) == 2:
        return words[0], words[1]
    piped = file is not None or not sys.stdin.isatty()  # a prompt can come from elsewhere
    if len(words) == 1 and not _names_model(words[0]):
        if file is not None:
            raise MemraError(f"generate got a prompt ({words[0][:40]!r}) and -f {file}; give one of them")
        return "demo", words[0]
    model = words[0] if words else "demo"
    if file is not None and file != "-":
        try:
            with open(file, encoding="utf-8") as f:
                return model, f.read()
        except OSError as e:
            raise MemraError(f"cannot read the prompt file {file}: {e.strerror or e}") from None
    if piped:
        prompt = sys.stdin.read()
        if prompt:
            return model, prompt[:-1] if prompt.endswith("\n") else prompt  # echo's newline is not the prompt's
    if Path(model).is_file() and not model.endswith(".gguf"):
        raise MemraError(f"{model} is a file, not a model or a prompt; to read the prompt from it, use -f {model}")
    raise MemraError(f"{model!r} names a model, and no prompt came with it; usage: memra generate [MODEL] PROMPT "
                     f"(or -f FILE, or the prompt on standard input); to send it as the prompt, name the model "
                     f"first: memra generate demo {model!r}")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("memra")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def cmd_chat(args: argparse.Namespace) -> int:
    """A read-eval-print loop over the chat template, each turn a request to the engine. The engine keeps its
    prefix cache across turns, so a turn primes only what the last one did not (the previous answer comes
    back as prompt text and is primed: decode-written state is never reused, E8). Ctrl-C stops the reply
    (the chat goes on, the partial answer kept in the conversation); at the prompt it ends the chat."""
    from memra.chat_repl import chat_loop

    return chat_loop(args, load_model(args, args.model))


def cmd_inspect(args: argparse.Namespace) -> int:
    from memra.loading.checkpoint import inspect_checkpoint

    print(inspect_checkpoint(args.model))
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from memra.convert import convert
    from memra.loading.checkpoint import resolve_model_path

    out = convert(resolve_model_path(args.model), args.out, args.type)
    print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB, {args.type})")
    return 0


def cmd_eval_ppl(args: argparse.Namespace) -> int:
    from pathlib import Path

    from memra.evaluate import perplexity

    path = Path(args.file)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise MemraError(f"cannot read {path} as UTF-8 text ({e})") from None
    model = load_model(args, args.model)
    if args.ctx > model.cfg.max_position:
        raise MemraError(f"--ctx {args.ctx} exceeds the model's {model.cfg.max_position} positions")
    ids = model.tokenizer.encode(text, add_special=False)
    result = perplexity(model, ids, ctx=args.ctx)
    print(f"perplexity {result.ppl:.4f}  (mean NLL {result.nll:.4f} nats over {result.scored_tokens} tokens, "
          f"{result.windows} windows of {args.ctx})")
    if args.mtp:
        from memra.evaluate import mtp_agreement

        agreement = mtp_agreement(model, ids, ctx=args.ctx)
        print(f"MTP draft == model's greedy t+2 token at {agreement.rate:.1%} of {agreement.positions} positions")
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from memra.server.serve_command import cmd_serve

    return cmd_serve(args)


def _cmd_bench(args: argparse.Namespace) -> int:
    from memra.bench.command import cmd_bench

    return cmd_bench(args)


def _chosen(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The deepest subcommand parser `args` went through (`memra bench serve`: bench serve's)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and getattr(args, action.dest, None) in action.choices:
            return _chosen(action.choices[getattr(args, action.dest)], args)
    return parser


def main(argv: list[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else argv
    parser = build_parser(next((w for w in words if not w.startswith("-")), None))
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # argparse would print the top-level usage; the subcommand's says what it takes
        _chosen(parser, args).error(f"unrecognized arguments: {' '.join(unknown)}")
    commands = {"generate": cmd_generate, "inspect": cmd_inspect, "convert": cmd_convert, "eval-ppl": cmd_eval_ppl,
                "gate": cmd_gate, "chat": cmd_chat, "serve": _cmd_serve, "bench": _cmd_bench}
    try:
        return commands[args.command](args)
    except MemraError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a file or socket the user named: a full disk, a permission, a vanished path
        where = f" ({e.filename})" if getattr(e, "filename", None) else ""
        print(f"error: {e.strerror or e}{where}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
