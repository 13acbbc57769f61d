"""vLLM's `vllm.sampling_params` names, so that a script's `from vllm.sampling_params import ...` needs
only the package renamed: SamplingParams, and StructuredOutputsParams (memra.StructuredOutputs)."""

from memra.sampling import SamplingParams
from memra.structured import StructuredOutputs as StructuredOutputsParams

__all__ = ["SamplingParams", "StructuredOutputsParams"]
