"""memra: an LLM inference engine whose results are exact — the same tokens and logits, to the bit.

Public surface:
    llm = memra.LLM(path, device="cuda")                 # batches of prompts through the serving engine
    outs = llm.generate(["a", "b"], memra.SamplingParams(max_tokens=64, seed=1))   # vLLM's LLM and SamplingParams
    m = memra.load(path, device="cpu" | "cuda:0", dtype=None)   # HF directory or .gguf file
    c = m.new_cache(max_ctx)
    logits = m.prime(prompt_ids, c); logits = m.decode_step(token, c)
    rows = m.decode_step_batch(tokens, caches)          # each row bit-identical to its B=1 run
"""

from memra.engine.llm import LLM
from memra.engine.outputs import CompletionOutput, Logprob, RequestOutput
from memra.errors import MemraError
from memra.loading.checkpoint import load
from memra.sampling import DevSamp, SamplingParams
from memra.structured import StructuredOutputs

StructuredOutputsParams = StructuredOutputs  # vLLM's name (vllm.sampling_params; also memra.sampling_params)

__all__ = ["load", "LLM", "RequestOutput", "CompletionOutput", "Logprob", "MemraError", "SamplingParams", "DevSamp",
           "StructuredOutputs", "StructuredOutputsParams"]
__version__ = "0.1.0"
