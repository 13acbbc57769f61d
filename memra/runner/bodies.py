"""The step bodies over a layer range: the arithmetic every executor runs, written once.

A body takes hidden states already embedded (or received across a stage boundary), runs decoder
layers [a, b) on one device, and returns hidden states; a head applies the final norm and lm_head.
The unsplit executor calls them over [0, L); a pipeline stage, in this process or in its own, over
its range. Same kernels, same shapes, same order wherever they run — which is why a split walk is
bit-identical to the unsplit one (E2): the boundary between two ranges only moves bytes.

Groupings (`plan`, memra.decode_plan): `row` runs each row (or verify column) alone with B=1 shapes;
`stacked` runs them as one forward on batch-invariant kernels.
"""

from __future__ import annotations

import torch

from memra.cache import Cache
from memra.graphs import eager_table_step, graphed_decode
from memra.state_trail import StateTrail


def piece_layers(model, h: torch.Tensor, cache: Cache, pos0: int, a: int, b: int | None,
                 device: torch.device | None = None) -> torch.Tensor:
    """One prompt piece h [n, E] at positions pos0.. through layers [a, b), GDN in its chunked (prompt)
    form. -> [n, E]; the cache position is not advanced (the caller does, once every stage has run)."""
    ctx = model.context(cache, pos0, h.shape[0], recurrent=False, device=device)
    return model.forward_layers(h, ctx, a, b)


def segment_layers(model, h: torch.Tensor, caches, pos0s: list[int], bounds: list[tuple[int, int]], a: int,
                   b: int | None, device: torch.device | None = None) -> torch.Tensor:
    """Prompt pieces of several sequences in one forward (cross-request prefill): h [N, E], piece i in
    rows bounds[i] = [lo, hi), caches[i]'s tokens at pos0s[i]..; through layers [a, b). -> [N, E];
    positions not advanced."""
    ctxs = model.wave_contexts(caches, pos0s, [hi - lo for lo, hi in bounds], device)
    return model.forward_layers_segments(h, ctxs, bounds, a, b)


def segment_bounds(pieces) -> list[tuple[int, int]]:
    """[lo, hi) of each piece's rows when the pieces are concatenated."""
    bounds, lo = [], 0
    for p in pieces:
        bounds.append((lo, lo + p.numel()))
        lo += p.numel()
    return bounds


def mixed_layers(model, h: torch.Tensor, dec_caches, pre_caches, bounds: list[tuple[int, int]]) -> torch.Tensor:
    """A decode step and a prefill wave in one walk over every layer: h [B + N, E], one new token for each
    of dec_caches (at cache.pos), then prompt pieces into pre_caches (piece i in rows B + bounds[i]).
    -> [B + N, E]; positions not advanced. The decode rows get their captured step's inputs
    (memra.graphs.eager_table_step), so each has the bits of the graphed step it replaces."""
    step = eager_table_step(model, dec_caches)
    ctxs = model.wave_contexts(pre_caches, [c.pos for c in pre_caches], [hi - lo for lo, hi in bounds])
    return model.forward_layers_mixed(h, step, ctxs, bounds)


def rows_layers(model, h: torch.Tensor, caches, plan: str, a: int, b: int | None,
                device: torch.device | None = None) -> torch.Tensor:
    """Decode rows h [n, E] (one new token per cache, at cache.pos) through layers [a, b), grouped by the
    plan. -> [n, E]; positions not advanced."""
    ctxs = [model.context(c, c.pos, 1, recurrent=True, device=device) for c in caches]
    if plan == "stacked":
        return model.forward_layers_stacked(h, ctxs, a, b)
    return torch.cat([model.forward_layers(h[i : i + 1], ctx, a, b) for i, ctx in enumerate(ctxs)])


def rows_head(model, h: torch.Tensor, plan: str) -> torch.Tensor:
    """Final norm + lm_head for decode rows [n, E] -> logits [n, V] fp32, grouped as the layers were."""
    if plan == "stacked":
        return model.logits(model.norm_out(h))
    return torch.cat([model.logits(model.norm_out(h[i : i + 1])) for i in range(h.shape[0])])


def verify_layers(model, h: torch.Tensor, cache: Cache, pos0: int, plan: str, a: int = 0, b: int | None = None,
                  trail: StateTrail | None = None, device: torch.device | None = None) -> torch.Tensor:
    """The verify forward's body: h [T, E], one sequence's tokens at pos0..pos0+T-1, through layers
    [a, b). Columns are decode steps — attention reads the KV prefix in position order, GDN takes the
    recurrent form one token at a time — so column j has the bits decode would give token j (E4). Every
    GDN layer records its state after each column into `trail` (for rollback)."""
    ctxs = model.column_contexts(cache, pos0, h.shape[0], device=device, trail=trail)
    if plan == "stacked":
        return model.forward_layers_stacked(h, ctxs, a, b, tokens=True)
    return torch.cat([model.forward_layers(h[j : j + 1], ctx, a, b) for j, ctx in enumerate(ctxs)])


def verify_rows_layers(model, h: torch.Tensor, caches, lens: list[int], plan: str, trails) -> torch.Tensor:
    """The batched verify's body over every layer: h [N, E], sequence i's lens[i] tokens at caches[i].pos.. in
    consecutive rows, each column a decode step of its own sequence (verify_layers' arithmetic). Under
    `stacked` the row-wise ops run over all N rows at once (batch-invariant kernels: a row's bits are its
    own call's), attention row by row over each row's own prefix, GDN per sequence; under `row` every
    column runs alone. Each sequence's GDN layers record into trails[i]. -> [N, E]; positions not advanced."""
    ctxs = [ctx for c, n, t in zip(caches, lens, trails) for ctx in model.column_contexts(c, c.pos, n, trail=t)]
    if plan == "stacked":
        return model.forward_layers_stacked(h, ctxs, tokens=True)
    return torch.cat([model.forward_layers(h[i : i + 1], ctx) for i, ctx in enumerate(ctxs)])


def verify_head(model, h: torch.Tensor, plan: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Final norm and lm_head grouped as decode groups them. -> (logits [T, V] fp32, normed hidden [T, E]:
    what an MTP drafter is re-seeded from)."""
    if plan == "stacked":
        normed = model.norm_out(h)
        return model.logits(normed), normed
    normed = torch.cat([model.norm_out(h[j : j + 1]) for j in range(h.shape[0])])
    return torch.cat([model.logits(normed[j : j + 1]) for j in range(h.shape[0])]), normed


def decode_one(model, token: torch.Tensor, cache: Cache) -> torch.Tensor:
    """One sequence's whole decode step with B=1 shapes (the cache already has room). -> logits [V] fp32;
    the position advances."""
    ctx = model.context(cache, cache.pos, 1, recurrent=True)
    h = model.forward_layers(model.embed_tokens(token), ctx)
    cache.pos += 1
    return model.logits(model.norm_out(h))[0]


def decode_stacked(model, ids: torch.Tensor, caches) -> torch.Tensor:
    """All rows' whole decode step in one stacked forward (matmuls over [B, E]) -> logits [B, V] fp32;
    positions advance. Replayed from a CUDA graph where one applies (memra.graphs). With MEMRA_EXACT=0
    (torch kernels) a row's bits may depend on B and on its place in the batch; under the exact
    `stacked` plan every op is a batch-invariant kernel, and under `bucket` the shape is fixed."""
    logits = graphed_decode(model, ids, caches)
    if logits is not None:
        return logits
    h = rows_layers(model, model.embed_tokens(ids), caches, "stacked", 0, None)
    for c in caches:
        c.pos += 1
    return model.logits(model.norm_out(h))
