"""The `memra bench` command line: `memra bench serve` (load-test a server, memra.bench.serve_client),
`memra bench model` (tokens/s against the roofline and HF, memra.bench.model_bench) and `memra bench
throughput` (an offline batch through memra.LLM, memra.bench.throughput) — their flags,
the config each builds from them, and the exit code each run earns.

memra.cli wires this in (add_bench_parser, cmd_bench); nothing here imports memra.cli, so the command
line and the benchmarks stay one-way.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Sequence

from memra import settings as memra_settings
from memra.bench.config import BenchConfig, default_device
from memra.bench.serve_checks import (check_against_offline, check_metrics, engine_time, list_models, memra_offline,
                                      scrape_metrics)
from memra.bench.serve_client import auto_client_processes, run_serve_bench
from memra.bench.serve_launch import launch_server
from memra.cli_common import BENCH_HELP, add_spec_args, spec_config
from memra.bench.serve_report import ServeBenchConfig
from memra.errors import MemraError


def add_bench_parser(sub) -> None:
    """`memra bench serve ...` and `memra bench model ...` on the CLI's subparsers (memra.cli wires it;
    `python -m memra bench ...` runs the same)."""
    bench = sub.add_parser("bench", help=BENCH_HELP)
    kinds = bench.add_subparsers(dest="bench_command", required=True, metavar="{serve,model,throughput}")
    p = kinds.add_parser("serve", help="load-test an OpenAI-compatible server; checks that no request is lost")
    d = ServeBenchConfig()
    p.add_argument("url", nargs="?", default="http://127.0.0.1:8000", help="server root (default %(default)s)")
    p.add_argument("--launch", metavar="MODEL", default=None,
                   help="start `memra serve MODEL` in a process of its own on a free loopback port, test it, "
                        "stop it, then check every answer against offline generation ('demo' is the bundled model).")
    p.add_argument("--max-batch", type=int, default=32, help="the server's --max-batch (with --launch).")
    p.add_argument("--max-ctx", type=int, default=1024, help="the server's --max-ctx (with --launch).")
    add_spec_args(p, " (with --launch: the server's)")
    p.add_argument("--model", default=None, help="model name to send (default: the first one /v1/models lists)")
    p.add_argument("--requests", type=int, default=d.requests, help="requests to send (default %(default)s)")
    p.add_argument("--concurrency", type=int, default=d.concurrency, help="requests in flight at once (default %(default)s)")
    p.add_argument("--client-processes", type=int, default=None,
                   help="processes sending the load, sharing the concurrency (default: one per 16 concurrent "
                        "requests, on at most half of this machine's cores)")
    p.add_argument("--cancel-fraction", type=float, default=d.cancel_fraction,
                   help="share of requests closed mid-stream (default %(default)s)")
    p.add_argument("--stream-fraction", type=float, default=d.stream_fraction,
                   help="share of requests that stream their answer (default %(default)s)")
    p.add_argument("--min-prompt-words", type=int, default=d.min_prompt_words, help="shortest prompt, in words (default %(default)s)")
    p.add_argument("--max-prompt-words", type=int, default=d.max_prompt_words, help="longest prompt, in words (default %(default)s)")
    p.add_argument("--min-tokens", type=int, default=d.min_tokens, help="fewest tokens a request asks for (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="most tokens a request asks for (default %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the synthetic workload (default %(default)s)")
    p.add_argument("--timeout", type=float, default=d.timeout_s, help="per-request bound in seconds")
    p.add_argument("--api-key", default=memra_settings.api_key(), help="bearer token (default $MEMRA_API_KEY)")
    p.add_argument("--no-metrics", action="store_true", help="skip the /metrics check (a server without it)")
    p.add_argument("--metrics-prefix", default="memra:", help="counter prefix, e.g. vllm: (default %(default)s)")
    p.add_argument("--offline-check", metavar="MODEL", default=None,
                   help="afterwards, generate every completed prompt offline with this model and compare")
    p.add_argument("--no-offline-check", action="store_true",
                   help="with --launch: skip comparing every completed answer with offline generation")
    p.add_argument("--device", default=None, help="device for --offline-check")
    p.add_argument("--dtype", default=None, help="dtype for --offline-check")
    p.add_argument("--json", metavar="PATH", default=None, help="write the report (per request too) as JSON")
    add_model_parser(kinds)
    add_throughput_parser(kinds)


def cmd_bench(args: argparse.Namespace) -> int:
    """serve: exit 0 when nothing was lost, duplicated or failed and every check passed; 1 otherwise.
    model: cmd_model (exit 1 when a cell failed)."""
    if args.bench_command == "model":
        return cmd_model(args)
    if args.bench_command == "throughput":
        return cmd_throughput(args)
    cfg = ServeBenchConfig(requests=args.requests, concurrency=args.concurrency, cancel_fraction=args.cancel_fraction,
                           min_prompt_words=args.min_prompt_words, max_prompt_words=args.max_prompt_words,
                           min_tokens=args.min_tokens, max_tokens=args.max_tokens,
                           stream_fraction=args.stream_fraction, seed=args.seed, timeout_s=args.timeout,
                           client_processes=args.client_processes or auto_client_processes(args.concurrency))
    server = None
    if args.launch:
        server = launch_server(args.launch, max_batch=args.max_batch, max_ctx=args.max_ctx, device=args.device,
                               dtype=args.dtype, api_key=args.api_key, extra_args=_spec_flags(args))
        args.url = server.url
    try:
        return _bench(args, cfg, server)
    finally:
        if server is not None:
            server.stop()


def _spec_flags(args) -> tuple[str, ...]:
    """The server's speculative-decoding flags (checked here first: a bad one is refused before the launch)."""
    spec = spec_config(args)
    if spec is None:
        return ()
    return ("--speculative", spec.method, "--draft-k", str(spec.k)) + (("--dynamic-k",) if spec.dynamic_k else ())


def _bench(args, cfg: ServeBenchConfig, server) -> int:
    model = args.model
    if model is None:
        ids = list_models(args.url, args.api_key)
        if not ids:
            raise MemraError(f"{args.url} lists no models; pass --model")
        model = ids[0]
    before = None if args.no_metrics else scrape_metrics(args.url, args.api_key)
    report = asyncio.run(run_serve_bench(args.url, model, cfg, api_key=args.api_key, progress=True))
    print(report.table())
    problems = []
    if before is not None:
        after = scrape_metrics(args.url, args.api_key)
        for line in engine_time(before, after, report.wall_s, prefix=args.metrics_prefix):
            print(line)
        problems += check_metrics(before, after, report, prefix=args.metrics_prefix)
    if args.offline_check or (server is not None and not args.no_offline_check):
        if server is not None:
            server.stop()  # its memory back before the offline model loads
        target = args.offline_check or args.launch
        problems += check_against_offline(report, memra_offline(target, args.device, args.dtype, batched=True))
    for p in problems:
        print(f"check failed: {p}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({**report.to_json(per_request=True), "model": model, "check_failures": problems}, f, indent=1)
    return 0 if not (problems or report.lost or report.duplicated or report.errors) else 1


# --- memra bench model ---------------------------------------------------------------------------


def _int_list(text: str, what: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise MemraError(f"{what} {text!r} is not a comma-separated list of numbers") from None


def parse_layers(text: str | None, models: Sequence[str]) -> tuple[tuple[str, int], ...]:
    """--layers N (every model) or --layers name=N,name=N."""
    if not text:
        return ()
    try:
        if "=" not in text:
            return tuple((m, int(text)) for m in models)
        pairs = [p.split("=", 1) for p in text.split(",") if p.strip()]
        return tuple((k.strip(), int(v)) for k, v in pairs)
    except ValueError:
        raise MemraError(f"--layers {text!r}: give N, or name=N pairs separated by commas") from None


def add_model_parser(kinds) -> None:
    """`memra bench model` on the `memra bench` subparsers (add_bench_parser wires it)."""
    d = BenchConfig()
    p = kinds.add_parser("model", help="random-weight models of real shapes: decode/prefill tokens/s vs this "
                                       "device's roofline and HF transformers")
    p.add_argument("--models", default=",".join(d.models), help="comma-separated shapes (default: %(default)s)")
    p.add_argument("--batches", default=",".join(map(str, d.batches)), help="decode batch widths (default %(default)s)")
    p.add_argument("--layers", default=None, help="build with fewer layers: N for every model, or name=N,...")
    p.add_argument("--device", default=None, help="cuda (default where available) or cpu")
    p.add_argument("--weights", default=d.weights, help="weight format: bf16 | q8_0 | q4_k (projections packed, fused dequant kernels)")
    p.add_argument("--modes", default=",".join(d.exact_modes),
                   help="exact and/or fast (MEMRA_EXACT=0); engine (the loop memra generate / memra.LLM / the server "
                        "run) and newcache (decode_step_batch over model.new_cache caches), timed beside exact")
    p.add_argument("--steps", type=int, default=d.decode_steps, help="timed decode steps per cell")
    p.add_argument("--warmup", type=int, default=d.warmup, help="untimed decode steps first")
    p.add_argument("--repeats", type=int, default=d.repeats, help="prefill/TTFT/probe repeats (best of)")
    p.add_argument("--prefill-chunk", type=int, default=d.prefill_chunk, help="prompt tokens per timed prefill chunk (default %(default)s)")
    p.add_argument("--ttft-tokens", type=int, default=d.ttft_tokens, help="prompt length of the time-to-first-token probe (default %(default)s)")
    p.add_argument("--prompt-tokens", type=int, default=d.prompt_tokens, help="each decode row's primed prompt")
    p.add_argument("--peer", default=",".join(d.peers),
                   help="HF transformers peers: hf (generate, dynamic cache) and/or hf-static "
                        "(cache_implementation='static', which compiles the forward on a GPU)")
    p.add_argument("--no-hf", action="store_true", help="no HF peer at all")
    p.add_argument("--budget", type=float, default=None, metavar="S",
                   help="start no cell after S seconds; the rest are recorded as skipped")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the synthetic workload (default %(default)s)")
    p.add_argument("--json", metavar="PATH", default=None, help="write the report as JSON")
    p.add_argument("--gguf", metavar="FILE", default=None,
                   help="instead: this GGUF on the CPU, memra (memra.LLM, B=1, --steps tokens) beside llama.cpp "
                        "where llama_cpp is importable: load time, resident memory against the file size, decode tok/s")
    p.add_argument("--threads", default=None, metavar="N[,N...]",
                   help="with --gguf: CPU threads for both engines, one run per count, 'all' = every core "
                        "(default torch's)")
    p.add_argument("--batch", type=int, default=1, metavar="B",
                   help="with --gguf: also decode B rows at once, beside llama.cpp's batched decode (default 1: B=1 only)")
    p.add_argument("--gguf-repeats", type=int, default=None, metavar="R",
                   help="with --gguf: run each engine R times a cell, alternating, and keep the fastest (default 1)")
    p.add_argument("--omp-wait", choices=("passive", "active", "default"), default=None,
                   help="with --gguf: OMP_WAIT_POLICY of both engines' processes (default passive; 'default': inherited)")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    models = tuple(m.strip() for m in args.models.split(",") if m.strip())
    return BenchConfig(models=models, batches=_int_list(args.batches, "--batches"),
                       layers=parse_layers(args.layers, models), device=args.device or default_device(),
                       weights=args.weights, exact_modes=tuple(m.strip() for m in args.modes.split(",") if m.strip()),
                       decode_steps=args.steps, warmup=args.warmup, repeats=args.repeats,
                       prefill_chunk=args.prefill_chunk, ttft_tokens=args.ttft_tokens,
                       prompt_tokens=args.prompt_tokens, budget_s=args.budget,
                       peers=() if args.no_hf else tuple(p.strip() for p in args.peer.split(",") if p.strip()),
                       seed=args.seed, json_path=args.json)


def _thread_counts(spec: str | None) -> tuple[int, ...] | None:
    """--threads '1,2,all' -> (1, 2, cores); None: the bench's default."""
    if spec is None:
        return None
    import os

    counts = []
    for word in spec.split(","):
        word = word.strip()
        if word == "all":
            counts.append(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
        elif word.isdigit() and int(word) > 0:
            counts.append(int(word))
        else:
            raise MemraError(f"--threads: {word!r} is not a positive count or 'all'")
    return tuple(dict.fromkeys(counts))


def cmd_model(args: argparse.Namespace) -> int:
    """Exit 0 when every cell ran or was skipped for the budget; 1 when any failed."""
    if args.gguf:
        from memra.bench.gguf_file import gguf_table, run_gguf_bench

        runs = run_gguf_bench(args.gguf, args.steps, _thread_counts(args.threads), args.batch,
                              log=lambda line: print(line, file=sys.stderr, flush=True), omp_wait=args.omp_wait or "passive",
                              repeats=args.gguf_repeats or 1)
        print(gguf_table(args.gguf, runs))
        return 1 if any(r.error and r.engine == "memra" for r in runs) else 0
    if args.threads is not None or args.batch != 1 or args.omp_wait is not None or args.gguf_repeats is not None:
        raise MemraError("--threads, --batch, --omp-wait and --gguf-repeats go with --gguf FILE (the CPU run beside "
                         "llama.cpp)")
    from memra.bench.model_bench import run_bench  # the driver pulls in every cell's module; only this needs it

    report = run_bench(config_from_args(args), log=lambda line: print(line, file=sys.stderr, flush=True))
    print(report.table())
    return 1 if report.failed else 0


# --- memra bench throughput ----------------------------------------------------------------------


def add_throughput_parser(kinds) -> None:
    """`memra bench throughput` on the `memra bench` subparsers (vLLM's benchmark_throughput convention)."""
    from memra.bench.throughput import ThroughputConfig, lengths_said

    d = ThroughputConfig()
    p = kinds.add_parser("throughput", help="offline batch throughput through memra.LLM.generate: N prompts at "
                                            "once, output and total tokens/s, the engine's step mix")
    p.add_argument("model", nargs="?", default=d.model,
                   help="HF directory, .gguf, demo or random:SHAPE (default %(default)s)")
    p.add_argument("--num-prompts", type=int, default=d.num_prompts, help="requests (default %(default)s)")
    p.add_argument("--structured", default=None, metavar="KIND",
                   help="hold every request to a grammar: json_object, regex:PATTERN or json:SCHEMA (the run "
                        "beside one without it gives the grammar's cost per token)")
    p.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="every request asks for its tokens' logprobs and the top N (0: the chosen token's only), as "
                        "an RL sampler does")
    p.add_argument("--dataset", default=None, metavar="JSONL",
                   help='requests from a file, one {"prompt" or "prompt_token_ids", "output_len"} a line; '
                        f"default: synthetic, lengths {lengths_said()}")
    p.add_argument("--input-len", type=int, default=None, help="every synthetic prompt this long")
    p.add_argument("--output-len", type=int, default=None, help="every request generates this many tokens")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the synthetic workload (default %(default)s)")
    p.add_argument("--temperature", type=float, default=d.temperature,
                   help="sampling temperature, each request seeded with seed + its index (default %(default)s)")
    p.add_argument("--max-batch", type=_batch, default=d.max_batch,
                   help="sequences decoded at once, or auto: the largest graph bucket whose sequences (the "
                        "workload's mean length) fit the KV memory, at most 768 (default %(default)s)")
    p.add_argument("--prefill-budget", type=int, default=None, metavar="N",
                   help="prompt tokens a step takes apart from its decode rows (the scheduler's split budget), or "
                        "0: shared with them; default: the largest captured mixed-step bucket (512, or "
                        "MEMRA_MIXED_TOKENS) at max_batch >= 256 where mixed steps are captured graphs (CUDA), so "
                        "each stays one replayed forward, else shared")
    p.add_argument("--variants", default=None, metavar="LIST",
                   help="run several MAX_BATCH[/PREFILL_BUDGET] settings on one loaded model, one after the "
                        "other, and print one table, e.g. 256,256/0,512,auto/0,auto (/0: a shared budget; overrides "
                        "--max-batch and --prefill-budget)")
    p.add_argument("--kv-fraction", type=float, default=d.kv_fraction,
                   help="share of the free device memory the KV pool may take (default %(default)s)")
    p.add_argument("--device", default=None, help="cuda (default where available) or cpu")
    p.add_argument("--dtype", default=None, help="bfloat16 (CUDA default) | float16 | float32 (CPU default)")
    p.add_argument("--check", type=int, default=d.check,
                   help="re-run this many requests alone and compare their tokens (default %(default)s)")
    p.add_argument("--json", metavar="PATH", default=None, help="write the report as JSON")


def cmd_throughput(args: argparse.Namespace) -> int:
    """Exit 1 when a checked request differed alone, or a request ended before its length."""
    from memra.bench.throughput import ThroughputConfig, run_throughput
    from memra.bench.throughput_variants import parse_variants, run_variants, variants_table

    variants = parse_variants(args.variants) if args.variants is not None else None  # a bad list: before the load
    cfg = ThroughputConfig(model=args.model, num_prompts=args.num_prompts, dataset=args.dataset,
                           input_len=args.input_len, output_len=args.output_len, seed=args.seed,
                           temperature=args.temperature, max_batch=args.max_batch, kv_fraction=args.kv_fraction,
                           device=args.device or default_device(), dtype=args.dtype, check=args.check,
                           json_path=args.json, structured=args.structured, prefill_budget=args.prefill_budget,
                           logprobs=args.logprobs)
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    reports = run_variants(cfg, variants, log) if variants else [run_throughput(cfg, log)]
    print(variants_table(reports) if variants else reports[0].table())
    if variants and args.json:
        Path(args.json).write_text(json.dumps([r.to_json() for r in reports], indent=1), encoding="utf-8")
    return 1 if any(r.check_failures or r.length_failures for r in reports) else 0


def _batch(text: str) -> int | str:
    """--max-batch: a positive integer or auto."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer or auto") from None
