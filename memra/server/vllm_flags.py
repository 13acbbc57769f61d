"""`vllm serve`'s flags on `memra serve`: each one works as it does in vLLM, or is refused in one line that
names it and says what memra offers instead (docs/VLLM.md lists every one). memra's own names for the
same settings stay as aliases (--max-ctx for --max-model-len, ...); those are declared in
memra.server.serve_command next to the rest of memra's flags.

    add_vllm_flags(parser)   the flags memra declares only for vLLM's command lines
    apply_vllm_flags(args)   their refusals, and what the accepted ones set on `args`
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from memra.errors import MemraError
from memra.settings import Settings, gdn_state_choice

UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
# vLLM's speculative methods that draw from the checkpoint's own MTP head
_MTP_METHODS = {"mtp", "deepseek_mtp", "qwen3_next_mtp", "glm4_moe_mtp", "ernie_mtp", "mimo_mtp"}
# generation_config.json keys that become the server's sampling defaults (as vLLM's --generation-config)
_GENERATION_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                    "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}

# flags that take a value and are refused whatever it is: (flag, why). The value is read so that the error
# names the flag rather than argparse's "unrecognized arguments".
_REFUSED = (
    ("--tokenizer", "memra reads the tokenizer from the checkpoint itself; point the model argument at a "
                    "directory that holds both"),
    ("--revision", "memra loads a hub model's default revision; download the revision you want and serve its "
                   "directory"),
    ("--tokenizer-revision", "memra reads the tokenizer from the checkpoint itself"),
    ("--code-revision", "memra never runs a checkpoint's code"),
    ("--download-dir", "memra uses the Hugging Face cache (set HF_HOME to move it)"),
    ("--quantization", "memra reads the quantization from the checkpoint (GGUF, FP8, NVFP4); serve a quantized file"),
    ("--block-size", "memra's KV block size is fixed"),
    ("--swap-space", "memra's preemption swaps to host memory without a fixed reserve"),
    ("--max-logprobs", "memra's limit on logprobs is fixed (memra.sampling.MAX_LOGPROBS)"),
    ("--hf-overrides", "memra serves the checkpoint's config as it is"),
    ("--lora-modules", "memra has no LoRA adapters"),
    ("--ssl-keyfile", "memra serves plain HTTP; put a TLS proxy in front of it"),
    ("--ssl-certfile", "memra serves plain HTTP; put a TLS proxy in front of it"),
    ("--root-path", "memra serves at the root path; let the proxy strip the prefix"),
    ("--distributed-executor-backend", "memra's pipeline stages run over torch.distributed (--pipeline-parallel-size)"),
)


def add_vllm_flags(srv: argparse.ArgumentParser) -> None:
    srv.add_argument("--model", dest="model_flag", default=None, metavar="MODEL",
                     help="the model, as vLLM's older --model flag names it (the same as the model argument).")
    srv.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="F",
                     help="the share of the GPU's whole memory this server may take, weights included, as in vLLM; "
                          "the KV cache gets what is left after the weights (on CPU: a share of the available "
                          "RAM, as --kv-fraction). Default: --kv-fraction of the free memory.")
    srv.add_argument("--seed", type=int, default=None,
                     help="seed the stream from which requests without a seed draw theirs, so a run of the same "
                          "requests in the same order repeats (default: a fresh random stream).")
    srv.add_argument("--enforce-eager", action="store_true",
                     help="never replay captured CUDA graphs, as in vLLM (the same tokens, only slower).")
    srv.add_argument("--chat-template", default=None,
                     help="a Jinja chat template, as a file or as the template text itself, used instead of the "
                          "checkpoint's.")
    srv.add_argument("--generation-config", default="vllm",
                     help="where requests' sampling defaults come from: 'vllm' (the default here: none but the "
                          "OpenAI defaults), 'auto' (the checkpoint's generation_config.json, vLLM's default) or a "
                          "directory holding a generation_config.json.")
    srv.add_argument("--override-generation-config", default=None, metavar="JSON",
                     help="sampling defaults as a JSON object (e.g. '{\"temperature\": 0.5}'), on top of "
                          "--generation-config's, as in vLLM.")
    srv.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                     help="only 1: memra splits a model across GPUs by layers; use --pipeline-parallel-size.")
    srv.add_argument("--data-parallel-size", "-dp", type=int, default=1, metavar="N",
                     help="only 1: run one memra serve per GPU behind a load balancer instead.")
    srv.add_argument("--trust-remote-code", action="store_true",
                     help="accepted and without effect: memra never runs code from a checkpoint.")
    srv.add_argument("--uvicorn-log-level", default="warning", choices=UVICORN_LOG_LEVELS,
                     help="uvicorn's own log level (default %(default)s; memra's access log is --disable-log-requests').")
    srv.add_argument("--enable-log-requests", action="store_true",
                     help="accepted: memra logs one line per request unless --disable-log-requests is given.")
    srv.add_argument("--disable-log-stats", action="store_true",
                     help="accepted and without effect: memra logs no periodic statistics (see /metrics).")
    srv.add_argument("--enable-auto-tool-choice", action="store_true",
                     help="accepted: tool_choice auto is on wherever memra knows the model's call format "
                          "(--tool-call-parser, or the one the chat template teaches).")
    srv.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                     help="memra always splits long prompts into chunks of --max-num-batched-tokens; the "
                          "negation is refused.")
    srv.add_argument("--speculative-config", default=None, metavar="JSON",
                     help="vLLM's speculative decoding as JSON: {\"method\": \"ngram\" or \"mtp\", "
                          "\"num_speculative_tokens\": K}, the same as --speculative METHOD --draft-k K.")
    srv.add_argument("--kv-cache-dtype", default="auto", help="only auto: the KV cache keeps the model's dtype.")
    srv.add_argument("--mamba-ssm-cache-dtype", default="auto", metavar="DTYPE",
                     help="what GDN layers' recurrent state is stored in: auto (the checkpoint's mamba_ssm_dtype, "
                          "else float32), float32 or bfloat16 (MEMRA_GDN_STATE_DTYPE).")
    srv.add_argument("--load-format", default="auto", help="only auto: memra reads safetensors and GGUF files.")
    srv.add_argument("--response-role", default="assistant", help="only assistant: the role of chat answers.")
    srv.add_argument("--chat-template-content-format", default="auto",
                     help="auto or string: messages reach the chat template with their content as one string.")
    srv.add_argument("--disable-uvicorn-access-log", action="store_true",
                     help="the same as --disable-log-requests (memra's access log replaces uvicorn's).")
    for flag, _why in _REFUSED:
        srv.add_argument(flag, dest="refused_" + flag[2:].replace("-", "_"), default=None, help=argparse.SUPPRESS)
    srv.add_argument("--enable-lora", dest="refused_enable_lora", action="store_const", const="on",
                     help=argparse.SUPPRESS)


def apply_vllm_flags(args: argparse.Namespace) -> None:
    """Refuse what memra does not do (MemraError, one line naming the flag) and fold the accepted flags
    into memra's own settings on `args`."""
    if args.refused_tokenizer in (args.model, args.model_flag):
        args.refused_tokenizer = None  # the model's own tokenizer: what memra reads anyway
    for flag, why in _REFUSED + (("--enable-lora", "memra has no LoRA adapters"),):
        if getattr(args, "refused_" + flag[2:].replace("-", "_")) is not None:
            raise MemraError(f"{flag} is not supported: {why}")
    if args.model_flag is not None:
        if args.model not in (None, args.model_flag):
            raise MemraError(f"the model is given twice ({args.model} and --model {args.model_flag}); give it once")
        args.model = args.model_flag
    if args.model is None:
        args.model = "demo"
    if args.tensor_parallel_size != 1:
        raise MemraError(f"--tensor-parallel-size {args.tensor_parallel_size} is not supported: memra has no tensor "
                         "parallelism; split the model by layers with --pipeline-parallel-size N")
    if args.data_parallel_size != 1:
        raise MemraError(f"--data-parallel-size {args.data_parallel_size} is not supported: run one memra serve "
                         "per GPU (CUDA_VISIBLE_DEVICES) behind a load balancer")
    if not args.enable_chunked_prefill:
        raise MemraError("--no-enable-chunked-prefill is not supported: memra always prefills long prompts in "
                         "chunks of --max-num-batched-tokens (the tokens are the same either way)")
    for flag, value, allowed in (("--kv-cache-dtype", args.kv_cache_dtype, ("auto",)),
                                 ("--load-format", args.load_format, ("auto", "safetensors", "gguf")),
                                 ("--response-role", args.response_role, ("assistant",)),
                                 ("--chat-template-content-format", args.chat_template_content_format,
                                  ("auto", "string"))):
        if value not in allowed:
            raise MemraError(f"{flag} {value} is not supported: memra takes {' or '.join(allowed)}")
    if args.gpu_memory_utilization is not None and not 0 < args.gpu_memory_utilization <= 1:
        raise MemraError(f"--gpu-memory-utilization must be in (0, 1], got {args.gpu_memory_utilization:g}")
    if args.disable_uvicorn_access_log:
        args.disable_log_requests = True
    if args.speculative_config is not None:
        _speculative(args)
    state = gdn_state_choice(args.mamba_ssm_cache_dtype, "--mamba-ssm-cache-dtype")
    if args.enforce_eager or state != "auto":
        settings = Settings.from_env()
        args.settings = settings.replace(cuda_graphs=settings.cuda_graphs and not args.enforce_eager,
                                         gdn_state_dtype=settings.gdn_state_dtype if state == "auto" else state)


def _speculative(args: argparse.Namespace) -> None:
    try:
        spec = json.loads(args.speculative_config)
    except ValueError as e:
        raise MemraError(f"--speculative-config is not JSON ({e})") from None
    if not isinstance(spec, dict):
        raise MemraError("--speculative-config must be a JSON object")
    unknown = sorted(set(spec) - {"method", "num_speculative_tokens", "model"})
    if unknown:
        raise MemraError(f"--speculative-config {unknown[0]} is not supported: memra takes method and "
                         "num_speculative_tokens")
    method = spec.get("method") or ("ngram" if spec.get("model") in ("[ngram]", "ngram") else None)
    if method not in _MTP_METHODS | {"ngram"}:
        raise MemraError(f"--speculative-config method {method!r} is not supported: memra drafts with ngram or "
                         "the checkpoint's MTP head (mtp); a separate draft model is not supported")
    if args.speculative is not None:
        raise MemraError("give --speculative-config or --speculative, not both")
    args.speculative = "ngram" if method == "ngram" else "mtp"
    k = spec.get("num_speculative_tokens", 4)
    if type(k) is not int:
        raise MemraError("--speculative-config num_speculative_tokens must be an integer")
    args.draft_k = k


def chat_template(value: str | None) -> str | None:
    """--chat-template: a file's text, or the value itself where it is template text (as vLLM reads it)."""
    if value is None:
        return None
    path = Path(value)
    if "{" not in value and not path.is_file():
        raise MemraError(f"--chat-template {value}: no such file, and it is not template text")
    if "{" in value and not path.is_file():
        return value
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise MemraError(f"--chat-template {value}: cannot read it ({e})") from None


def _model_dir(model: str) -> Path | None:
    """The model's directory, where --generation-config auto finds generation_config.json (None: a file)."""
    if model.startswith("random:") or model.endswith(".gguf"):
        return None
    from memra.loading.checkpoint import resolve_model_path

    path = Path(resolve_model_path(model))
    return path if path.is_dir() else None


def generation_defaults(args: argparse.Namespace) -> dict:
    """The requests' sampling defaults that --generation-config and --override-generation-config give
    ({field: value} of the request body's names), as vLLM applies them to fields a request leaves out."""
    source = args.generation_config
    found: dict = {}
    if source != "vllm":
        folder = _model_dir(args.model) if source == "auto" else Path(source)
        if source != "auto" and not folder.is_dir():
            raise MemraError(f"--generation-config {source}: not 'auto', 'vllm' or a directory")
        file = folder / "generation_config.json" if folder is not None else None
        if file is not None and file.is_file():
            try:
                raw = json.loads(file.read_text(encoding="utf-8"))
            except (OSError, ValueError) as e:
                raise MemraError(f"--generation-config: cannot read {file} ({e})") from None
            found = {_GENERATION_KEYS[k]: v for k, v in raw.items() if k in _GENERATION_KEYS}
        elif source != "auto":
            raise MemraError(f"--generation-config {source}: the directory has no generation_config.json")
    if args.override_generation_config is not None:
        try:
            extra = json.loads(args.override_generation_config)
        except ValueError as e:
            raise MemraError(f"--override-generation-config is not JSON ({e})") from None
        if not isinstance(extra, dict) or set(extra) - set(_GENERATION_KEYS):
            raise MemraError(f"--override-generation-config takes an object of {', '.join(sorted(_GENERATION_KEYS))}")
        found.update({_GENERATION_KEYS[k]: v for k, v in extra.items()})
    return found
