"""`memra serve`: the flags, and the command that loads the model, builds the engine and runs the
HTTP server until SIGTERM / SIGINT (or, under torchrun, runs one pipeline rank)."""

from __future__ import annotations

import argparse
import sys

from memra.cli_common import add_load_args, dtype_of, add_spec_args, load_model, spec_config
from memra.errors import MemraError
from memra.server.reasoning import PARSERS
from memra.server.options import DEFAULT_MAX_BODY_MB
from memra.server.vllm_flags import add_vllm_flags, apply_vllm_flags, chat_template, generation_defaults
from memra.tools import FORMATS


def add_serve_parser(sub) -> None:
    srv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (continuous batching, streaming, /metrics) "
                                       "that takes vllm serve's common flags",
                         description="An OpenAI-compatible HTTP server. vllm serve's common flags work the same "
                                     "(docs/VLLM.md lists each one); memra's own names are aliases.")
    srv.add_argument("model", nargs="?", default=None,
                     help="a Hugging Face model directory, a .gguf file or a hub name ORG/NAME[:FILE.gguf] "
                          "(default: the bundled demo model); clients send it as given as the model's name.")
    add_load_args(srv)
    srv.add_argument("--host", default="127.0.0.1",
                     help="the address to listen on (default %(default)s; 0.0.0.0 for every interface).")
    srv.add_argument("--port", type=int, default=8000, help="the TCP port (default %(default)s).")
    srv.add_argument("--max-num-seqs", "--max-batch", dest="max_batch", type=int, metavar="N", default=32,
                     help="sequences running at once (default 32).")
    srv.add_argument("--max-model-len", "--max-ctx", dest="max_ctx", type=int, metavar="N", default=4096,
                     help="prompt + completion tokens per sequence (default 4096).")
    srv.add_argument("--max-waiting", type=int, default=256, help="queued requests before a 429 (default 256).")
    srv.add_argument("--max-num-batched-tokens", "--token-budget", dest="token_budget", type=int, metavar="N", default=2048,
                     help="tokens per engine step (default 2048).")
    srv.add_argument("--prefill-wait-steps", type=int, default=None,
                     help="while others decode, hold a new request up to this many steps so that several start "
                          "in one prefill (throughput for time to first token; 0: start each at once; default 0 "
                          "where the mixed step is a captured CUDA graph, else 8).")
    srv.add_argument("--prefill-group", type=int, default=None,
                     help="held requests that start together at once (default: max(2, max-batch / 8)).")
    srv.add_argument("--enable-prefix-caching", "--prefix-caching", dest="prefix_caching",
                     action=argparse.BooleanOptionalAction, default=True,
                     help="reuse the primed pages of earlier prompts, exactly (E8: the same tokens and logprobs as "
                          "without it); the --no- forms turn it off (default on).")
    srv.add_argument("--api-key", default=None,
                     help="require Authorization: Bearer KEY on every route but /health and /v1/models "
                          "(visible in the process list: prefer --api-key-file or $MEMRA_API_KEY).")
    srv.add_argument("--api-key-file", default=None, help="read the API key from this file.")
    srv.add_argument("--max-body-mb", type=float, default=DEFAULT_MAX_BODY_MB,
                     help=f"the largest request body in MiB; bigger ones get a 413 (default {DEFAULT_MAX_BODY_MB:g}).")
    srv.add_argument("--shutdown-timeout", type=float, default=30.0,
                     help="seconds in-flight requests get to finish on SIGTERM before they are ended with an "
                          "error (default 30).")
    srv.add_argument("--allowed-origins", default=None,
                     help="browser origins allowed to call the API (CORS), comma-separated or as vLLM's JSON list; "
                          "'*' = any (default: none).")
    srv.add_argument("--disable-log-requests", action="store_true",
                     help="write no access-log line per request on stderr.")
    srv.add_argument("--reasoning-parser", choices=sorted(PARSERS), default=None,
                     help="split chat answers' <think>...</think> into reasoning_content, as vLLM's parser of that "
                          "name does (default: none; the text stays whole).")
    srv.add_argument("--tool-call-parser", choices=sorted(FORMATS), default=None,
                     help="the format tool_choice auto reads calls in, as vLLM's parser of that name: hermes / qwen3 "
                          "(<tool_call> JSON), qwen3_xml / qwen3_coder (Qwen3.5's <function=...>), llama3_json "
                          "(default: the one the chat template teaches, if memra knows it).")
    srv.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                     help="the model names clients may send (answers carry the first; default: the model argument "
                          "as given).")
    add_spec_args(srv)
    srv.add_argument("--pipeline-parallel-size", "-pp", "--pp-size", dest="pp_size", type=int, metavar="N", default=None,
                     help="pipeline stages, one process each over torch.distributed: N >= 2 spawns ranks 1..N-1 on "
                          "this machine; under torchrun every rank runs this command and rank 0 serves HTTP "
                          "(default: 1, or torchrun's WORLD_SIZE).")
    add_vllm_flags(srv)


def _serving_model(args: argparse.Namespace):
    """The model, or with --pp-size N >= 2 (or under torchrun) a process-per-stage pipeline in its place
    (memra.pp.dist). Under torchrun only rank 0 returns: every other rank serves its stage inside this
    call until rank 0 shuts the pipeline down, then exits with the worker's code."""
    if args.pp_size is not None and args.pp_size < 1:
        raise MemraError(f"--pp-size must be >= 1, got {args.pp_size}")
    from memra.pp.dist_launch import launcher_world_size

    if (launcher_world_size() or 1) == 1 and (args.pp_size or 1) == 1:
        return load_model(args, args.model)
    if getattr(args, "settings", None) is not None:  # flags folded into this process's settings: the stages'
        # processes load from the environment, so they would not see them
        flag = "--enforce-eager" if args.enforce_eager else "--mamba-ssm-cache-dtype"
        raise MemraError(f"{flag} is not supported with a process pipeline (--pp-size, torchrun): set its variable "
                         "in the environment, which every stage reads (MEMRA_CUDA_GRAPHS=0, MEMRA_GDN_STATE_DTYPE)")
    from memra.pp.dist import pipeline_for_serving

    return pipeline_for_serving(args.model, args.pp_size or 0, args.device, dtype_of(args.dtype))


def _orderly_stop_exits_zero() -> None:
    """Rank 0 under torchrun: the signal uvicorn re-raises after its orderly stop lands here and is
    dropped, so the command returns 0. torchrun counts a rank that died by a signal as the whole job
    failing (and SIGTERMs the other ranks while they are still exiting in order)."""
    import signal

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)


def _origins(value: str | None) -> tuple[str, ...]:
    """--allowed-origins: comma-separated, or vLLM's JSON list (["*"])."""
    import json

    if value is not None and value.strip().startswith("["):
        try:
            listed = json.loads(value)
        except ValueError as e:
            raise MemraError(f"--allowed-origins is neither a JSON list nor comma-separated ({e})") from None
        if not isinstance(listed, list) or not all(isinstance(o, str) for o in listed):
            raise MemraError("--allowed-origins as JSON must be a list of strings")
        return tuple(o.strip() for o in listed if o.strip())
    return tuple(o.strip() for o in (value or "").split(",") if o.strip())


def cmd_serve(args: argparse.Namespace) -> int:
    from memra import settings as memra_settings
    from memra.pp.dist_driver import DistPipeline
    from memra.pp.dist_launch import launcher_rank
    from memra.server.api import build_app
    from memra.engine.engine import Engine
    from memra.engine.types import EngineConfig
    from memra.server.http import HttpServer, bind
    from memra.server.metrics import Metrics
    from memra.server.options import ServerOptions, resolve_api_key

    apply_vllm_flags(args)
    cfg = EngineConfig(max_batch=args.max_batch, max_ctx=args.max_ctx, token_budget=args.token_budget,
                       max_waiting=args.max_waiting, prefill_wait_steps=args.prefill_wait_steps,
                       prefill_group=args.prefill_group, speculative=spec_config(args),
                       prefix_caching=args.prefix_caching)
    if not 0 < args.port < 65536:
        raise MemraError(f"--port must be in 1..65535, got {args.port}")
    if not 0 < args.max_body_mb <= 1024:
        raise MemraError(f"--max-body-mb must be in (0, 1024], got {args.max_body_mb:g}")
    options = ServerOptions(api_key=resolve_api_key(args.api_key, args.api_key_file, memra_settings.api_key()),
                            max_body_bytes=int(args.max_body_mb * (1 << 20)), shutdown_timeout=args.shutdown_timeout,
                            allowed_origins=_origins(args.allowed_origins),
                            log_requests=not args.disable_log_requests, reasoning_parser=args.reasoning_parser,
                            tool_call_parser=args.tool_call_parser, seed=args.seed,
                            sampling_defaults=tuple(generation_defaults(args).items()))
    template = chat_template(args.chat_template)
    # The port before the model: a port in use is a one-line error now, not after minutes of loading.
    # Under torchrun only rank 0 serves HTTP; the other ranks serve their stage inside _serving_model.
    sock = bind(args.host, args.port) if launcher_rank() in (None, 0) else None
    model = _serving_model(args)
    pipe = model if isinstance(model, DistPipeline) else None  # its workers must be shut down on every exit
    try:
        if model.tokenizer is None:
            raise MemraError(f"{args.model}: the server needs a tokenizer and this checkpoint has none")
        if template is not None:
            model.tokenizer.chat_template = template
        names = tuple(args.served_model_name or (str(args.model),))  # as vLLM: the argument as given
        name = names[0]
        metrics = Metrics(name)
        engine = Engine(model, cfg, metrics)
    except BaseException:
        if pipe is not None:
            pipe.shutdown()
        raise

    def done() -> None:
        workers = f"; pipeline workers exited {pipe.exit_codes}" if pipe is not None and pipe.workers is not None else ""
        print(f"memra serve: drained and stopped after {engine.steps} engine steps{workers}", file=sys.stderr)

    app = build_app(engine, names, options, metrics=metrics, on_shutdown=done)
    print(f"memra serve: {name} ({model.cfg.arch}, {model.device}, {model.dtype}) on http://{args.host}:{args.port}",
          file=sys.stderr)
    print(f"memra serve: {engine.backend.describe()}", file=sys.stderr)
    if cfg.speculative is not None:
        s = cfg.speculative
        print(f"memra serve: speculative decoding: {s.method}, draft k={s.k}{' (dynamic)' if s.dynamic_k else ''}; "
              "a request opts out with \"speculative\": false", file=sys.stderr)
    if pipe is not None:
        print(f"memra serve: {pipe.n_stages} pipeline stages ({pipe.dist_cfg.backend}):", file=sys.stderr)
        for line in pipe.description.splitlines():
            print(f"  {line}", file=sys.stderr)
    # On SIGINT/SIGTERM the engine drains for --shutdown-timeout (then ends what is left with an error),
    # the app's shutdown stops it (a pipeline's workers exit 0), and uvicorn re-raises the signal so the
    # exit status says how the server ended — except on rank 0 under torchrun, where it exits 0.
    if pipe is not None and pipe.workers is None:
        _orderly_stop_exits_zero()
    try:
        HttpServer(app, log_level=args.uvicorn_log_level).run(sockets=[sock])
    finally:
        if pipe is not None:
            pipe.shutdown()  # idempotent; here for exits that skipped the app's shutdown
    return 0
