"""How a decode step groups its rows: the exactness seam of batched decode.

    row     each row runs alone with B=1 shapes. Exact by construction (determinism is all it needs);
            B rows cost B forwards. The CPU default.
    bucket  rows run stacked in fixed buckets of BUCKET rows, padded with inert rows (scratch caches at
            position 0, never seen by a real sequence). A row's bits then come from calls of one fixed
            shape, so they cannot depend on B — provided no kernel lets a row's result depend on its
            position in the call or on its neighbours. That proviso is checked on the model itself
            (`verify_bucket`) before the plan is used; if it fails the plan is refused (fail closed).
            On a GPU decode is bound by reading the weights, so a 64-row bucket costs about what one
            row does: this is the plan that makes exact batching pay off there.

MEMRA_DECODE_PLAN = auto (default; today: row everywhere) | row | bucket (opt-in). `auto` will choose
bucket on CUDA once a GPU session has measured it there; until then a plan that was never run on the
hardware does not become anyone's default.
B=1 decode_step uses the same plan as decode_step_batch, so gate1 compares like with like.
"""

from __future__ import annotations

import os
import random

import torch

from memra.errors import MemraError
from memra.kernels.exact import ExactnessError

BUCKET = 64
PLANS = ("auto", "row", "bucket")


def requested_plan() -> str:
    raw = os.environ.get("MEMRA_DECODE_PLAN", "auto").strip().lower() or "auto"
    if raw not in PLANS:
        raise MemraError(f"MEMRA_DECODE_PLAN={raw!r} is not one of {', '.join(PLANS)}")
    return raw


def decode_plan(model) -> str:
    """The plan for this model now: the door, resolved and (for bucket) verified once per model."""
    want = requested_plan()
    if want in ("row", "auto"):
        return "row"
    if model.bucket_verified is None:
        model.bucket_verified = verify_bucket(model)
    if not model.bucket_verified:
        raise ExactnessError(
            f"MEMRA_DECODE_PLAN=bucket refused for {model.cfg.arch} on {model.device} {model.dtype}: a row's logits "
            "changed with its position or neighbours inside a fixed bucket; use MEMRA_DECODE_PLAN=row (exact, per row)"
        )
    return "bucket"


def pad_caches(model, n: int):
    """n scratch caches reset to an empty sequence: the inert rows that fill a bucket."""
    while len(model.pad_caches) < n:
        model.pad_caches.append(model.new_cache(16))
    pads = model.pad_caches[:n]
    for c in pads:
        c.reset()
        c.reserve(1)
    return pads


def decode_bucketed(model, ids: torch.Tensor, caches, stacked) -> torch.Tensor:
    """Rows in buckets of BUCKET, each padded with inert rows; `stacked(model, ids, caches)` runs one bucket."""
    out = []
    for a in range(0, len(caches), BUCKET):
        group = caches[a : a + BUCKET]
        pad = BUCKET - len(group)
        bucket_ids = torch.cat((ids[a : a + BUCKET], ids.new_zeros(pad)))
        out.append(stacked(model, bucket_ids, list(group) + pad_caches(model, pad))[: len(group)])
    return torch.cat(out)


@torch.inference_mode()
def verify_bucket(model, seed: int = 0) -> bool:
    """Decode the same BUCKET sequences (uneven prompts) in four arrangements — all in order, all
    shuffled, only the first half (the rest padding), and three of them alone — and require every
    sequence's row to have the same bits in every arrangement. A check on this model's real shapes,
    not a proof: it is the evidence the bucket plan needs before it may be used."""
    from memra.step import _decode_stacked

    rng = random.Random(seed)
    vocab = model.cfg.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randrange(2, 15))] for _ in range(BUCKET)]
    tokens = [rng.randrange(vocab) for _ in range(BUCKET)]
    shuffled = list(range(BUCKET))
    rng.shuffle(shuffled)
    arrangements = [list(range(BUCKET)), shuffled, list(range(BUCKET // 2))] + [[i] for i in range(3)]
    seen: dict[int, torch.Tensor] = {}
    for order in arrangements:
        caches = [model.new_cache(32) for _ in order]
        for i, c in zip(order, caches):
            model.prime(prompts[i], c)
            c.reserve(1)
        ids = torch.tensor([tokens[i] for i in order], device=model.device)
        rows = decode_bucketed(model, ids, caches, _decode_stacked)
        for r, i in enumerate(order):
            if i in seen and not torch.equal(rows[r], seen[i]):
                return False
            seen.setdefault(i, rows[r])
        for c in caches:
            c.free()
    return True
