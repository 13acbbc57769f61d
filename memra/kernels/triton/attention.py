"""Attention over a paged KV prefix in Triton: decode / verify rows, split at fixed positions for long prefixes
(the causal prefill of a prompt piece or a wave: memra.kernels.triton.prefill_attention). Keys are
visited in blocks fixed by absolute position, in order, with an online softmax in fp32 (scores and
P @ V as MMAs, p rounded to the model dtype for the second, as flash attention does), so a query's bits
depend only on its own prefix, never on the batch. Twins: reference.paged_attention_rows,
paged_decode_attention."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from memra.kernels.cuts import ATTN_SPLIT
from memra.kernels.triton.common import _interpreting, both, output_buffer
from memra.kernels.triton.launch import lean


def _decode_block_s(block_d: int) -> int:
    """KV positions per step of the decode loop: a [BLOCK_S, D] tile of K and of V per step (fixed by
    the head size, so by the model: a row's bits never depend on the batch)."""
    return max(16, min(128, 8192 // block_d))


@lean
@triton.jit(do_not_specialize=["SKIP_EMPTY", "n_splits"])
def _decode_attention_kernel(q_ptr, k_ptr, v_ptr, rows_ptr, starts_ptr, lens_ptr, o_ptr, m_ptr, l_ptr, out_ptr, Hq,
                             qk_scale, SKIP_EMPTY, n_splits, GROUP: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                             BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, SPLIT: tl.constexpr,
                             PARTIAL: tl.constexpr, IEEE: tl.constexpr, DIRECT: tl.constexpr = False,
                             WALK: tl.constexpr = False, COMBINE: tl.constexpr = False):
    # One program per (query row, KV head, split): the GROUP query heads that share a KV head read
    # each K/V tile once, as the rows of one MMA (padded to BLOCK_G >= 16; a row's MMA result is its
    # own, whatever its tile-mates). Query row r attends over its own prefix: positions 0..S-1 whose
    # flat KV-pool rows sit at rows[start : start + S] (start, S read from memory, so one launch serves
    # B sequences of decode or the T columns of a verify, and no length is a compile-time value).
    # Split p covers the positions [p * SPLIT, (p + 1) * SPLIT) of the n_splits: fixed by absolute position,
    # visited in order, BLOCK_S a step (_decode_block), with an online softmax in fp32 -- the same order whatever
    # the batch, so a row's bits are its own. WALK (MEMRA_ATTN_SPLIT_WALK; with PARTIAL and SKIP_EMPTY, as the
    # launcher sets it): one program per (query row, KV head) walks the row's positions in one loop, storing each
    # split's partial at the split's last block and starting the next from scratch: each split's blocks,
    # arithmetic and stores are its own program's, so the same bits, and where rows are many the launch has no
    # program for a split past a short row's prefix to start and retire. With DIRECT, a row that fits in split 0
    # writes its output after the loop, as split 0's program does, and no partial. COMBINE (with WALK,
    # MEMRA_ATTN_WALK_COMBINE): so does every row, a longer one by reading its splits' partials back and merging
    # them as _combine_splits_kernel does (_merge_partials): the launcher then launches no combine.
    r = tl.program_id(0)
    kvh = tl.program_id(1)
    start = tl.load(starts_ptr + r)
    S = tl.load(lens_ptr + r)
    cd = tl.arange(0, BLOCK_D)
    md = cd < D
    cg = tl.arange(0, BLOCK_G)
    heads = kvh * GROUP + cg  # [G] this KV head's query heads
    mg = cg < GROUP
    m_run = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    l_run = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
    if WALK:
        q = tl.load(q_ptr + (r * Hq + heads)[:, None] * D + cd[None, :], mask=mg[:, None] & md[None, :], other=0.0)
        STEP: tl.constexpr = BLOCK_S if BLOCK_S < SPLIT else SPLIT  # a split's blocks start where its program's do
        for s0 in range(0, S, STEP):
            hi = tl.minimum(S, (s0 // SPLIT + 1) * SPLIT)  # the end of this block's split, as its program has it
            m_run, l_run, acc = _decode_block(q, k_ptr, v_ptr, rows_ptr, start, kvh, s0, hi, cd, md, m_run, l_run, acc,
                                              qk_scale, HKV, D, BLOCK_S, IEEE)
            ends = s0 + STEP >= hi  # the split's last block: store its partial, and start the next split afresh
            at = (r * Hq + heads) * n_splits + s0 // SPLIT  # [G]
            keep = both(mg, ends)
            if DIRECT or COMBINE:  # a row of one split writes its output below, no partial
                keep = both(keep, S > SPLIT)
            _store_partial(m_ptr, l_ptr, o_ptr, at, keep, m_run, l_run, acc, cd, md, D)
            afresh = ends & (hi < S)  # the last split's state stays: a one-split row's output below
            m_run = tl.where(afresh, float("-inf"), m_run)
            l_run = tl.where(afresh, 0.0, l_run)
            acc = tl.where(afresh, 0.0, acc)
        if DIRECT or COMBINE:
            _store_output(out_ptr, r, Hq, heads, cd, acc, l_run, both(mg[:, None] & md[None, :], S <= SPLIT), D)
        if COMBINE:
            if S > SPLIT:
                tl.debug_barrier()  # the partials this program's threads stored, visible to all of them
                at = (r * Hq + heads) * n_splits  # [G]
                acc, l_run = _merge_partials(m_ptr, l_ptr, o_ptr, at, tl.cdiv(S, SPLIT), mg, cd, md, D, BLOCK_G,
                                              BLOCK_D)
                _store_output(out_ptr, r, Hq, heads, cd, acc, l_run, mg[:, None] & md[None, :], D)
    else:
        sp = tl.program_id(2)
        used = (sp * SPLIT < S) | (SKIP_EMPTY == 0)  # this split holds positions of the row, or is written anyway
        q = tl.load(q_ptr + (r * Hq + heads)[:, None] * D + cd[None, :], mask=both(mg[:, None] & md[None, :], used),
                    other=0.0)
        hi = tl.minimum(S, (sp + 1) * SPLIT)
        for s0 in range(sp * SPLIT, hi, BLOCK_S):  # empty for a split past the row's prefix
            m_run, l_run, acc = _decode_block(q, k_ptr, v_ptr, rows_ptr, start, kvh, s0, hi, cd, md, m_run, l_run, acc,
                                              qk_scale, HKV, D, BLOCK_S, IEEE)
        # PARTIAL: write this split's (max, sum, unnormalised output) for _combine_splits_kernel; otherwise (one
        # split covers every row) write the output itself. DIRECT (MEMRA_ATTN_SHORT_ROWS), with PARTIAL: a row
        # whose prefix fits in split 0 writes its output to out_ptr there, as the unsplit launch does, and no
        # partials (its other splits are empty); the combine skips it. SKIP_EMPTY (MEMRA_ATTN_SKIP_EMPTY; runtime,
        # so both ways run one machine code): a split past the row's prefix loads and stores nothing, and the
        # combine reads none of its partials, whose values (-inf, 0, 0) the combine's masked loads give in their
        # place: the same arithmetic, so the same bits.
        if PARTIAL:
            at = (r * Hq + heads) * n_splits + sp  # [G]
            keep = both(mg, used)
            if DIRECT:  # the unsplit launch's output (a row of other splits: masked off)
                _store_output(out_ptr, r, Hq, heads, cd, acc, l_run,
                              both(mg[:, None] & md[None, :], (S <= SPLIT) & (sp == 0)), D)
                keep = both(keep, S > SPLIT)
            _store_partial(m_ptr, l_ptr, o_ptr, at, keep, m_run, l_run, acc, cd, md, D)
        else:
            _store_output(o_ptr, r, Hq, heads, cd, acc, l_run, mg[:, None] & md[None, :], D)


@triton.jit
def _decode_block(q, k_ptr, v_ptr, rows_ptr, start, kvh, s0, hi, cd, md, m_run, l_run, acc, qk_scale,
                  HKV: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr, IEEE: tl.constexpr):
    # The positions s0 .. s0 + BLOCK_S (those below hi) into the running (max, sum, output) of q [G, D].
    ps = s0 + tl.arange(0, BLOCK_S)
    ms = ps < hi
    rows = tl.load(rows_ptr + start + ps, mask=ms, other=0)
    base = (rows * HKV + kvh) * D
    kt = tl.load(k_ptr + base[None, :] + cd[:, None], mask=ms[None, :] & md[:, None], other=0.0)  # [D, S]
    s = tl.where(ms[None, :], score_dot(q, kt, IEEE) * qk_scale, float("-inf"))  # [G, S], log2 units
    m_new = tl.maximum(m_run, tl.max(s, axis=1))  # finite: a step holds at least one position
    alpha = tl.exp2(m_run - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_run = l_run * alpha + tl.sum(p, axis=1)
    vt = tl.load(v_ptr + base[:, None] + cd[None, :], mask=ms[:, None] & md[None, :], other=0.0)  # [S, D]
    return m_new, l_run, acc * alpha[:, None] + weighted_dot(p, vt, IEEE)


@triton.jit
def _store_partial(m_ptr, l_ptr, o_ptr, at, keep, m_run, l_run, acc, cd, md, D: tl.constexpr):
    # A split's (max, sum, unnormalised output) for _combine_splits_kernel, at partial rows `at` [G] where `keep`.
    tl.store(m_ptr + at, m_run, mask=keep)
    tl.store(l_ptr + at, l_run, mask=keep)
    tl.store(o_ptr + at[:, None] * D + cd[None, :], acc, mask=keep[:, None] & md[None, :])


@triton.jit
def _merge_partials(m_ptr, l_ptr, part_ptr, at, n_used, mg, cd, md, D: tl.constexpr, BLOCK_G: tl.constexpr,
                    BLOCK_D: tl.constexpr):
    # The splits 0 .. n_used-1 of the partial rows `at` [G] merged in split order -> (acc [G, D], l [G]): for each
    # head the arithmetic of _combine_splits_kernel's program, whose splits past n_used are masked to (-inf, 0, 0)
    # and so change nothing (max with -inf; + 0 * 0 to a sum that is never -0).
    m_all = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    for sp in range(0, n_used):
        m_all = tl.maximum(m_all, tl.load(m_ptr + at + sp, mask=mg, other=float("-inf")))
    l_all = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
    for sp in range(0, n_used):
        w = tl.exp2(tl.load(m_ptr + at + sp, mask=mg, other=float("-inf")) - m_all)  # log2 units, as written
        l_all = l_all + tl.load(l_ptr + at + sp, mask=mg, other=0.0) * w
        acc = acc + tl.load(part_ptr + (at + sp)[:, None] * D + cd[None, :], mask=mg[:, None] & md[None, :],
                            other=0.0) * w[:, None]
    return acc, l_all


@triton.jit
def _store_output(out_ptr, r, Hq, heads, cd, acc, l_run, mask, D: tl.constexpr):
    # Row r's normalised output for its query heads `heads` [G] (acc [G, D] over l_run [G]) where `mask` [G, D].
    out = acc / l_run[:, None]
    tl.store(out_ptr + (r * Hq + heads)[:, None] * D + cd[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def score_dot(q, kt, IEEE: tl.constexpr):
    # q [M, D] @ kt [D, N] in fp32: on the tensor cores in the model's dtype, or IEEE fp32 (fp32 models, and the
    # interpreter, whose 16-bit dot is broken)
    if IEEE:
        s = tl.dot(q.to(tl.float32), kt.to(tl.float32), input_precision="ieee")
    else:
        s = tl.dot(q, kt)
    return s


@triton.jit
def weighted_dot(p, vt, IEEE: tl.constexpr):
    # p [M, N] fp32 @ vt [N, D]: p rounded to V's dtype first (as flash attention does), or IEEE fp32 (score_dot)
    if IEEE:
        pv = tl.dot(p, vt.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(vt.dtype), vt)
    return pv


@lean
@triton.jit(do_not_specialize=["SKIP_EMPTY"])
def _combine_splits_kernel(m_ptr, l_ptr, part_ptr, o_ptr, lens_ptr, Hq, SKIP_EMPTY, N_SPLITS: tl.constexpr,
                           D: tl.constexpr, BLOCK_D: tl.constexpr, SPLIT: tl.constexpr = 0,
                           DIRECT: tl.constexpr = False):
    # Program (row, head): the splits' partial softmaxes merged in split order. A row whose prefix fits
    # in split 0 gets exactly the unsplit kernel's bits: its weight is exp2(0) = 1, the empty splits'
    # are exp2(-inf) = 0 with zero partials, so sum and output pass through unchanged. That is what lets
    # the split be chosen per call (from the longest row) without changing any row's bits. DIRECT: a row
    # whose prefix fits in split 0 has its output already (_decode_attention_kernel); its program reads
    # and writes nothing. SKIP_EMPTY: the splits past the row's prefix were not written; their (-inf, 0, 0) come
    # from the masked loads instead.
    r = tl.program_id(0)
    h = tl.program_id(1)
    cd = tl.arange(0, BLOCK_D)
    md = cd < D
    S = tl.load(lens_ptr + r)
    if DIRECT:
        md = both(md, S > SPLIT)
    base = (r * Hq + h) * N_SPLITS
    m_all = tl.full((), float("-inf"), tl.float32)
    for sp in tl.static_range(N_SPLITS):
        used = (sp * SPLIT < S) | (SKIP_EMPTY == 0)
        m_all = tl.maximum(m_all, tl.load(m_ptr + base + sp, mask=used, other=float("-inf")))
    l_all = tl.zeros((), tl.float32)
    acc = tl.zeros((BLOCK_D,), tl.float32)
    for sp in tl.static_range(N_SPLITS):
        used = (sp * SPLIT < S) | (SKIP_EMPTY == 0)
        w = tl.exp2(tl.load(m_ptr + base + sp, mask=used, other=float("-inf")) - m_all)  # log2 units, as written
        l_all = l_all + tl.load(l_ptr + base + sp, mask=used, other=0.0) * w
        acc = acc + tl.load(part_ptr + (base + sp) * D + cd, mask=both(md, used), other=0.0) * w
    tl.store(o_ptr + (r * Hq + h) * D + cd, (acc / l_all).to(o_ptr.dtype.element_ty), mask=md)


# (row, KV head) programs from which MEMRA_ATTN_SPLIT_WALK walks a row's splits in one program: about eight an SM on
# an H100's 132, enough to fill it without splitting; below, a program a split (few long rows: a B=1 decode at 32k
# positions streams its prefix through HKV * 64 programs, not HKV). Which one runs moves no bit.
WALK_PROGRAMS = 1024


def decode_shape(q: torch.Tensor, k_pool: torch.Tensor) -> dict:
    """The decode kernel's constexprs for q [R, Hq, D] over k_pool [.., Hkv, D]: fixed by the model, so a row's
    bits never depend on the batch (tools/gpu_tune_attention.py launches with these too)."""
    hq, d, hkv = q.shape[-2], q.shape[-1], k_pool.shape[-2]
    group, block_d = hq // hkv, triton.next_power_of_2(d)
    return dict(GROUP=group, HKV=hkv, D=d, BLOCK_D=block_d, BLOCK_G=max(16, triton.next_power_of_2(group)),
                BLOCK_S=_decode_block_s(block_d), SPLIT=ATTN_SPLIT, IEEE=q.dtype == torch.float32 or _interpreting())


def paged_attention_rows(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, rows: torch.Tensor,
                         starts: torch.Tensor, lens: torch.Tensor, scale: float, max_len: int | None = None,
                         short_rows: bool = False, out: torch.Tensor | None = None, skip_empty: bool = False,
                         split_walk: bool = False, walk_combine: bool = False) -> torch.Tensor:
    """R query rows, each over its own paged prefix, in one launch (two for long prefixes). q [R, Hq, D];
    k/v_pool [n_blocks, BLOCK, Hkv, D]; rows [N] flat pool rows; row r's prefix is rows[starts[r] :
    starts[r] + lens[r]] in position order (its own K/V already written, last). max_len: a bound on
    every lens[r] known to the caller (default N). -> [R, Hq, D].

    Prefixes longer than ATTN_SPLIT are split at fixed positions over more programs (a B=1 decode at
    32k context would otherwise stream its prefix through just Hkv programs); a row's bits depend only
    on its own prefix either way (see _combine_splits_kernel). short_rows (MEMRA_ATTN_SHORT_ROWS): in a
    split launch, the rows that fit in one split skip the partials and the combine (the same bits). skip_empty
    (MEMRA_ATTN_SKIP_EMPTY): a split past a row's prefix writes no partials and the combine reads none (the same
    bits; a captured step's table is often four splits wide for rows of one). split_walk (MEMRA_ATTN_SPLIT_WALK),
    with skip_empty: where the call has WALK_PROGRAMS (row, KV head) programs or more, each walks its row's splits
    instead of a program a split (the same bits; with short_rows, a short row's walk ends in its output).
    walk_combine (MEMRA_ATTN_WALK_COMBINE): a walked launch merges each row's splits itself, with the combine's
    arithmetic, and no combine is launched (the same bits). out: a contiguous [R, Hq, D] of q's dtype that the
    output is written into (a mixed step's rows of its whole output)."""
    n, hq, d = q.shape
    hkv = k_pool.shape[-2]
    o = output_buffer(out, q.shape, q.dtype, q.device)
    if not n:
        return o
    n_splits = triton.cdiv(max_len if max_len is not None else rows.numel(), ATTN_SPLIT)
    q, rows, starts, lens = q.contiguous(), rows.contiguous(), starts.contiguous(), lens.contiguous()
    shape = decode_shape(q, k_pool)
    block_d = shape["BLOCK_D"]
    qk_scale = scale * 1.4426950408889634  # exp2 in the kernel
    if n_splits <= 1:
        _decode_attention_kernel[(n, hkv, 1)](q, k_pool, v_pool, rows, starts, lens, o, o, o, o, hq, qk_scale, 0, 1,
                                              PARTIAL=False, **shape)
        return o
    m = torch.empty(n, hq, n_splits, dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    part = torch.empty(n, hq, n_splits, d, dtype=torch.float32, device=q.device)
    skip = int(skip_empty)
    walk = split_walk and skip_empty and n * hkv >= WALK_PROGRAMS
    merged = walk and walk_combine
    _decode_attention_kernel[(n, hkv, 1 if walk else n_splits)](q, k_pool, v_pool, rows, starts, lens, part, m, l, o,
                                                                hq, qk_scale, skip, n_splits, PARTIAL=True,
                                                                DIRECT=short_rows, WALK=walk, COMBINE=merged, **shape)
    if not merged:
        _combine_splits_kernel[(n, hq)](m, l, part, o, lens, hq, skip, N_SPLITS=n_splits, D=d, BLOCK_D=block_d,
                                        SPLIT=shape["SPLIT"], DIRECT=short_rows)
    return o


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, rows: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """One new query per head over a paged prefix. q [Hq, D]; k/v_pool [n_blocks, BLOCK, Hkv, D];
    rows [S] flat pool rows of positions 0..S-1 (the new token's K/V already written). -> [Hq, D].
    The multi-row kernel with one row, so B=1 decode, batched decode and the verify share its code."""
    zero = torch.zeros(1, dtype=torch.long, device=q.device)
    lens = torch.full((1,), rows.numel(), dtype=torch.long, device=q.device)
    return paged_attention_rows(q[None], k_pool, v_pool, rows, zero, lens, scale)[0]
