"""How a benchmark cell is timed: the Timing one measurement yields, and the device-synced clock
(best of N after an untimed call) that the probes, memra's cells and the HF peer all use."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class Timing:
    seconds: float  # one operation: a decode step of the whole batch, one prefill chunk, one TTFT
    tokens: int  # tokens that operation produces or consumes (B, the chunk, the prompt)
    repeats: int  # operations timed
    context: int = 0  # decode: mean context length over the timed steps (the roofline's KV read)


def sync(device: torch.device) -> None:
    """Wait for the device: CUDA work is asynchronous, so a clock read without this times the launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_seconds(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """The fastest of `repeats` timed calls, after one untimed call (allocator, kernel load, clocks)."""
    fn()
    best = math.inf
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def greedy_step_seconds(model, toks: list[int], caches: list, warmup: int, steps: int) -> float:
    """Seconds per decode_step_batch over `caches`, each step's greedy tokens fed back through the host
    (as a caller of the step API does), after `warmup` untimed steps."""
    for _ in range(warmup):
        toks = model.decode_step_batch(toks, caches).argmax(-1).tolist()
    sync(model.device)
    t0 = time.perf_counter()
    for _ in range(steps):
        toks = model.decode_step_batch(toks, caches).argmax(-1).tolist()
    sync(model.device)
    return (time.perf_counter() - t0) / steps
