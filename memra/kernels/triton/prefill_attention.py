"""Causal prefill attention over a paged KV prefix in Triton: one prompt piece, or every piece of a wave in one
launch. Keys are visited in blocks fixed by absolute position, in order, with an online softmax in fp32 (scores
and P @ V as the decode kernel's MMAs: memra.kernels.triton.attention's score_dot and weighted_dot), so a
query's bits depend only on its own prefix, never on the piece it came in. Twins: reference.prefill_attention,
prefill_attention_pieces."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from memra.kernels.pieces import ATTENTION_TILE
from memra.kernels.triton.attention import score_dot, weighted_dot
from memra.kernels.triton.common import _interpreting, output_buffer
from memra.kernels.triton.launch import lean

PREFILL_BLOCK_M, PREFILL_BLOCK_N, PREFILL_WARPS, PREFILL_STAGES = ATTENTION_TILE, 64, 4, 2


@lean
@triton.jit(do_not_specialize=["T", "pos0", "n_pieces", "WINDOW"])
def _prefill_attention_kernel(q_ptr, k_ptr, v_ptr, rows_ptr, o_ptr, pieces_ptr, T, pos0, n_pieces, Hq, qk_scale, WINDOW,
                              GROUP: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                              IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PIECES: tl.constexpr):
    # Program (BLOCK_M queries, head): flash attention with the keys visited in blocks of BLOCK_N from
    # position 0, whatever the queries. A query's bits cannot depend on the piece it came in or on the
    # tile it shares: its scores and its P @ V are per-row MMA results, the blocks it sees are fixed
    # by absolute position, and the blocks past its own position (there for its tile-mates) are fully
    # masked, which leaves its running max, sum and output untouched (alpha = 1, p = 0).
    # PIECES: the programs cover several sequences' pieces (memra.kernels.pieces.AttentionPieces),
    # each piece's tiles numbered as its solo launch numbers them; a program finds its piece in the
    # table and then runs that solo program's arithmetic on the piece's rows. A program past the last
    # piece's tiles (a captured step launches a bound on their count) gets no queries and no keys.
    # WINDOW (NO_WINDOW: none): a query at p sees p-WINDOW+1..p. The tile starts at the block holding its
    # first query's first key, still on the absolute grid; blocks a query cannot see are no-ops for it,
    # also before its first visible one (a fully masked row keeps max -inf, sum 0, output 0: the max used
    # to scale is 0 there, so exp2 never sees -inf - -inf).
    if PIECES:
        tile = tl.program_id(0)
        piece = tl.zeros((), tl.int32)
        first_tile = tl.zeros((), tl.int32)
        seen = tl.zeros((), tl.int32)
        for i in range(n_pieces):
            n_tiles = tl.cdiv(tl.load(pieces_ptr + i * 4 + 1), BLOCK_M)
            hit = (tile >= seen) & (tile < seen + n_tiles)
            piece = tl.where(hit, i, piece)
            first_tile = tl.where(hit, seen, first_tile)
            seen += n_tiles
        live = tile < seen
        row0 = tl.load(pieces_ptr + piece * 4)
        T = tl.where(live, tl.load(pieces_ptr + piece * 4 + 1), 0)
        pos0 = tl.where(live, tl.load(pieces_ptr + piece * 4 + 2), 0)
        rows_ptr += tl.load(pieces_ptr + piece * 4 + 3)
        mb = tile - first_tile
    else:
        row0 = 0
        mb = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // GROUP
    rm = mb * BLOCK_M + tl.arange(0, BLOCK_M)  # query index in the piece
    cd = tl.arange(0, BLOCK_D)
    md = cd < D
    q = tl.load(q_ptr + ((row0 + rm)[:, None] * Hq + h) * D + cd[None, :], mask=(rm[:, None] < T) & md[None, :],
                other=0.0)
    q_pos = pos0 + rm
    m_run = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_run = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    hi = tl.minimum(pos0 + (mb + 1) * BLOCK_M, pos0 + T)  # keys this tile's last query sees
    lo = tl.maximum(pos0 + mb * BLOCK_M - WINDOW + 1, 0)  # the first key its first query sees
    for n0 in range((lo // BLOCK_N) * BLOCK_N, hi, BLOCK_N):
        pn = n0 + tl.arange(0, BLOCK_N)
        mn = (pn < hi) & (pn >= lo)
        rows = tl.load(rows_ptr + pn, mask=mn, other=0)
        base = (rows * HKV + kvh) * D
        kt = tl.load(k_ptr + base[None, :] + cd[:, None], mask=mn[None, :] & md[:, None], other=0.0)  # [D, N]
        s = score_dot(q, kt, IEEE)
        # (not `seen`: the compiler types a name once per function, and PIECES's prologue made it an int32)
        visible = (pn[None, :] <= q_pos[:, None]) & (pn[None, :] > q_pos[:, None] - WINDOW) & mn[None, :]
        s = tl.where(visible, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_run, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # = m_new wherever a key was seen
        alpha = tl.exp2(m_run - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_run = l_run * alpha + tl.sum(p, axis=1)
        vt = tl.load(v_ptr + base[:, None] + cd[None, :], mask=mn[:, None] & md[None, :], other=0.0)  # [N, D]
        acc = acc * alpha[:, None] + weighted_dot(p, vt, IEEE)
        m_run = m_new
    out = acc / tl.where(l_run == 0.0, 1.0, l_run)[:, None]  # l = 0 only on padding rows (windowed), never stored
    tl.store(o_ptr + ((row0 + rm)[:, None] * Hq + h) * D + cd[None, :], out.to(o_ptr.dtype.element_ty),
             mask=(rm[:, None] < T) & md[None, :])


NO_WINDOW = 1 << 30  # the kernel's WINDOW for full attention: every earlier key is inside it


def prefill_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, rows: torch.Tensor, pos0: int,
                      scale: float, window: int | None = None) -> torch.Tensor:
    """T new queries of one sequence at positions pos0.. over its paged prefix (causal; with a sliding
    `window`, each over its last `window` positions). q [T, Hq, D]; k/v_pool [n_blocks, BLOCK, Hkv, D];
    rows [pos0 + T] flat pool rows in position order (the new tokens' K/V already written). -> [T, Hq, D].
    A query's bits do not depend on T or pos0's piece."""
    t, hq, d = q.shape
    o = torch.empty_like(q)
    if t:
        _launch_prefill(q, k_pool, v_pool, rows, o, (triton.cdiv(t, PREFILL_BLOCK_M), hq), scale, o, t, pos0, 0, False,
                        window)
    return o


def prefill_attention_pieces(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, pieces,
                             scale: float, window: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """prefill_attention for several sequences' pieces in one launch (memra.kernels.pieces
    .AttentionPieces): q [N, Hq, D] -> [N, Hq, D] (into `out`, as paged_attention_rows'), each piece's rows
    with the bits of its own call; rows in no piece are left unset."""
    hq = q.shape[1]
    o = output_buffer(out, q.shape, q.dtype, q.device)
    if pieces.tiles:
        _launch_prefill(q, k_pool, v_pool, pieces.rows, o, (pieces.tiles, hq), scale, pieces.table, 0, 0,
                        pieces.table.shape[0], True, window)
    return o


def _launch_prefill(q, k_pool, v_pool, rows, o, grid, scale, table, t, pos0, n_pieces, use_table, window) -> None:
    hq, d = q.shape[1:]
    hkv = k_pool.shape[-2]
    _prefill_attention_kernel[grid](
        q.contiguous(), k_pool, v_pool, rows.contiguous(), o, table, t, pos0, n_pieces, hq, scale * 1.4426950408889634,
        NO_WINDOW if window is None else window,
        GROUP=hq // hkv, HKV=hkv, D=d, BLOCK_D=triton.next_power_of_2(d),
        IEEE=q.dtype == torch.float32 or _interpreting(), BLOCK_M=PREFILL_BLOCK_M, BLOCK_N=PREFILL_BLOCK_N,
        PIECES=use_table, num_warps=PREFILL_WARPS, num_stages=PREFILL_STAGES)
