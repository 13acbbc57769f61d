"""memra's own cells of `memra bench model`: decode through the pooled step (decode_step_batch over
caches from one shared pool, as a server keeps them), one prefill chunk, and time to first token — each
in a mode (exact, or the fast non-exact path) viewed over the same weights.

Also the seeded prompts every cell uses, so memra, its user paths and the HF peer see the same tokens.
"""

from __future__ import annotations


import torch

from memra.bench.timing import Timing, best_seconds, greedy_step_seconds


def mode_view(model, mode: str):
    """The model as one mode runs it: the exact path, or the fast one (MEMRA_EXACT=0) — a view with
    other settings over the same weights (HybridModel.with_settings), not a change to the environment."""
    exact = mode != "fast"
    return model if model.settings.exact == exact else model.with_settings(model.settings.replace(exact=exact))


def prompt_ids(vocab: int, n: int, row: int = 0, seed: int = 0) -> list[int]:
    """A seeded prompt, different per row (the values do not change the speed; distinct rows keep
    every sequence a real one)."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + row)
    return torch.randint(vocab, (n,), generator=gen).tolist()


def shared_caches(model, batch: int, max_ctx: int) -> list:
    """B sequences in one KV pool and one recurrent pool, as a server keeps them (and as CUDA graphs
    need them: memra.graphs), with the graphs' scratch block and slot set aside."""
    from memra.cache import BLOCK_SIZE, Cache, RecurrentPool, kv_pool
    from memra.graphs import reserve_scratch

    cfg = model.cfg
    kv = kv_pool(cfg, batch * -(-max_ctx // BLOCK_SIZE) + 1, model.dtype, model.device)
    rec = RecurrentPool(cfg, batch + 1, model.dtype, model.device) if cfg.gdn_layers else None
    reserve_scratch(model, kv, rec)
    return [Cache(kv=kv, rec=rec, max_ctx=max_ctx, slot=rec.allocate() if rec else None) for _ in range(batch)]


@torch.inference_mode()
def time_decode(model, batch: int, steps: int, warmup: int, prompt_tokens: int, seed: int = 0) -> Timing:
    """B sequences primed with their own prompts, then `warmup` untimed and `steps` timed decode steps
    of all B rows through decode_step_batch, each fed the previous step's greedy tokens (the host
    round-trip a real decode loop pays)."""
    from memra.decode_plan import decode_plan

    if model.settings.exact:
        decode_plan(model)  # resolve (and on-model verify, once per model) the exact plan before any timing
    vocab = model.cfg.vocab_size
    caches = shared_caches(model, batch, prompt_tokens + warmup + steps + 1)
    toks = [int(model.prime(prompt_ids(vocab, prompt_tokens, i, seed), c).argmax()) for i, c in enumerate(caches)]
    seconds = greedy_step_seconds(model, toks, caches, warmup, steps)
    return Timing(seconds, batch, steps, context=prompt_tokens + warmup + steps // 2)


@torch.inference_mode()
def time_prefill(model, tokens: int, repeats: int, seed: int = 0) -> Timing:
    """One prime of `tokens` tokens as a single chunk into an empty cache (best of `repeats`)."""
    ids = prompt_ids(model.cfg.vocab_size, tokens, 0, seed)
    cache = model.new_cache(tokens)

    def run() -> None:
        cache.reset()
        model.prime(ids, cache, chunk_size=tokens)

    return Timing(best_seconds(run, model.device, repeats), tokens, repeats)


@torch.inference_mode()
def time_ttft(model, tokens: int, repeats: int, seed: int = 0) -> Timing:
    """Time to first token: prime a `tokens`-token prompt and take its greedy token on the host — the
    wall time until a client could see it (cache allocation excluded: a server keeps pools). Best of
    `repeats`."""
    ids = prompt_ids(model.cfg.vocab_size, tokens, 1, seed)
    cache = model.new_cache(tokens + 1)

    def run() -> None:
        cache.reset()
        int(model.prime(ids, cache).argmax())

    return Timing(best_seconds(run, model.device, repeats), tokens, repeats)
