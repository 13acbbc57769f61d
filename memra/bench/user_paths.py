"""Decode rates of the paths users run, next to the pooled step `memra bench model` times:

- engine: the engine loop (memra.engine) that `memra generate` (B=1), `memra chat`, memra.LLM and the
  server all run: B requests submitted together, the rate of its steps once every row decodes — with
  its scheduler, its per-step sampling of every row on the device and its one copy to the host;
- newcache: decode_step_batch over caches from `model.new_cache` (the documented batch API), each
  step's greedy tokens fed back through the host, as the pooled cell does.
"""

from __future__ import annotations

import time

import torch

from memra.bench.timing import Timing, greedy_step_seconds, sync
from memra.engine.engine import Engine
from memra.engine.types import EngineConfig
from memra.sampling import SamplingParams


@torch.inference_mode()
def time_engine_decode(model, batch: int, steps: int, warmup: int, prompts: list[list[int]]):
    """Seconds per engine step while all `batch` rows decode (after `warmup` such steps). -> Timing."""
    prompt_tokens = len(prompts[0])
    # The scheduler may admit the prompts over several steps (at most max_pieces prefill chunks a step, where
    # mixed steps are graphed), and the rows admitted first decode meanwhile: every row gets `batch` tokens of
    # slack, so none reaches its end inside the timed steps.
    new_tokens = warmup + steps + 1 + batch
    engine = Engine(model, EngineConfig(max_batch=batch, max_ctx=prompt_tokens + new_tokens + 1,
                                        token_budget=max(2048, batch * prompt_tokens), max_waiting=batch))
    counts = [0] * batch
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0)  # greedy; a random model has no end token
    for i, ids in enumerate(prompts):
        engine.submit(ids, params, lambda ev, i=i: counts.__setitem__(i, counts[i] + (ev.token_id is not None)))
    while min(counts) < 1 + warmup:  # every prefill done, then the warm-up decode steps
        engine.step()
    sync(model.device)
    before = list(counts)
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync(model.device)
    seconds = (time.perf_counter() - t0) / steps
    if any(after - b != steps for after, b in zip(counts, before)):  # each timed step decoded every row
        raise RuntimeError(f"the engine did not decode all {batch} rows in each of {steps} steps")
    engine.run_until_idle()
    return Timing(seconds, batch, steps, context=prompt_tokens + warmup + steps // 2)


@torch.inference_mode()
def time_new_cache_decode(model, batch: int, steps: int, warmup: int, prompts: list[list[int]]):
    """Seconds per decode_step_batch over `model.new_cache` caches. -> Timing."""
    prompt_tokens = len(prompts[0])
    caches = [model.new_cache(prompt_tokens + warmup + steps + 1) for _ in prompts]
    toks = [int(model.prime(ids, c).argmax()) for ids, c in zip(prompts, caches)]
    seconds = greedy_step_seconds(model, toks, caches, warmup, steps)
    for c in caches:
        c.free()
    return Timing(seconds, batch, steps, context=prompt_tokens + warmup + steps // 2)
