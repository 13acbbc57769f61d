"""One timed measurement of a benchmark cell."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Timing:
    seconds: float  # one operation: a decode step of the whole batch, one prefill chunk, one TTFT
    tokens: int  # tokens that operation produces or consumes (B, the chunk, the prompt)
    repeats: int  # operations timed
    context: int = 0  # decode: mean context length over the timed steps (the roofline's KV read)
