"""The step bodies: prime (chunked prefill), decode_step (B = 1) and decode_step_batch (B rows).

All are "embed, walk layers [0, L), norm, head" with a different StepContext: prompt tokens take
the GDN chunked form, generated tokens the recurrent form (the same way in every run, which is what
makes runs comparable bit for bit). Every check that can refuse happens before any state moves.

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
from memra.cache import PRIME_CHUNK_MAX_TOKENS, Cache, StateTrail
from memra.errors import MemraError
from memra.kernels.cuts import TILE, aligned_cuts
from memra.kernels.exact import platform_report, require_exact

EXACT_PIECE = TILE  # prefill forward size on the exact path; equals the GDN chunk so cuts line up
INVARIANT_PIECE = PRIME_CHUNK_MAX_TOKENS  # ... where every prefill op is batch-invariant (exact_piece)


def on_model_device(fn):
    """Run a step body with the model's GPU as the current CUDA device. Triton launches its kernels
    on the current device, so a model loaded onto cuda:1 while the process's current device is
    cuda:0 would hand cuda:1 pointers to kernels on cuda:0. A no-op on CPU and wherever the model's
    device is already current (every one-GPU machine); the pipeline's stage scopes set their own."""

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
    return t.to(model.device)


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
    exact = model.settings.exact
    if exact:
        require_exact(model.dtype, model.device)
    tokens = _as_ids(model, ids)
    rt = _pp_runtime(model)
    # MEMRA_PRIME_PP=0 (the unsplit prime) is deliberately not refused on a sharded placement, unlike
    # the unsplit decode and verify: it is the prime gate's reference arm, and a 4096-token prime
    # amortises its remote weight reads (the reference system's rule, fence.prime_pp_on).
    cache.reserve(tokens.numel())  # refuses (context overflow) before any state changes
    if rt is not None and rt.doors.prime_pp:
        from memra.pp.walk import prime_split

        pieces, pos = [], cache.pos
        for start in range(0, tokens.numel(), chunk):
            for piece in _forward_pieces(model, tokens[start : start + chunk], pos, exact):
                pieces.append(piece)
                pos += piece.numel()
        return prime_split(model, rt, pieces, cache, all_logits, hidden)
    outputs, normed = [], []
    h_last = None
    for start in range(0, tokens.numel(), chunk):
        for piece in _forward_pieces(model, tokens[start : start + chunk], cache.pos, exact):
            ctx = model.context(cache, cache.pos, piece.numel(), recurrent=False)
            h = model.forward_layers(model.embed_tokens(piece), ctx)
            cache.pos += piece.numel()
            counters.bump("prime_pieces")
            if all_logits or hidden:
                normed.append(model.norm_out(h))
                if all_logits:
                    outputs.append(model.logits(normed[-1]))
            h_last = h[-1:]
    out = torch.cat(outputs) if all_logits else model.logits(model.norm_out(h_last))[0]
    return (out, torch.cat(normed)) if hidden else out


def exact_piece(model) -> int:
    """Prefill forward size on the exact path for this model now: INVARIANT_PIECE where the invariant
    kernels run and the self-test found nothing a token's bits could take from the size of its forward
    (a kernel row that changes with the call, an elementwise op whose result depends on where a value
    sits in the tensor, a softmax row — MoE routing — that changes with its neighbours), else EXACT_PIECE."""
    if not model.ops.invariant:
        return EXACT_PIECE
    broken = [f for f in platform_report(model.dtype, model.device)
              if (f.startswith(("triton", "row softmax")) or " at offset " in f)
              and (model.ops.gdn_kernel or not f.startswith("triton gdn"))]  # a kernel this model does not run
    return EXACT_PIECE if broken else INVARIANT_PIECE


def forward_cuts(model, n: int, pos0: int, exact: bool) -> list[tuple[int, int]]:
    """[start, stop) of each forward of n prompt tokens at pos0. Exact path: cut at absolute multiples
    of exact_piece(model). Fast path: one piece."""
    return aligned_cuts(n, pos0, exact_piece(model)) if exact else [(0, n)]


def _forward_pieces(model, tokens: torch.Tensor, pos0: int, exact: bool) -> list[torch.Tensor]:
    return [tokens[a:b] for a, b in forward_cuts(model, tokens.numel(), pos0, exact)]


def _decode_one(model, token: torch.Tensor, cache: Cache) -> torch.Tensor:
    """One sequence's decode step with B=1 shapes (the cache already has room). -> logits [V] fp32."""
    ctx = model.context(cache, cache.pos, 1, recurrent=True)
    h = model.forward_layers(model.embed_tokens(token), ctx)
    cache.pos += 1
    return model.logits(model.norm_out(h))[0]


def _pp_runtime(model):
    """The pipeline runtime when the MEMRA_PP_* doors open it, else None (memra.pp.walk)."""
    from memra.pp.walk import active_runtime

    return active_runtime(model)


def _decode_rows(model, ids: torch.Tensor, caches, exact: bool, rt=None, dual: bool = False) -> torch.Tensor:
    """The decode body shared by decode_step and decode_step_batch, grouped by the decode plan;
    through the stage split when a pipeline runtime is given (as two waves when `dual`)."""
    from memra.decode_plan import decode_bucketed, decode_plan

    plan = decode_plan(model) if exact else "stacked"
    if rt is not None:
        from memra.pp.walk import decode_waves, plan_for_pp, walk_rows

        plan = plan_for_pp(plan)
        if dual:
            return decode_waves(model, rt, ids, caches, plan)
        return walk_rows(model, rt, ids, caches, plan)
    if not exact:
        return _decode_stacked(model, ids, caches)
    if plan == "stacked":
        return _decode_stacked(model, ids, caches)
    if plan == "bucket":
        return decode_bucketed(model, ids, caches, _decode_stacked)
    return torch.stack([_decode_one(model, ids[i : i + 1], c) for i, c in enumerate(caches)])


@on_model_device
@torch.inference_mode()
def decode_step(model, token: int, cache: Cache) -> torch.Tensor:
    """Feed one generated token at cache.pos; returns next-token logits [V] (fp32)."""
    exact = model.settings.exact
    if exact:
        require_exact(model.dtype, model.device)
    tokens = _as_ids(model, [int(token)])
    rt = _pp_runtime(model)
    cache.reserve(1)
    return _decode_rows(model, tokens, [cache], exact, rt)[0]


# --- the verify forward (speculative decoding) ---------------------------------------------------------


def verify_plan(model, exact: bool) -> str:
    """The grouping of a verify's T columns: the decode plan's, so each column is computed exactly as
    decode computes that token (row: alone, B=1 shapes; stacked: one forward on invariant kernels)."""
    from memra.decode_plan import decode_plan

    plan = decode_plan(model) if exact else "stacked"
    if plan == "bucket":
        raise MemraError("MEMRA_DECODE_PLAN=bucket has no verify body (its rows are padded sequences, not one "
                         "sequence's tokens); use MEMRA_DECODE_PLAN=row or stacked with speculative decoding")
    return plan


def verify_layers(model, h: torch.Tensor, cache: Cache, pos0: int, plan: str, start: int = 0, stop: int | None = None,
                  trail: StateTrail | None = None, device: torch.device | None = None) -> torch.Tensor:
    """The one range-scoped verify body, called by the unsplit verify and by each pipeline stage:
    h [T, E], tokens at pos0..pos0+T-1, through layers [start, stop). Every GDN layer records its state
    after each column into `trail` (for rollback). Columns are decode steps: attention reads the KV
    prefix in position order, GDN takes the recurrent form one token at a time."""
    ctxs = [model.context(cache, pos0 + j, 1, recurrent=True, device=device, trail=trail, column=j)
            for j in range(h.shape[0])]
    if plan == "stacked":
        return model.forward_layers_stacked(h, ctxs, start, stop, tokens=True)
    return torch.cat([model.forward_layers(h[j : j + 1], ctx, start, stop) for j, ctx in enumerate(ctxs)])


def verify_head(model, h: torch.Tensor, plan: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Final norm and lm_head grouped as decode groups them. -> (logits [T, V] fp32, normed hidden [T, E])."""
    if plan == "stacked":
        normed = model.norm_out(h)
        return model.logits(normed), normed
    normed = torch.cat([model.norm_out(h[j : j + 1]) for j in range(h.shape[0])])
    return torch.cat([model.logits(normed[j : j + 1]) for j in range(h.shape[0])]), normed


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
    exact = model.settings.exact
    if exact:
        require_exact(model.dtype, model.device)
    ids = _as_ids(model, chunk)
    if pos0 != cache.pos:
        raise MemraError(f"decode_step_t: pos0={pos0} but the cache stands at {cache.pos}; a verify continues the "
                         f"sequence where it stands (roll back or restore first)")
    plan = verify_plan(model, exact)
    rt = _pp_runtime(model)
    if rt is not None:
        from memra.pp.walk import plan_for_pp, refuse_unsplit

        plan = plan_for_pp(plan)
        if not rt.doors.spec_pp:
            refuse_unsplit(rt, "decode_step_t", "MEMRA_SPEC_PP=1 (the split verify)")
            rt = None
    cache.reserve(ids.numel())  # refuses (context overflow) before any state changes
    if rt is not None:
        from memra.pp.walk import walk_verify

        logits, h_seed = walk_verify(model, rt, ids, cache, plan, trail)
    else:
        h = verify_layers(model, model.embed_tokens(ids), cache, pos0, plan, trail=trail)
        logits, h_seed = verify_head(model, h, plan)
    cache.pos += ids.numel()
    counters.bump("spec_verify_forwards")
    counters.bump("spec_verify_columns", ids.numel())
    return logits, h_seed


def _check_batch(model, tokens, caches) -> torch.Tensor:
    """Every refusal of a batched step, before any cache advances."""
    if len(tokens) != len(caches):
        raise MemraError(f"decode_step_batch got {len(tokens)} tokens for {len(caches)} caches")
    if not caches:
        raise MemraError("decode_step_batch needs at least one sequence")
    if len({id(c) for c in caches}) != len(caches):
        raise MemraError("decode_step_batch got the same cache twice; each row must be its own sequence")
    ids = _as_ids(model, [int(t) for t in tokens])
    for i, c in enumerate(caches):
        if c.pos + 1 > c.max_ctx:
            raise MemraError(f"row {i}: its cache is full ({c.max_ctx} tokens); grow it or finish the sequence")
    for c in caches:
        c.reserve(1)
    return ids


@on_model_device
@torch.inference_mode()
def decode_step_batch(model, tokens, caches) -> torch.Tensor:
    """One decode step for B sequences at their own positions. -> logits [B, V] (fp32).

    Row i is bit-identical to decode_step(tokens[i], caches[i]) run alone (promise E1): each row is
    computed with exactly its B=1 shapes, or in a fixed-shape bucket verified on this model
    (memra.decode_plan).
    """
    exact = model.settings.exact
    if exact:
        require_exact(model.dtype, model.device)
    rt, dual = _pp_runtime(model), False
    if rt is not None:
        from memra.pp.walk import check_dual, refuse_unsplit

        if not rt.doors.batch_pp:  # the unsplit batched body over the pipeline's placement
            refuse_unsplit(rt, "decode_step_batch", "MEMRA_BATCH_PP=1 (the split batched body)")
            rt = None
        else:
            dual = check_dual(rt, len(caches))  # refuses before any cache moves
    ids = _check_batch(model, tokens, caches)
    rows = _decode_rows(model, ids, caches, exact, rt, dual)
    counters.bump("decode_batch_rows", len(caches))
    return rows


def _decode_stacked(model, ids: torch.Tensor, caches) -> torch.Tensor:
    """All rows in one stacked forward (matmuls over [B, E]). With MEMRA_EXACT=0 (torch kernels) a
    row's bits may depend on B and on its place in the batch; under the exact `stacked` plan every op
    is a batch-invariant kernel, and under `bucket` the shape is fixed (memra.decode_plan)."""
    from memra.graphs import graphed_decode

    logits = graphed_decode(model, ids, caches)  # the same step replayed from a CUDA graph, where it applies
    if logits is not None:
        return logits
    ctxs = [model.context(c, c.pos, 1, recurrent=True) for c in caches]
    h = model.forward_layers_stacked(model.embed_tokens(ids), ctxs)
    for c in caches:
        c.pos += 1
    return model.logits(model.norm_out(h))


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
