"""Seeded sampling of a whole batch in one Triton launch (memra.sampling.device_sample, row by row).

device_sample draws row r's token as argmax(logits / T + Gumbel(u)) over the allowed tokens, with
u = (top 53 bits of splitmix64(id ^ key(seed, ctr)) + 0.5) / 2^53: about fifteen torch launches per
row, so a B=128 sampled step pays ~2000 launches. Here one program per row walks the vocabulary in
blocks and keeps a running (best score, first index): the same integer hash in uint64 lanes (wrapping
multiplies are uint64 arithmetic mod 2^64, exactly torch's int64 lanes), the same fp64 operations in
the same order, the same first-index tie rule as torch.argmax. Greedy rows (T = 0) take the argmax of
the logits themselves. Rows that filter (top-k / top-p / min-p) pass the mask device_sample would
build (memra.sampling.allowed_tokens); the kernel does not sort.

A row's token reads only its own logits, seed and counter, so it cannot depend on the batch (E3).
Whether the fp64 logs round as torch's do is a property of the math library (libdevice on the GPU);
tests hold the kernel to device_sample token for token, in the interpreter and on the GPU (an H200:
libdevice's logs gave torch's tokens in every row). On by default on CUDA; MEMRA_SAMPLE_KERNEL=0 is
the door back to device_sample row by row.

With few rows, one program a row leaves most of the GPU idle while each walks its whole vocabulary
(126 blocks of Llama-3's 128k vocabulary, one after the other). `split` (MEMRA_SAMPLE_SPLIT, on) cuts each
row's vocabulary into parts of whole blocks, one program a part, and a second launch keeps, per row,
the first part holding the highest score. A part's best is the first index of its maximum, the parts
are in vocabulary order, and a maximum is exact: the token is the one the unsplit walk gives.

`prune` (MEMRA_SAMPLE_PRUNE, off) bounds each block's scores from above in fp32, with a margin far wider than
fp32's error (_score_ceiling), and skips the exact fp64 scores of a block whose bound stays below the best
score found so far: the Gumbel maximum over a large vocabulary is found early, and most later blocks cannot
reach it. A skipped entry's exact score is below that best, so it is never the maximum: the same token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from memra.sampling import _MASK64, DevSamp, _to_signed, allowed_tokens, splitmix64
from memra.upload import upload, upload_values

SAMPLE_BLOCK = 1024  # vocabulary entries per loop turn
# `split`: programs a launch aims for (a few per SM of an H100's 132), and the fewest blocks a part walks (a
# part's loop then outweighs its share of the combine)
SPLIT_PROGRAMS = 1024
SPLIT_MIN_BLOCKS = 4
# `prune`: added to each entry's fp32 ceiling on top of its relative slack (_score_ceiling); ~16x the Gumbel term's
# worst fp32 error, and small beside the spread of a block's best scores, so blocks still skip
PRUNE_SLACK = 1.0 / 1024.0


@triton.jit
def _splitmix64(x):
    x = x + 0x9E3779B97F4A7C15
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB
    return x ^ (x >> 31)


@triton.jit
def _score_ceiling(x, top53, temperature, slack):
    """An fp32 bound above each exact score x / T - log(-log(u)) of a block (u = (top53 + 0.5) / 2^53): the same
    formula in fp32, plus a slack far wider than its error. u's fp32 rounding moves -log(u) by ~2^-24 absolute;
    near u = 1, where that is most of -log(u), it is taken from 1 - u, exact in the integer (2^53 - top53), as
    w + w^2 / 2, within 2^-21 of -log(1 - w) for w < 2^-10. So -log(u) is within ~2^-14 relative, the Gumbel term
    within ~2^-14 absolute, and x / T within a few 2^-24 relative (T's reciprocal rounded once)."""
    w = ((9007199254740992 - top53).to(tl.float32) - 0.5) * (1.0 / 9007199254740992.0)  # 1 - u
    u = (top53.to(tl.float32) + 0.5) * (1.0 / 9007199254740992.0)
    minus_log_u = tl.where(w < 0.0009765625, w + 0.5 * w * w, -tl.log(u))  # 2^-10
    gumbel = -tl.log(minus_log_u)
    scaled = x * (1.0 / temperature).to(tl.float32)
    return scaled + gumbel + (tl.abs(scaled) + tl.abs(gumbel)) * (1.0 / 16384.0) + slack  # 2^-14


@triton.jit
def _sample_kernel(logits_ptr, key_ptr, temp_ptr, greedy_ptr, mask_ptr, out_ptr, score_ptr, skipped_ptr, V, SPAN,
                   stride_l, stride_m, slack, HAS_MASK: tl.constexpr, SPLIT: tl.constexpr, PRUNE: tl.constexpr,
                   BLOCK: tl.constexpr):
    """Row r's best over vocabulary part p (ids [p * SPAN, (p + 1) * SPAN)): its first index to out [B, P]
    and, where SPLIT, its score to score [B, P]. Unsplit, SPAN >= V and out is [B].
    PRUNE: a sampled row's block whose fp32 ceiling (_score_ceiling) stays below the part's best so far skips the
    exact fp64 scores (two fp64 logs and a division an entry, the walk's costly part): none of its entries can
    reach that best, which only rises, so none can be the part's first maximum. The part's skipped blocks go to
    skipped [B, P] (the tests' liveness count)."""
    r, p = tl.program_id(0), tl.program_id(1)
    parts = tl.num_programs(1)
    key = tl.load(key_ptr + r).to(tl.uint64, bitcast=True)
    temperature = tl.load(temp_ptr + r)  # fp64 (1 for greedy rows, unused there)
    greedy = tl.load(greedy_ptr + r) != 0
    start = p * SPAN
    end = tl.minimum(start + SPAN, V)
    best = tl.full((BLOCK,), float("-inf"), tl.float64)
    best_at = tl.full((BLOCK,), 0, tl.int64) + start
    skipped = tl.full((), 0, tl.int32)
    for v0 in range(start, end, BLOCK):
        ids = v0 + tl.arange(0, BLOCK)
        live = ids < end
        x32 = tl.load(logits_ptr + r * stride_l + ids, mask=live, other=float("-inf"))
        top53 = _splitmix64(ids.to(tl.uint64) ^ key) >> 11
        if HAS_MASK:
            live = live & (tl.load(mask_ptr + r * stride_m + ids, mask=live, other=0) != 0)
        if PRUNE:
            ceiling = _score_ceiling(x32, top53, temperature, slack)
            # NaN where x / T overflowed fp32 (a tiny T) or x is NaN: those blocks take the exact scores. A -inf
            # logit, or an entry masked off, never wins
            ceiling = tl.where(ceiling == ceiling, ceiling, float("inf"))
            ceiling = tl.where(live & (x32 != float("-inf")), ceiling, float("-inf"))
            top = tl.max(ceiling, axis=0)  # a block of nothing allowed moves nothing: skipped too
            exact = greedy | ((top >= tl.max(best, axis=0)) & (top != float("-inf")))
            skipped += tl.where(exact, 0, 1)
        else:
            exact = True
        if exact:
            x = x32.to(tl.float64)
            u = (top53.to(tl.float64) + 0.5) * (1.0 / 9007199254740992.0)  # 2^53
            score = tl.where(greedy, x, x / temperature - tl.log(-tl.log(u)))
            score = tl.where(live, score, float("-inf"))
            better = score > best  # strictly: an earlier block keeps a tie
            best_at = tl.where(better, ids.to(tl.int64), best_at)
            best = tl.where(better, score, best)
    if PRUNE:
        tl.store(skipped_ptr + r * parts + p, skipped)
    top = tl.max(best, axis=0)
    # the first index holding the maximum (torch.argmax's rule; an all -inf row gives the part's first index,
    # so 0 for the whole row, as torch's does)
    tl.store(out_ptr + r * parts + p, tl.min(tl.where(best == top, best_at, V), axis=0))
    if SPLIT:
        tl.store(score_ptr + r * parts + p, top)


@triton.jit
def _combine_kernel(score_ptr, at_ptr, out_ptr, P, BLOCK_P: tl.constexpr, NOWHERE: tl.constexpr):
    """Row r's token: the first index among the parts whose score is the row's highest (parts in vocabulary
    order, so the smallest such index)."""
    r = tl.program_id(0)
    p = tl.arange(0, BLOCK_P)
    live = p < P
    score = tl.load(score_ptr + r * P + p, mask=live, other=float("-inf"))
    at = tl.load(at_ptr + r * P + p, mask=live, other=NOWHERE)  # past every index: a padding lane never wins
    top = tl.max(score, axis=0)
    tl.store(out_ptr + r, tl.min(tl.where(score == top, at, NOWHERE), axis=0))


def split_span(rows: int, vocab: int) -> int:
    """The vocabulary entries one program walks under `split`: whole blocks, as many parts as bring the launch
    near SPLIT_PROGRAMS, none of fewer than SPLIT_MIN_BLOCKS blocks (a span >= vocab: one part)."""
    blocks = triton.cdiv(vocab, SAMPLE_BLOCK)
    parts = max(1, min(blocks // SPLIT_MIN_BLOCKS, triton.cdiv(SPLIT_PROGRAMS, max(rows, 1))))
    return triton.cdiv(blocks, parts) * SAMPLE_BLOCK


def row_keys(samps: list[DevSamp]) -> torch.Tensor:
    """Each row's key(seed, ctr) as device_sample's uniform_noise computes it -> int64 [B] on the host: one
    splitmix64 over the batch (a tensor of its own per row cost ~30-40 us of host time a row, 7.6 ms a step
    at 256 rows on an H100's host)."""
    return splitmix64(torch.tensor([_to_signed((s.seed & _MASK64) ^ ((s.ctr * 0xD1B54A32D192ED03) & _MASK64))
                                    for s in samps], dtype=torch.int64))


def sample_batch(logits: torch.Tensor, samps: list[DevSamp], split: bool = False, prune: bool = False,
                 skipped: list | None = None, slack: float = PRUNE_SLACK) -> torch.Tensor:
    """Row r of logits [B, V] chosen as device_sample(logits[r], samps[r]) would -> int64 [B] on the device.
    split: each row's vocabulary over several programs (split_span), then one combine launch; same tokens.
    prune: blocks that cannot hold the row's maximum skip its exact scores (the kernel's PRUNE); same tokens.
    skipped (a list, with prune): gets the launch's skipped blocks, int32 [B, parts]. slack: the pruning's margin
    (a test's canary sets it below zero, which must change tokens)."""
    b, v = logits.shape
    dev = logits.device
    keys = upload(row_keys(samps), dev)
    temps = upload_values([s.temperature if s.temperature else 1.0 for s in samps], torch.float64, dev)
    greedy = upload_values([s.temperature == 0.0 for s in samps], torch.uint8, dev)
    filtered = [i for i, s in enumerate(samps) if s.temperature and (s.top_k or s.top_p < 1.0 or s.min_p > 0.0)]
    mask = None
    if filtered:
        mask = torch.ones(b, v, dtype=torch.uint8, device=dev)
        for i in filtered:
            mask[i] = allowed_tokens(logits[i], samps[i]).to(torch.uint8)
    out = torch.empty(b, dtype=torch.int64, device=dev)
    if not b:
        return out
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    span = split_span(b, v) if split else v
    parts = triton.cdiv(v, span)
    at = out if parts == 1 else torch.empty(b, parts, dtype=torch.int64, device=dev)  # [B] | [B, P]
    scores = torch.empty(b, parts, dtype=torch.float64, device=dev) if parts > 1 else out
    counts = torch.empty(b, parts, dtype=torch.int32, device=dev) if prune else at  # not written unpruned
    if skipped is not None:
        skipped.append(counts)
    _sample_kernel[(b, parts)](logits, keys, temps, greedy, mask if mask is not None else greedy, at, scores, counts,
                               v, span, logits.stride(0), mask.stride(0) if mask is not None else 0, float(slack),
                               HAS_MASK=mask is not None, SPLIT=parts > 1, PRUNE=prune, BLOCK=SAMPLE_BLOCK)
    if parts > 1:
        _combine_kernel[(b,)](scores, at, out, parts, BLOCK_P=triton.next_power_of_2(parts), NOWHERE=2**62)
    return out
