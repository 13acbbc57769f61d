"""vLLM's SamplingParams fields that memra does not implement, each refused in one line that names it and
says what memra offers instead, unless it is given its no-op value (what vLLM does when it is left out).
A script written for vLLM then either runs as it did there or stops before any token is produced; it
never runs with a field quietly dropped. docs/VLLM.md has the whole table."""

from __future__ import annotations

from memra.errors import MemraError

# field -> (its no-op values, why it is refused and what to use instead)
REFUSED: dict[str, tuple[tuple, str]] = {
    "best_of": ((None, 1), "memra does not rank candidates; ask for n choices and compare their cumulative_logprob"),
    "use_beam_search": ((False,), "memra has no beam search; sample n choices instead"),
    "length_penalty": ((1.0, 1), "it scores beams, and memra has no beam search; sample n choices instead"),
    "early_stopping": ((False,), "it ends beams, and memra has no beam search; sample n choices instead"),
    "bad_words": ((None, []), "give each word's tokens a bias of -100 in logit_bias instead"),
    "allowed_token_ids": ((None,), "hold the output to a set with structured_outputs (choice, regex or grammar) "
                                   "instead"),
    "logits_processors": ((None, []), "memra runs no Python code per step (it would break its exactness "
                                      "promises); use logit_bias or structured_outputs"),
    "guided_decoding": ((None,), "it is vLLM's old name: pass structured_outputs=StructuredOutputsParams(...)"),
    "extra_args": ((None, {}), "memra has no sampling plugins to read it"),
    "flat_logprobs": ((False,), "memra returns logprobs as vLLM's default list of {token_id: Logprob} dicts"),
    "logprob_token_ids": ((None, []), "ask for logprobs=k (the top k and the chosen token) instead"),
    "thinking_token_budget": ((None, -1), "use max_tokens, or the chat template's enable_thinking switch"),
}
MAX_LOGPROBS_NOTE = "memra returns at most 20 per position; -1 (the whole vocabulary) is not available"


def refuse_unsupported(p) -> None:
    """Raise MemraError for the first field of REFUSED that `p` (a SamplingParams) sets to something else
    than a no-op value, and for vLLM's -1 (every token) in logprobs / prompt_logprobs."""
    for name, (noop, instead) in REFUSED.items():
        value = getattr(p, name)
        if not any(value is v or (type(value) is type(v) and value == v) for v in noop):
            raise MemraError(f"SamplingParams({name}=...) is not supported: {instead}")
    for name in ("logprobs", "prompt_logprobs"):
        if getattr(p, name) == -1:
            raise MemraError(f"SamplingParams({name}=-1) is not supported: {MAX_LOGPROBS_NOTE}")
