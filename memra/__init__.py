"""memra: an LLM inference engine whose results are exact — the same tokens and logits, to the bit.

Public surface:
    llm = memra.LLM(path, device="cuda")                 # batches of prompts through the serving engine
    outs = llm.generate(["a", "b"], memra.SamplingParams(max_tokens=64, seed=1))   # vLLM's LLM and SamplingParams
    m = memra.load(path, device="cpu" | "cuda:0", dtype=None)   # HF directory or .gguf file
    c = m.new_cache(max_ctx)
    logits = m.prime(prompt_ids, c); logits = m.decode_step(token, c)
    rows = m.decode_step_batch(tokens, caches)          # each row bit-identical to its B=1 run

The names are imported on first use (PEP 562), so `import memra.cli` — and `memra --version` / `--help`
— does not pay for torch.
"""

from importlib import import_module

# public name -> the module that defines it
_EXPORTS = {"LLM": "memra.engine.llm", "CompletionOutput": "memra.engine.outputs", "RequestOutput": "memra.engine.outputs",
            "Logprob": "memra.engine.outputs", "MemraError": "memra.errors", "load": "memra.loading.checkpoint",
            "DevSamp": "memra.sampling", "SamplingParams": "memra.sampling", "StructuredOutputs": "memra.structured",
            "StructuredOutputsParams": "memra.sampling_params"}

__all__ = ["load", "LLM", "RequestOutput", "CompletionOutput", "Logprob", "MemraError", "SamplingParams", "DevSamp",
           "StructuredOutputs", "StructuredOutputsParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(import_module(_EXPORTS[name]), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'memra' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
