"""The step API's one front: prime (chunked prefill), decode_step (B = 1), decode_step_batch (B rows),
decode_step_t (the verify forward) and new_cache.

Each call validates its inputs, cuts the prompt into forwards, resolves the decode plan and counts;
then the model's executor (memra.runner.executor, chosen at load: unsplit, in-process pipeline, or a
process per stage) runs the bodies (memra.runner.bodies) — "embed, walk layers, norm, head" with a
different StepContext: prompt tokens take the GDN chunked form, generated tokens the recurrent form
(the same way in every run, which is what makes runs comparable bit for bit). Every check that can
refuse happens before any state moves.

How the exact path keeps its promises (EXACTNESS.md), relying only on "same shapes and same inputs
give the same bits" (checked by memra.kernels.exact.self_test):
- E5: prime runs its tokens as forwards of at most EXACT_PIECE tokens cut at absolute multiples of
  EXACT_PIECE, so any prime whose chunk cuts are 64-aligned performs the very same forwards as a
  one-shot prime. Where every prefill op is a batch-invariant kernel (CUDA + Triton, self-test
  passed), a token's bits do not depend on the forward it is in at all — only GDN's chunks must sit
  at absolute multiples of 64, and GDN cuts its own — so there a forward takes a whole chunk
  (INVARIANT_PIECE): the weights are read once per 4096 tokens instead of once per 64.
- E1: decode_step_batch runs each row's step with exactly the shapes of that sequence's B=1 step, so
  a row cannot depend on its batchmates or its position in the batch. (Measured on CPU: matmul rows
  are invariant inside fixed tiles, but elementwise ops like sigmoid/softplus change bits with a
  value's offset in the tensor — so a stacked batch is not exact there; see the self-test.)
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch

from memra import counters
from memra.cache import PRIME_CHUNK_MAX_TOKENS, Cache
from memra.decode_plan import decode_plan
from memra.errors import MemraError
from memra.kernels.cuts import TILE, aligned_cuts
from memra.kernels.exact import platform_report, require_exact
from memra.state_trail import StateTrail
from memra.upload import upload

EXACT_PIECE = TILE  # prefill forward size on the exact path; equals the GDN chunk so cuts line up
INVARIANT_PIECE = PRIME_CHUNK_MAX_TOKENS  # ... where every prefill op is batch-invariant (exact_piece)


def on_model_device(fn):
    """Run a step with the model's GPU as the current CUDA device. Triton launches its kernels on the
    current device, so a model loaded onto cuda:1 while the process's current device is cuda:0 would
    hand cuda:1 pointers to kernels on cuda:0. A no-op on CPU and wherever the model's device is
    already current (every one-GPU machine); the pipeline's stage scopes set their own."""

    @functools.wraps(fn)
    def run(model, *args, **kwargs):
        dev = model.device
        if dev.type == "cuda" and dev.index is not None and torch.cuda.current_device() != dev.index:
            with torch.cuda.device(dev):
                return fn(model, *args, **kwargs)
        return fn(model, *args, **kwargs)

    return run


def _as_ids(model, ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
    t = torch.as_tensor(ids, dtype=torch.long).flatten()
    if t.numel() == 0:
        raise MemraError("cannot prime an empty prompt")
    bad = (t < 0) | (t >= model.cfg.vocab_size)
    if bool(bad.any()):
        raise MemraError(f"token id {int(t[bad][0])} is outside the vocabulary (0..{model.cfg.vocab_size - 1})")
    return upload(t, model.device)


def _exact(model) -> bool:
    """The model's MEMRA_EXACT, refused where the platform cannot keep the promise."""
    exact = model.settings.exact
    if exact:
        require_exact(model.dtype, model.device)
    return exact


def new_cache(model, max_ctx: int):
    """A sequence's cache, drawn from the pools of the model's placement."""
    if max_ctx > model.cfg.max_position:
        raise MemraError(f"max_ctx {max_ctx} exceeds the model's {model.cfg.max_position} positions")
    if max_ctx <= 0:
        raise MemraError(f"max_ctx must be positive, got {max_ctx}")
    return model.executor.open_cache(max_ctx)


@on_model_device
@torch.inference_mode()
def prime(model, ids, cache: Cache, all_logits: bool = False, chunk_size: int | None = None, hidden: bool = False):
    """Run prompt tokens through the model in chunks, advancing the cache.

    Returns the last position's logits [V] (fp32), or every position's [T, V] when all_logits; with
    hidden=True, (that, final-normed hidden states [T, E]) — what an MTP drafter is seeded from.
    chunk_size defaults to PRIME_CHUNK_MAX_TOKENS and may not exceed it.
    """
    chunk = PRIME_CHUNK_MAX_TOKENS if chunk_size is None else int(chunk_size)
    if not 1 <= chunk <= PRIME_CHUNK_MAX_TOKENS:
        raise MemraError(f"prime chunk size must be in 1..{PRIME_CHUNK_MAX_TOKENS}, got {chunk_size}")
    exact = _exact(model)
    tokens = _as_ids(model, ids)
    model.executor.preflight("prime", [cache])
    cache.reserve(tokens.numel())  # refuses (context overflow) before any state changes
    return model.executor.run_prime(_pieces(model, tokens, cache.pos, chunk, exact), cache, all_logits, hidden)


def _pieces(model, tokens: torch.Tensor, pos0: int, chunk: int, exact: bool) -> list[torch.Tensor]:
    """A prompt's forwards: chunks of `chunk` tokens, each cut where forward_cuts cuts it."""
    pieces, pos = [], pos0
    for start in range(0, tokens.numel(), chunk):
        part = tokens[start : start + chunk]
        for a, b in forward_cuts(model, part.numel(), pos, exact):
            pieces.append(part[a:b])
            pos += b - a
    return pieces


def batching_prime(model, exact: bool) -> bool:
    """May prompt pieces of several sequences share one forward here? On the exact path only where a
    token's bits cannot depend on the forward it is in (exact_piece's whole-chunk condition: every
    row-wise op a batch-invariant kernel, the self-test clean), and the executor can run such a wave."""
    return model.executor.batches_prime and (not exact or exact_piece(model) == INVARIANT_PIECE)


@on_model_device
@torch.inference_mode()
def prime_batch(model, prompts, caches, chunk_size: int | None = None,
                wave_tokens: int = PRIME_CHUNK_MAX_TOKENS) -> list[torch.Tensor]:
    """Prime several sequences at once: prompts[i] into caches[i]. -> each prompt's last-position logits
    [V] (fp32). Where batching_prime holds, the k-th pieces of the prompts run as one forward (in waves
    of at most wave_tokens tokens), so the weights are read once for all of them; each
    prompt's logits and cache bits are exactly what prime() gives it alone (the gate's prime-batch arm
    checks it). Elsewhere each prompt is primed on its own."""
    chunk = PRIME_CHUNK_MAX_TOKENS if chunk_size is None else int(chunk_size)
    if not 1 <= chunk <= PRIME_CHUNK_MAX_TOKENS:
        raise MemraError(f"prime chunk size must be in 1..{PRIME_CHUNK_MAX_TOKENS}, got {chunk_size}")
    exact = _exact(model)
    tokens = _check_prompts(model, prompts, caches)
    pieces = [_pieces(model, t, c.pos, chunk, exact) for t, c in zip(tokens, caches)]
    if not batching_prime(model, exact):
        return [model.executor.run_prime(p, c, False, False) for p, c in zip(pieces, caches)]
    out: list[torch.Tensor | None] = [None] * len(caches)
    for k in range(max(len(p) for p in pieces)):
        wave = [i for i in range(len(caches)) if k < len(pieces[i])]
        for group in _token_groups(wave, [pieces[i][k].numel() for i in wave], wave_tokens):
            logits = model.executor.run_prime_wave([pieces[i][k] for i in group], [caches[i] for i in group],
                                                   [k == len(pieces[i]) - 1 for i in group])
            for i, row in zip(group, logits):
                if row is not None:
                    out[i] = row
    return out


def _check_prompts(model, prompts, caches) -> list[torch.Tensor]:
    """Every refusal of a batched prime, before any position moves. -> each prompt's ids on the device."""
    if len(prompts) != len(caches):
        raise MemraError(f"prime_batch got {len(prompts)} prompts for {len(caches)} caches")
    if len({id(c) for c in caches}) != len(caches):
        raise MemraError("prime_batch got the same cache twice; each prompt must be its own sequence")
    tokens = [_as_ids(model, p) for p in prompts]
    model.executor.preflight("prime", caches)
    for c, t in zip(caches, tokens):
        c.reserve(t.numel())  # refuses (context overflow) before any position moves
    return tokens


def mixes(model, exact: bool, dec_caches, pre_caches) -> bool:
    """Do a decode step and a prefill wave share one forward here? Where the executor mixes (unsplit, and
    MEMRA_MIXED_STEP: on a GPU as a captured graph, memra.mixed_graphs), the wave's pieces may share one
    (batching_prime), the decode rows run stacked and every cache is in the same two pools. Then every
    op a row meets is either row-wise (on the exact path a batch-invariant kernel, whose row bits the
    self-test holds equal across row counts) or its own
    kind's mixer launch (a decode row's attention and recurrent step, a piece's prefill attention and
    chunked scan) with the shapes of its own forward: no row can take bits from the other kind."""
    if not (model.executor.mixes_steps and batching_prime(model, exact) and _plan(model, exact) == "stacked"):
        return False
    kv, rec = dec_caches[0].kv, dec_caches[0].rec
    return all(c.kv is kv and c.rec is rec for c in (*dec_caches, *pre_caches))


@on_model_device
@torch.inference_mode()
def mixed_step(model, tokens, dec_caches, prompts, pre_caches) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    """The engine's step: decode_step_batch(tokens, dec_caches) and prime_batch(prompts, pre_caches), in
    one forward where `mixes` holds and the prompts make one wave of one piece each, so the weights are
    read once for both (a prefill of a few short prompts otherwise costs a whole second weight read).
    -> (decode logits [B, V] fp32 or None without rows, each prompt's last-position logits [V]): bit for
    bit what the two calls return (tests/test_mixed_step.py compares them on CUDA). Elsewhere it makes
    the two calls, decode first."""
    # (a decode-only step, the common one, builds no sets here)
    if dec_caches and pre_caches and {id(c) for c in dec_caches} & {id(c) for c in pre_caches}:
        raise MemraError("mixed_step got a cache both to decode and to prefill; a sequence takes one of the two")
    exact = _exact(model)
    if not (dec_caches and prompts and mixes(model, exact, dec_caches, pre_caches)):
        return (model.decode_step_batch(tokens, dec_caches) if dec_caches else None,
                model.prime_batch(prompts, pre_caches) if prompts else [])
    ids = _check_batch(model, tokens, dec_caches)
    pre = _check_prompts(model, prompts, pre_caches)
    pieces = [_pieces(model, t, c.pos, PRIME_CHUNK_MAX_TOKENS, exact) for t, c in zip(pre, pre_caches)]
    one_wave = all(len(p) == 1 for p in pieces) and sum(t.numel() for t in pre) <= PRIME_CHUNK_MAX_TOKENS
    # None from the executor: no captured mixed step fits, and an eager one would be host-bound here
    out = model.executor.run_mixed(ids, dec_caches, [p[0] for p in pieces], pre_caches) if one_wave else None
    if out is None:
        return model.decode_step_batch(ids, dec_caches), model.prime_batch(pre, pre_caches)
    counters.bump("decode_batch_rows", len(dec_caches))
    counters.bump("mixed_steps")
    return out


def _token_groups(items: list[int], sizes: list[int], budget: int) -> list[list[int]]:
    """items in order, grouped so that each group's sizes sum to at most `budget` (an item larger than the
    budget is a group of its own)."""
    groups: list[list[int]] = []
    total = budget + 1
    for item, size in zip(items, sizes):
        if total + size > budget:
            groups.append([])
            total = 0
        groups[-1].append(item)
        total += size
    return groups


def exact_piece(model) -> int:
    """Prefill forward size on the exact path for this model now: INVARIANT_PIECE where the invariant
    kernels run and the self-test found nothing a token's bits could take from the size of its forward
    (a kernel row that changes with the call, an elementwise op whose result depends on where a value
    sits in the tensor, a softmax row — MoE routing — that changes with its neighbours), else EXACT_PIECE."""
    if not model.ops.invariant:
        return EXACT_PIECE
    broken = [f for f in platform_report(model.dtype, model.device, model.ops.linear_family)
              if (f.startswith(("triton", "row softmax")) or " at offset " in f)
              and (model.ops.gdn_kernel or not f.startswith("triton gdn"))]  # a kernel this model does not run
    return EXACT_PIECE if broken else INVARIANT_PIECE


def forward_cuts(model, n: int, pos0: int, exact: bool) -> list[tuple[int, int]]:
    """[start, stop) of each forward of n prompt tokens at pos0. Exact path: cut at absolute multiples
    of exact_piece(model). Fast path: one piece."""
    return aligned_cuts(n, pos0, exact_piece(model)) if exact else [(0, n)]


def _plan(model, exact: bool) -> str:
    """The decode plan for this step: the model's (memra.decode_plan) on the exact path, one stacked
    forward on the fast path; refused where the placement cannot run it."""
    return model.executor.check_plan(decode_plan(model) if exact else "stacked")


@on_model_device
@torch.inference_mode()
def decode_step(model, token: int, cache: Cache) -> torch.Tensor:
    """Feed one generated token at cache.pos; returns next-token logits [V] (fp32)."""
    exact = _exact(model)
    tokens = _as_ids(model, [int(token)])
    plan = _plan(model, exact)
    model.executor.preflight("decode_step", [cache])
    cache.reserve(1)
    cache.drop_out_of_window()  # a sliding-window model's blocks behind every layer's window go back
    return model.executor.run_decode(tokens, [cache], plan, batched=False)[0]


def _check_batch(model, tokens, caches) -> torch.Tensor:
    """Every refusal of a batched step, before any cache advances."""
    if len(tokens) != len(caches):
        raise MemraError(f"decode_step_batch got {len(tokens)} tokens for {len(caches)} caches")
    if not caches:
        raise MemraError("decode_step_batch needs at least one sequence")
    if len({id(c) for c in caches}) != len(caches):
        raise MemraError("decode_step_batch got the same cache twice; each row must be its own sequence")
    model.executor.preflight("decode_step_batch", caches)
    if isinstance(tokens, torch.Tensor) and tokens.device.type != "cpu":
        ids = tokens.reshape(-1)  # already on the device: a sampler's choices (in range by construction)
    else:
        ids = _as_ids(model, [int(t) for t in tokens])
    for i, c in enumerate(caches):
        if c.pos + 1 > c.max_ctx:
            raise MemraError(f"row {i}: its cache is full ({c.max_ctx} tokens); grow it or finish the sequence")
    for c in caches:
        c.reserve(1)
        c.drop_out_of_window()
    return ids


@on_model_device
@torch.inference_mode()
def decode_step_batch(model, tokens, caches) -> torch.Tensor:
    """One decode step for B sequences at their own positions. -> logits [B, V] (fp32).

    Row i is bit-identical to decode_step(tokens[i], caches[i]) run alone (promise E1): each row is
    computed with exactly its B=1 shapes, or in a fixed-shape bucket verified on this model
    (memra.decode_plan).
    """
    exact = _exact(model)
    plan = _plan(model, exact)
    ids = _check_batch(model, tokens, caches)
    rows = model.executor.run_decode(ids, caches, plan, batched=True)
    counters.bump("decode_batch_rows", len(caches))
    return rows


def verify_plan(model, exact: bool) -> str:
    """The grouping of a verify's T columns: the decode plan's, so each column is computed exactly as
    decode computes that token (row: alone, B=1 shapes; stacked: one forward on invariant kernels)."""
    plan = decode_plan(model) if exact else "stacked"
    if plan == "bucket":
        raise MemraError("MEMRA_DECODE_PLAN=bucket has no verify body (its rows are padded sequences, not one "
                         "sequence's tokens); use MEMRA_DECODE_PLAN=row or stacked with speculative decoding")
    return model.executor.check_plan(plan)


@on_model_device
@torch.inference_mode()
def decode_step_t(model, chunk, pos0: int, cache: Cache, trail: StateTrail | None = None):
    """The verify forward: T = K+1 tokens fed at pos0 (= cache.pos) in one call.

    -> (logits [T, V] fp32, h_seed [T, E]). Column j's logits are bit-identical to what decode_step
    would return after feeding chunk[0..j] one by one (promise E4); h_seed[j] is the final-normed
    hidden of column j, the one a drafter (MTP) is re-seeded from after keeping tokens 0..j.
    The cache advances by T; `Cache.rollback(pos0, keep, trail)` drops a rejected suffix.
    Under an open PP door the forward takes the stage split (MEMRA_SPEC_PP, default on).
    """
    exact = _exact(model)
    ids = _as_ids(model, chunk)
    if pos0 != cache.pos:
        raise MemraError(f"decode_step_t: pos0={pos0} but the cache stands at {cache.pos}; a verify continues the "
                         f"sequence where it stands (roll back or restore first)")
    plan = verify_plan(model, exact)
    model.executor.preflight("decode_step_t", [cache])
    cache.reserve(ids.numel())  # refuses (context overflow) before any state changes
    logits, h_seed = model.executor.run_verify(ids, cache, plan, trail)
    counters.bump("spec_verify_forwards")
    counters.bump("spec_verify_columns", ids.numel())
    return logits, h_seed


@on_model_device
@torch.inference_mode()
def decode_step_batch_sampled(model, tokens, caches, samp, lean: bool = False):
    """decode_step_batch, then choose each row's next token on the device.

    samp[i] is a DevSamp (device row: greedy when temperature == 0, else seeded sampling whose noise
    depends only on (seed, ctr, token id)) or None (host row: the caller samples from the returned row).
    -> (rows, next_tokens): rows[i] is the logits row [V] on the host, except that with lean=True a
    device row's logits stay on the device in caches[i].last_logits_dev and rows[i] is None;
    next_tokens[i] is the device-chosen token, or None for host rows.
    """
    check_samp(samp, caches)
    return sample_rows(model.ops, decode_step_batch(model, tokens, caches), caches, samp, lean)


def check_samp(samp, caches) -> None:
    """Refuse a sampling spec list that does not fit the batch, before any cache moves."""
    from memra.sampling import DevSamp

    if len(samp) != len(caches):
        raise MemraError(f"decode_step_batch_sampled got {len(samp)} sampling specs for {len(caches)} caches")
    for i, s in enumerate(samp):
        if s is not None and not isinstance(s, DevSamp):
            raise MemraError(f"row {i}: sampling spec must be a DevSamp or None, got {type(s).__name__}")


def _rows(logits: torch.Tensor, idx: list[int]) -> torch.Tensor:
    """logits[idx] without the device copy in the usual case of every row."""
    return logits if idx == list(range(logits.shape[0])) else logits[idx]


def sample_rows(ops, logits: torch.Tensor, caches, samp, lean: bool):
    """The device-side choice after a batched step's logits [B, V] -> (rows, next_tokens), as
    decode_step_batch_sampled documents (shared by the pipeline driver across processes). Each row's
    token is its own device_sample choice (it cannot see its batchmates; ops.sample_batch); what the
    host needs comes back in two transfers (the chosen tokens, the host rows), not one or two per row."""
    on_device = [i for i, s in enumerate(samp) if s is not None]
    chosen = ops.sample_batch(_rows(logits, on_device), [samp[i] for i in on_device]).tolist() if on_device else []
    counters.bump("device_sampled_rows", len(on_device))
    to_host = [i for i, s in enumerate(samp) if s is None or not lean]
    host = dict(zip(to_host, _rows(logits, to_host).cpu())) if to_host else {}
    if lean:
        for i in on_device:
            caches[i].last_logits_dev = logits[i]
        counters.bump("lean_parked_rows", len(on_device))
    tokens = dict(zip(on_device, chosen))
    return [host.get(i) for i in range(len(samp))], [tokens.get(i) for i in range(len(samp))]
