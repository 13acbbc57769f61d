"""decode_step_t for several sequences at once: the engine's batched speculative verify.

    decode_step_t_batch(model, chunks, caches, trails) -> [(logits [T_i, V] fp32, h_seed [T_i, E]), ...]

Sequence i's T_i tokens are fed at caches[i].pos, rows of different lengths side by side in one forward
(no padding: each row carries only its own tokens). Row i's column j is bit-identical to what
decode_step would return after feeding chunks[i][0..j] one by one (E4), as in decode_step_t:
- under `stacked` (the batch-invariant kernels) the row-wise ops — projections, norms, gates, the
  FFN, the head — run once over all rows, and a row's bits are its own call's (the property E1's stacked
  decode rests on); attention reads each row's own prefix in order, after every row wrote its K/V (a
  row never reads another sequence's blocks, nor its own later positions); GDN runs each sequence's conv
  and delta-rule scan on its own state, the single verify's very calls;
- under `row` (CPU) every column runs alone with B=1 shapes, so the batch is the rows one after the
  other — exact, and no faster than verifying them one by one.
Each sequence's GDN states after each column go to trails[i], for its rollback. Where the executor has no
batched verify (a pipeline split) each sequence is verified alone (decode_step_t's walk).
"""

from __future__ import annotations

import torch

from memra import counters
from memra.errors import ContextOverflowError, MemraError
from memra.step import _as_ids, _exact, on_model_device, verify_plan


@on_model_device
@torch.inference_mode()
def decode_step_t_batch(model, chunks, caches, trails) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if not len(chunks) == len(caches) == len(trails) or not caches:
        raise MemraError(f"decode_step_t_batch got {len(chunks)} chunks, {len(caches)} caches and {len(trails)} "
                         "trails; it needs one of each per sequence, at least one")
    if len({id(c) for c in caches}) != len(caches):
        raise MemraError("decode_step_t_batch got the same cache twice; each row must be its own sequence")
    exact = _exact(model)
    ids = [_as_ids(model, c) for c in chunks]
    plan = verify_plan(model, exact)
    model.executor.preflight("decode_step_t", caches)
    for i, (c, t) in enumerate(zip(caches, ids)):  # every refusal before any cache moves
        if c.pos + t.numel() > c.max_ctx:
            raise ContextOverflowError(f"row {i}: a verify of {t.numel()} tokens at position {c.pos} overflows its "
                                       f"cache of {c.max_ctx}")
    for c, t in zip(caches, ids):
        c.reserve(t.numel())
    lens = [t.numel() for t in ids]
    batched = getattr(model.executor, "run_verify_batch", None)
    if batched is None or len(caches) == 1:
        out = [model.executor.run_verify(t, c, plan, tr) for t, c, tr in zip(ids, caches, trails)]
        counters.bump("spec_verify_forwards", len(caches))
    else:
        logits, h_seed = batched(torch.cat(ids), caches, lens, plan, trails)
        out = list(zip(logits.split(lens), h_seed.split(lens)))
        counters.bump("spec_verify_forwards")
        counters.bump("spec_verify_batch_rows", len(caches))
    counters.bump("spec_verify_columns", sum(lens))
    return out
