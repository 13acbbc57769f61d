"""Structured output: a request's tokens held to a JSON schema, a regex, a list of choices or a Lark
grammar, through llguidance.

    StructuredOutputs (the request's constraint, in SamplingParams)
        --compile_for(tokenizer, spec): off the engine thread, cached by the constraint--> Grammar
        --Grammar.start(): one per sequence--> GrammarState
        --in the sampler, per row: advance over the row's new tokens, then its mask [V] on its logits

A row's mask is a function of its own grammar and its own tokens only, so its tokens do not depend on
what else runs in the batch (docs/EXACTNESS.md, E10).
"""

from memra.structured.params import StructuredOutputs

__all__ = ["GrammarState", "StructuredOutputs", "compile_for"]


def compile_for(*args, **kwargs):
    """memra.structured.compile.compile_for, imported on first use: llguidance loads only when a request
    asks for structured output, so the rest of memra runs where it is not installed."""
    from memra.structured.compile import compile_for as compile_now

    return compile_now(*args, **kwargs)


def __getattr__(name: str):
    """GrammarState on first use: it needs torch, which `memra --help` should not pay for."""
    if name == "GrammarState":
        from memra.structured.state import GrammarState

        return GrammarState
    raise AttributeError(f"module 'memra.structured' has no attribute {name!r}")
