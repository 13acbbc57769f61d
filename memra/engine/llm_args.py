"""vLLM's LLM(...) arguments in memra's terms: each one memra has works under vLLM's name, each one that
cannot change what memra does is accepted (and docs/VLLM.md says why), and each one memra cannot honour
is refused in one line that names it as an LLM argument and says what memra offers instead. Nothing
reaches memra.load() that it does not take, so no TypeError ever names an internal function."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from memra.cache import BLOCK_SIZE
from memra.errors import MemraError
from memra.sampling import MAX_LOGPROBS
from memra.settings import Settings, gdn_state_choice
from memra.spec import SpecConfig

# memra.load()'s own options, which LLM passes on when it loads the model
LOAD_OPTIONS = ("check_tensors", "packed_weights", "kv_budget", "settings")

# accepted: they cannot change what memra computes (why, in docs/VLLM.md)
NO_EFFECT = {"trust_remote_code", "swap_space", "max_seq_len_to_capture", "disable_custom_all_reduce",
             "disable_async_output_proc", "disable_log_stats", "enable_chunked_prefill", "async_scheduling",
             "max_cudagraph_capture_size"}

# refused unless given their no-op value: name -> (no-op values, what memra offers instead)
REFUSED: dict[str, tuple[tuple, str]] = {
    "tensor_parallel_size": ((1,), "memra splits a model by layers, not tensors: pipeline stages, "
                                   "`memra serve MODEL --pp-size N` (docs/PIPELINE.md)"),
    "pipeline_parallel_size": ((1,), "memra.LLM runs on one device; pipeline stages run under `memra serve "
                                     "MODEL --pp-size N` (docs/PIPELINE.md)"),
    "data_parallel_size": ((1,), "run one memra.LLM per device"),
    "distributed_executor_backend": ((None, "uni", "mp"), "memra.LLM runs in this process"),
    "quantization": ((None,), "memra reads the quantization from the checkpoint itself (GGUF, FP8, NVFP4); "
                              "leave it unset"),
    "kv_cache_dtype": (("auto",), "memra keeps the KV cache in the model's dtype (its exactness needs the "
                                  "same bits in every path)"),
    "block_size": ((None, BLOCK_SIZE), f"memra's KV pages hold {BLOCK_SIZE} tokens, fixed"),
    "cpu_offload_gb": ((0,), "memra keeps every weight on the device; use a quantized GGUF or a smaller dtype"),
    "tokenizer_mode": (("auto", "hf"), "memra has one tokenizer, read from tokenizer.json or the GGUF"),
    "skip_tokenizer_init": ((False,), "use memra.load(path, tokenizer=False) and the model's prime / "
                                      "decode_step instead"),
    "revision": ((None,), "download that revision first (huggingface-cli download ORG/NAME --revision R) "
                          "and pass its folder"),
    "tokenizer_revision": ((None,), "memra reads the tokenizer that comes with the model"),
    "download_dir": ((None,), "set HF_HUB_CACHE (huggingface_hub reads it)"),
    "hf_token": ((None, True), "set HF_TOKEN (huggingface_hub reads it)"),
    "hf_overrides": ((None, {}), "edit the checkpoint's config.json instead"),
    "load_format": (("auto", "safetensors", "gguf"), "memra loads safetensors folders and GGUF files"),
    "task": (("auto", "generate"), "memra.LLM generates text; LLM.score gives logprobs"),
    "runner": (("auto", "generate"), "memra.LLM generates text; LLM.score gives logprobs"),
    "allowed_local_media_path": (("",), "memra runs text-only models"),
    "mm_processor_kwargs": ((None,), "memra runs text-only models"),
    "limit_mm_per_prompt": ((None, {}), "memra runs text-only models"),
    "enable_lora": ((False,), "memra serves no adapters; merge the LoRA into the weights first"),
    "compilation_config": ((None,), "memra compiles its own kernels; enforce_eager=True turns CUDA graphs off"),
    "logprobs_mode": (("raw_logprobs",), "memra's logprobs are the raw model's (vLLM's default)"),
}


@dataclass(frozen=True)
class LLMArgs:
    """What LLM needs from its arguments once vLLM's names are read: memra.load's options (when LLM loads
    the model) and the engine's knobs."""

    load_options: dict
    token_budget: int | None
    speculative: SpecConfig | None
    max_logprobs: int


def read_args(options: dict, *, dtype, tokenizer, model, enforce_eager: bool, max_num_batched_tokens,
              speculative, speculative_config, max_logprobs, generation_config) -> LLMArgs:
    """Sort LLM's keyword arguments (`options`: those LLM does not name itself) and check vLLM's."""
    load, state = {}, "auto"
    for name, value in options.items():
        if name in LOAD_OPTIONS:
            load[name] = value
        elif name == "mamba_ssm_cache_dtype":
            state = gdn_state_choice(value, "LLM(mamba_ssm_cache_dtype=...)")
        elif name in REFUSED:
            noop, instead = REFUSED[name]
            if not any(value is v or (type(value) is type(v) and value == v) for v in noop):
                raise MemraError(f"LLM({name}={value!r}) is not supported: {instead}")
        elif name not in NO_EFFECT:
            raise MemraError(f"LLM got an unknown argument {name!r}; docs/VLLM.md lists what memra.LLM takes")
    if state != "auto":  # vLLM's --mamba-ssm-cache-dtype: how the GDN state is stored, fixed when LLM loads the model
        if not isinstance(model, (str, Path)):
            raise MemraError("LLM(mamba_ssm_cache_dtype=...) applies when LLM loads the model; load it with "
                             f"memra.load(..., settings=Settings(gdn_state_dtype={state!r})) instead")
        load["settings"] = (load.get("settings") or Settings.from_env()).replace(gdn_state_dtype=state)
    load["dtype"] = {"auto": None, "half": "float16", "float": "float32"}.get(dtype, dtype) if isinstance(dtype, str) else dtype
    if enforce_eager not in (True, False):
        raise MemraError(f"LLM(enforce_eager=...) must be True or False, got {enforce_eager!r}")
    if generation_config not in ("auto", "vllm", None):
        raise MemraError(f"LLM(generation_config={generation_config!r}) is not supported: memra reads the model's "
                         "own generation_config.json ('auto') or uses vLLM's defaults ('vllm')")
    check_tokenizer(tokenizer, model)
    if not (type(max_logprobs) is int and 0 <= max_logprobs <= MAX_LOGPROBS):
        raise MemraError(f"LLM(max_logprobs={max_logprobs!r}) is not supported: memra returns at most "
                         f"{MAX_LOGPROBS} logprobs per position")
    if max_num_batched_tokens is not None and not (type(max_num_batched_tokens) is int and max_num_batched_tokens > 0):
        raise MemraError(f"LLM(max_num_batched_tokens=...) must be a positive integer, got {max_num_batched_tokens!r}")
    spec = SpecConfig(speculative) if isinstance(speculative, str) else speculative
    if speculative_config is not None:
        if spec is not None:
            raise MemraError("give LLM speculative or speculative_config, not both")
        spec = spec_from_vllm(speculative_config)
    return LLMArgs(load, max_num_batched_tokens, spec, max_logprobs)


def check_tokenizer(tokenizer, model) -> None:
    """vLLM's tokenizer argument: memra reads the tokenizer that comes with the model, so the argument may
    only name the model itself."""
    if tokenizer is None or (isinstance(model, (str, Path)) and str(tokenizer) == str(model)):
        return
    if not isinstance(tokenizer, (str, Path)):
        raise MemraError(f"LLM(tokenizer=...) must be a path or a model name, got {type(tokenizer).__name__}")
    from memra.loading.hub import looks_like_hub_name

    if not Path(tokenizer).exists() and not looks_like_hub_name(str(tokenizer)):
        raise MemraError(f"LLM(tokenizer={str(tokenizer)!r}): no such file or folder")
    if isinstance(model, (str, Path)) and Path(model).exists() and Path(tokenizer).resolve() == Path(model).resolve():
        return
    raise MemraError(f"LLM(tokenizer={str(tokenizer)!r}) is not supported: memra reads the tokenizer that comes "
                     "with the model (tokenizer.json in its folder, or the GGUF's); copy it there")


# vLLM's speculative_config methods -> memra's (memra.spec)
_SPEC_METHODS = {"ngram": "ngram", "mtp": "mtp", "deepseek_mtp": "mtp", "qwen3_next_mtp": "mtp"}


def spec_from_vllm(cfg: dict) -> SpecConfig:
    """vLLM's speculative_config dict -> SpecConfig: method, num_speculative_tokens, prompt_lookup_max/min."""
    if not isinstance(cfg, dict):
        raise MemraError("LLM(speculative_config=...) must be a dict, as in vLLM")
    known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"}
    if set(cfg) - known:
        extra = sorted(set(cfg) - known)[0]
        raise MemraError(f"LLM(speculative_config={{{extra!r}: ...}}) is not supported: memra drafts with the model's "
                         "own MTP head or with n-grams of the prompt (method 'mtp' or 'ngram'; no draft model)")
    method = _SPEC_METHODS.get(cfg.get("method"))
    if method is None:
        raise MemraError(f"LLM(speculative_config method {cfg.get('method')!r}) is not supported: memra speculates "
                         "with 'mtp' (the model's MTP head) or 'ngram'")
    k = cfg.get("num_speculative_tokens", 4)
    if method == "mtp":
        return SpecConfig("mtp", k=k)
    return SpecConfig("ngram", k=k, ngram_max=cfg.get("prompt_lookup_max", 4), ngram_min=cfg.get("prompt_lookup_min", 1))


_GENERATION_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                        "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def generation_defaults(source: str, generation_config: str | None) -> dict:
    """vLLM's generation_config='auto': the sampling defaults the model's generation_config.json sets
    (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens), used where generate gets no
    SamplingParams. 'vllm' (or a GGUF, which has no such file): none."""
    path = Path(source) / "generation_config.json" if source else None
    if generation_config != "auto" or path is None or not path.is_file():
        return {}
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise MemraError(f"{path}: not readable JSON ({e}); fix it, or pass LLM(generation_config='vllm')") from None
    return {ours: cfg[theirs] for theirs, ours in _GENERATION_DEFAULTS.items() if cfg.get(theirs) is not None}
