"""An engine's warm-up: the first-use costs paid before the first request rather than by it.

- The engine's own prefill (prime_batch, several prompts' pieces in one forward where batching is live),
  a decode step and a mixed step (memra.step.mixed_step): kernel compilation and the decode plan's check.
- The batch sampler's kernels, with and without a filtering row.
- On a GPU, one prefill wave in each size class a step can run (2 tokens, then x4, up to the step's
  token budget). Triton compiles a kernel per tile configuration, and the projections take theirs by
  the wave's row count (memra.kernels.triton.linear.LINEAR_BUCKETS); a class met first by a request
  stalled that step for the compile (an offline run on the H200: 36 mixed steps of 64.6 ms on the first
  pass, 32.7 ms once compiled).
- On a GPU, every batch bucket's decode graph (memra.engine.backends.InProcess.warm_graphs), then
  every (batch bucket, token bucket)'s mixed-step graph (memra.mixed_graphs).
"""

from __future__ import annotations

import torch

from memra.cache import BLOCK_SIZE
from memra.graphs import BUCKETS, bucket_for, full_width_pass, long_tables
from memra.engine.release import release_memory
from memra.errors import CaptureMemoryError
from memra.kernels.cuts import ATTN_SPLIT
from memra.mixed_graphs import captures_mixed, token_bucket, token_buckets
from memra.sampling import DevSamp
from memra.step import EXACT_PIECE, mixed_step


def wave_sizes(token_budget: int) -> list[int]:
    """Token counts of the warm-up's prefill waves: 2, 8, 32, ... below the budget, then the budget."""
    sizes, n = [], 2
    while n < token_budget:
        sizes.append(n)
        n *= 4
    return sizes + [token_budget]


def wave_prompts(tokens: int, cache_ctx: int, max_prompts: int, vocab: int) -> list[list[int]]:
    """`tokens` prompt tokens over as few prompts as fit in cache_ctx - 1 tokens each, and at least two (a
    shared forward) where max_prompts allows; [] where it takes more than max_prompts."""
    longest = cache_ctx - 1
    k = max(-(-tokens // max(longest, 1)), min(2, max_prompts, tokens))
    if k > max_prompts or longest < 1:
        return []
    return [_prompt(j, tokens // k + (j < tokens % k), vocab) for j in range(k)]


def warm_up(model, backend, max_batch: int, cache_ctx: int, token_budget: int, prefill_budget: int | None = None) -> None:
    """Run the warm-up above on `backend`'s pools; every block and slot it takes is handed back.
    prefill_budget: the prompt tokens a step takes apart from its decode rows (None: they share token_budget)."""
    free_prompts = min(max_batch, backend.slots or max_batch, _room(backend, cache_ctx))
    n = min(EXACT_PIECE + 2, cache_ctx - 1)  # a piece boundary crossed, where the context allows
    first = [_prompt(j, max(n - j, 1), model.cfg.vocab_size) for j in range(min(2, free_prompts))]
    _prime(model, backend, first, cache_ctx, decode=True)
    if free_prompts >= 3 and model.executor.mixes_steps and not captures_mixed(model):  # captured: below
        _mixed(model, backend, first, cache_ctx)
    if model.device.type == "cuda":
        for size in wave_sizes(token_budget):
            prompts = wave_prompts(size, cache_ctx, free_prompts, model.cfg.vocab_size)
            if prompts:
                _prime(model, backend, prompts, cache_ctx, decode=False)
    backend.warm_graphs(max_batch, cache_ctx)
    if captures_mixed(model):
        rows = graph_rows(backend, max_batch, cache_ctx, model.settings.mixed_tokens)
        _mixed_graphs(model, backend, rows, cache_ctx, token_budget, prefill_budget)


def warm_engine(engine) -> None:
    """warm_up on an engine's backend. Out of device memory here (the captured steps of a wide max_batch,
    beside pools that took the whole KV budget), the engine gives its memory back and the caller gets one
    line naming the fix, before any request is taken."""
    cfg = engine.cfg
    try:
        warm_up(engine.model, engine.backend, cfg.max_batch, engine.cache_ctx, cfg.token_budget,
                engine.scheduler.cfg.prefill_budget)
    except torch.OutOfMemoryError:
        pools = getattr(engine.backend, "pools", None)
        held = pools.capacity_bytes / (1 << 30) if pools is not None else 0.0
        engine.shutdown(drain_timeout=0.0)
        release_memory(engine.model.device)
        raise CaptureMemoryError(f"max_batch {engine.cfg.max_batch}: its captured steps ran out of device memory "
                                 f"beside the cache pools ({held:.1f} GiB); lower --max-batch, or the pools' share "
                                 "(--kv-fraction, --gpu-memory-utilization, --kv-memory)") from None


def _prompt(j: int, n: int, vocab: int) -> list[int]:
    """Warm-up prompt j: n token ids, spread over the vocabulary."""
    return [(7 + 31 * i + 5 * j) % vocab for i in range(n)]


def _room(backend, cache_ctx: int) -> int:
    """How many sequences of cache_ctx tokens the KV pool holds at once."""
    return backend.blocks * BLOCK_SIZE // cache_ctx


def graph_rows(backend, max_batch: int, cache_ctx: int, largest: int = max(token_buckets())) -> int:
    """Decoding rows the mixed-graph warm-up can run: each holds one block, beside one row primed past an
    attention split (where cache_ctx reaches past one) and one prompt of the largest token bucket a sequence
    of cache_ctx holds (and the prompt is one of max_batch). Not sequences of cache_ctx each (_room): that
    bounded the captures by what the rows may come to hold. A pool of 24k blocks (an H100's) holds 190
    contexts of 2,048 tokens, so the warm-up stopped at the 256-row bucket, and at max_batch 512 the 384- and
    512-row mixed steps were captured mid-run, on the first step that met each (on an H200, 385 contexts: the
    512-row ones). And not a 512-token prompt where cache_ctx is shorter: a small pool (the demo's 20 blocks at
    75 tokens) then warmed no mixed step at all, and the first steps captured theirs mid-run."""
    prompt = min(largest, cache_ctx - 1)  # the largest token bucket's (Settings.mixed_tokens)
    split = ATTN_SPLIT if long_tables(cache_ctx) else 0
    spare = backend.blocks - (split + prompt) // BLOCK_SIZE - 2
    return max(0, min(max_batch - 1, (backend.slots or max_batch) - 1, spare))


def _mixed(model, backend, prompts: list[list[int]], cache_ctx: int) -> None:
    """The engine's mixed step (memra.step.mixed_step): these prompts' sequences decode while one more prefills."""
    caches = [backend.new_cache(cache_ctx) for _ in range(len(prompts) + 1)]
    try:
        model.prime_batch(prompts, caches[:-1])
        mixed_step(model, [1] * len(prompts), caches[:-1], [prompts[0]], caches[-1:])
    finally:
        for c in caches:
            c.free()


def _mixed_graphs(model, backend, rows: int, cache_ctx: int, token_budget: int, prefill_budget: int | None) -> None:
    """Capture the mixed step of every (batch bucket, token bucket) a step can meet (memra.mixed_graphs),
    at every table width it can meet (memra.graphs.step_blocks; with MEMRA_MIXED_DECODE_WIDTH the decode
    rows' own width too): `rows` sequences decode while one more prefills a prompt in the token bucket.
    Where a step declines the graph (no scratch), this runs the two calls instead, harmlessly."""
    sizes = sorted({min(b, rows) for b in BUCKETS if b <= (bucket_for(rows) or rows)})
    largest = model.settings.mixed_tokens
    per_pass = len(token_buckets(largest)) * len(sizes)  # steps, each advancing the decoding rows a position
    if rows < 1 or cache_ctx < 2 + per_pass:
        return
    # Passes: every table narrow; with MEMRA_MIXED_DECODE_WIDTH the prompt piece past one attention split (its
    # table full width) beside short decode rows (theirs narrow); then a decoding row past the split, every
    # table full width.
    passes = ["narrow"]
    if model.settings.mixed_decode_width and full_width_pass(cache_ctx, 2 * per_pass):
        passes.append("piece past the split")
    if full_width_pass(cache_ctx, per_pass * len(passes)):
        passes.append("row past the split")
    caches = [backend.new_cache(cache_ctx) for _ in range(rows)]
    try:
        model.prime_batch([[1]] * rows, caches)
        for width in passes:
            if width == "row past the split":
                model.prime([1] * ATTN_SPLIT, caches[0])
            for tokens in token_buckets(largest):
                for n in sizes:
                    length = min(tokens, cache_ctx - 1, token_budget - n if prefill_budget is None else prefill_budget)
                    if token_bucket(length, largest) != tokens:
                        continue  # no step of n rows reaches this bucket
                    if width == "piece past the split" and ATTN_SPLIT + length >= cache_ctx:
                        continue
                    new = backend.new_cache(cache_ctx)
                    try:
                        if width == "piece past the split":
                            model.prime([1] * ATTN_SPLIT, new)
                        mixed_step(model, [1] * n, caches[:n], [_prompt(n, length, model.cfg.vocab_size)], [new])
                    finally:
                        new.free()
    finally:
        for c in caches:
            c.free()


def _prime(model, backend, prompts: list[list[int]], cache_ctx: int, decode: bool) -> None:
    caches = [backend.new_cache(cache_ctx) for _ in prompts]
    try:
        lasts = model.prime_batch(prompts, caches)
        if decode:
            logits = model.decode_step_batch([int(last.argmax()) for last in lasts], caches)
            _sample(model, logits)
    finally:
        for c in caches:
            c.free()


def _sample(model, logits) -> None:
    """The batch sampler's two kernels: with and without a row whose top-k / top-p / min-p masks the
    vocabulary (a first sampled request compiled each where this did not)."""
    plain, masked = DevSamp(temperature=0.8, seed=1, ctr=0), DevSamp(temperature=0.8, seed=1, ctr=0, top_k=5)
    rows = logits[:1].expand(2, -1).contiguous()
    model.ops.sample_batch(rows, [plain, masked])
    model.ops.sample_batch(rows, [plain, plain])

