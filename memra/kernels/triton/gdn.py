"""Gated DeltaNet's delta rule in Triton: one token at a time for decode and the verify (`delta_rule_scan`,
`delta_rule_step`, at the end of this file), and over a prompt piece in chunks (`gdn_prefill`).

The chunked prefill runs in three Triton launches per layer: for one prompt piece, or for the pieces of
several sequences in one wave of cross-request prefill (gdn_prefill_pieces: their states stepped in
place in the pool, each piece's programs the ones its own call runs).

The reference (reference.gdn_prefill) runs the closed (WY) form chunk by chunk from the host: ~25 torch
launches per 64-token chunk, so a 4096-token piece of a 24-GDN-layer model issues ~40k launches. Per
chunk of n <= 64 tokens (G = cumsum(g), Gamma_ij = exp(G_i - G_j) for i >= j, else 0):

    A   = strict_lower(diag(beta) K K^T * Gamma)                     [n, n]
    T   = (I + A)^-1 = (I - A)(I + A^2)(I + A^4)(I + A^8)(I + A^16)(I + A^32)
          (A is strictly lower triangular, so A^64 = 0: five squarings replace the triangular solve's
          64 dependent row steps with tensor-shaped products)
    U   = T diag(beta) V          W = T diag(beta exp(G)) K          P = (Q K^T) * Gamma
    V'  = U - W S                  O = diag(exp(G)) Q S + P V'
    S'  = exp(G_last) S + (diag(exp(G_last - G)) K)^T V'

Everything in the first line block reads only the chunk's own tokens, so it runs over every (chunk, head)
at once, in two launches: T (`_gdn_chunk_inverse`, the bulk of the arithmetic: the squarings), stored
through memory, then U, W and P (`_gdn_chunk_products`). Apart, each fits in fewer registers and half the
shared memory of one launch doing both, so two programs share an SM: 0.52 ms a layer at 4,096 tokens x 32
heads on an H100 against 1.41 for the one launch, and Qwen3.5-9B's `memra bench throughput` 7,693 output
tok/s against 7,290 with that launch (one H100, 2026-12-07). Only the last two lines carry the state, so the
third launch (`_gdn_chunk_scan`) is one program per (value head, block of value columns) walking the chunks
in order with its columns of the state in registers — three thin products per chunk. (The first form of
this kernel did everything in the serial walk and was 0.57x the reference's speed on an H200: the
squarings sat on the critical path, four times over.)

The products are fp32 in, fp32 out, as "tf32x3": each operand is split into a TF32 head and a TF32
tail and three tensor-core products are summed (head*head + head*tail + tail*head), which leaves the
error at fp32's level (relative difference from the reference 1.0e-6, the same as CUDA-core "ieee"
products). On an H200 at 4096 tokens x 32 heads x 128 x 128 (tools/gpu_gdn_prefill.py) one layer
took 3.0 ms against 44.9 ms for the reference's loop; the same kernels with "ieee" products took
41 ms (17.7 prep + 23.4 scan: the FMA lowering of 64-wide fp32 tiles) and minutes to compile.
Triton's interpreter ignores the precision, so the CPU tests check the algebra and the piece bits;
the GPU's bits are checked on the GPU (the self-test's GDN probe, tests under MEMRA_TEST_DEVICE=cuda).

Same meaning as the reference; the sums differ in order (and T is a product rather than a
substitution), so the twin test allows fp32 rounding noise. Bits: chunks are cut at absolute multiples
of the chunk length (the same cuts as the reference), and a chunk's arithmetic reads only its own
tokens and the state it is handed, so a token's output does not depend on how the prompt was split
into pieces (E5) -- tested bit for bit. On by default where the invariant kernels run
(MEMRA_GDN_KERNEL=0: the reference's loop).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from memra.kernels.cuts import aligned_cuts
from memra.kernels.reference import GDN_CHUNK
from memra.kernels.slots import INERT_SLOT
from memra.kernels.triton.common import both, output_buffer
from memra.kernels.triton.launch import lean
from memra.upload import upload_parts

# Frozen launch configs (tools/gpu_gdn_prefill.py times the alternatives): value columns of the state per
# scan program, and warps per program of each launch.
GDN_SCAN_BLOCK_DV = 32
GDN_SCAN_WARPS = 4
GDN_SCAN_STAGES = 1  # the walk's loads staged ahead: three [64, 128] fp32 tiles per stage (shared memory)
GDN_PREP_WARPS = 4  # 0.52 ms a layer (T, then U, W, P) at 4096 tokens x 32 heads on an H100, against 0.87 with 8
# fp32 products: "tf32x3" (three TF32 tensor-core products, fp32-level error); "ieee" (CUDA-core FMAs) is
# 14x slower here
GDN_DOT_PRECISION = "tf32x3"


@triton.jit
def _as_stored(s, STATE_BF16: tl.constexpr):
    """The fp32 state as its storage holds it (GdnConfig.state_dtype): rounded to bf16, to nearest with ties to
    even, where it is stored in bf16 (else unchanged). On the bits, not a cast, since Triton's interpreter
    truncates where the GPU rounds: the CPU tests then see the GPU's bits, and torch's .to(torch.bfloat16)."""
    if STATE_BF16:
        bits = s.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        s = bits.to(tl.float32, bitcast=True)
    return s


@triton.jit
def _dot(a, b, PREC: tl.constexpr):
    return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _chunk_gates(beta_ptr, g_ptr, a, n, h, H, CHUNK: tl.constexpr):
    """A chunk's beta [C] and G = cumsum(g) [C] (padding rows: beta = 0, g = 0, so G stays at G_last)."""
    t = a + tl.arange(0, CHUNK)
    mt = t < a + n
    beta = tl.load(beta_ptr + t * H + h, mask=mt, other=0.0)
    gcum = tl.cumsum(tl.load(g_ptr + t * H + h, mask=mt, other=0.0), axis=0)
    return beta, gcum


@triton.jit
def _chunk_tile(x_ptr, a, n, h, H, D: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK: tl.constexpr):
    """A chunk's rows of a [T, H, D] tensor at head h: [C, BLOCK_D], zero past the chunk and past D."""
    t, cd = a + tl.arange(0, CHUNK), tl.arange(0, BLOCK_D)
    mask = (t < a + n)[:, None] & (cd < D)[None, :]
    return tl.load(x_ptr + (t[:, None] * H + h) * D + cd[None, :], mask=mask, other=0.0)


@triton.jit
def _decays(gcum, CHUNK: tl.constexpr):
    """Gamma_ij = exp(G_i - G_j) on and below the diagonal (<= 1: the decays are <= 0), zero above. [C, C]"""
    rc = tl.arange(0, CHUNK)
    return tl.where(rc[:, None] >= rc[None, :], tl.exp(gcum[:, None] - gcum[None, :]), 0.0)


@lean
@triton.jit
def _gdn_chunk_inverse(k_ptr, beta_ptr, g_ptr, cuts_ptr, inv_ptr, H, DK: tl.constexpr, BLOCK_DK: tl.constexpr,
                       CHUNK: tl.constexpr, PREC: tl.constexpr):
    """First launch, one (chunk, head): T = (I + A)^-1 [C, C] for A = strict_lower(diag(beta) K K^T * Gamma),
    as (I - A) times (I + A^(2^i)), stored whole (fp32: an exact round trip to the second launch)."""
    c, h = tl.program_id(0), tl.program_id(1)
    a = tl.load(cuts_ptr + c)
    n = tl.load(cuts_ptr + c + 1) - a
    if n > 0:  # a captured step launches a bound on the chunk count: the rest are empty
        kc = _chunk_tile(k_ptr, a, n, h, H, DK, BLOCK_DK, CHUNK)
        beta, gcum = _chunk_gates(beta_ptr, g_ptr, a, n, h, H, CHUNK)
        rc = tl.arange(0, CHUNK)
        amat = tl.where(rc[:, None] > rc[None, :], beta[:, None] * _dot(kc, tl.trans(kc), PREC) * _decays(gcum, CHUNK),
                        0.0)
        eye = tl.where(rc[:, None] == rc[None, :], 1.0, 0.0)
        inv = eye - amat
        power = _dot(amat, amat, PREC)
        for i in tl.static_range(5):
            inv = _dot(inv, eye + power, PREC)
            if i < 4:
                power = _dot(power, power, PREC)
        tl.store(inv_ptr + ((c * H + h) * CHUNK + rc[:, None]) * CHUNK + rc[None, :], inv)


@lean
@triton.jit
def _gdn_chunk_products(q_ptr, k_ptr, v_ptr, beta_ptr, g_ptr, cuts_ptr, inv_ptr, u_ptr, w_ptr, p_ptr, gcum_ptr, H,
                        DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
                        CHUNK: tl.constexpr, PREC: tl.constexpr):
    """Second launch, one (chunk, head): U [n, Dv], W [n, Dk] and G [n] at the chunk's tokens, P [C, C] at the
    chunk, from the stored T. Each operand is loaded just before its product and each result stored as made,
    so few [64, 128] fp32 tiles are live at once (nothing spills at 4 warps)."""
    c, h = tl.program_id(0), tl.program_id(1)
    a = tl.load(cuts_ptr + c)
    n = tl.load(cuts_ptr + c + 1) - a
    if n > 0:
        rc, ck, cv = tl.arange(0, CHUNK), tl.arange(0, BLOCK_DK), tl.arange(0, BLOCK_DV)
        t = a + rc
        mt = rc < n
        inv = tl.load(inv_ptr + ((c * H + h) * CHUNK + rc[:, None]) * CHUNK + rc[None, :])
        beta, gcum = _chunk_gates(beta_ptr, g_ptr, a, n, h, H, CHUNK)
        u = _dot(inv, beta[:, None] * _chunk_tile(v_ptr, a, n, h, H, DV, BLOCK_DV, CHUNK), PREC)  # [C, DV]
        tl.store(u_ptr + (t[:, None] * H + h) * DV + cv[None, :], u, mask=mt[:, None] & (cv < DV)[None, :])
        kc = _chunk_tile(k_ptr, a, n, h, H, DK, BLOCK_DK, CHUNK)  # [C, DK]
        k_mask = mt[:, None] & (ck < DK)[None, :]
        w = _dot(inv, (beta * tl.exp(gcum))[:, None] * kc, PREC)  # [C, DK]
        tl.store(w_ptr + (t[:, None] * H + h) * DK + ck[None, :], w, mask=k_mask)
        qc = _chunk_tile(q_ptr, a, n, h, H, DK, BLOCK_DK, CHUNK)
        p = _dot(qc, tl.trans(kc), PREC) * _decays(gcum, CHUNK)  # [C, C]
        tl.store(p_ptr + ((c * H + h) * CHUNK + rc[:, None]) * CHUNK + rc[None, :], p)
        tl.store(gcum_ptr + t * H + h, gcum, mask=mt)


@lean
@triton.jit(do_not_specialize=["stride_slot"])
def _gdn_chunk_scan(q_ptr, k_ptr, u_ptr, w_ptr, p_ptr, gcum_ptr, s_ptr, o_ptr, s_out_ptr, cuts_ptr, pieces_ptr,
                    stride_slot, H, DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr,
                    BLOCK_DV: tl.constexpr, CHUNK: tl.constexpr, PREC: tl.constexpr, STATE_BF16: tl.constexpr):
    """One (value head, block of value columns, piece): the piece's state columns through its chunks in
    order. A piece is a row of pieces_ptr (first row, tokens, slot, first chunk, end chunk); its state
    is read at s_ptr + slot * stride_slot and written at s_out_ptr + slot * stride_slot (a pool's slot,
    in place; or a lone state, slot 0)."""
    h = tl.program_id(0)
    cv = tl.program_id(1) * BLOCK_DV + tl.arange(0, BLOCK_DV)
    piece = tl.program_id(2)
    ck, rc = tl.arange(0, BLOCK_DK), tl.arange(0, CHUNK)
    mk, mv = ck < DK, cv < DV
    at = tl.load(pieces_ptr + piece * 5 + 2).to(tl.int64) * stride_slot + h * DK * DV + ck[:, None] * DV + cv[None, :]
    c0, c1 = tl.load(pieces_ptr + piece * 5 + 3), tl.load(pieces_ptr + piece * 5 + 4)
    live = c0 < c1  # an empty piece (a captured step's padding entries) leaves its state untouched
    s = tl.load(s_ptr + at, mask=both(mk[:, None] & mv[None, :], live), other=0.0).to(tl.float32)
    for c in range(c0, c1):
        a = tl.load(cuts_ptr + c)
        n = tl.load(cuts_ptr + c + 1) - a
        t = a + rc
        mt = rc < n
        k_mask = mt[:, None] & mk[None, :]
        v_mask = mt[:, None] & mv[None, :]
        k_at = (t[:, None] * H + h) * DK + ck[None, :]  # [C, DK] tiles of this chunk: k, q, w
        v_at = (t[:, None] * H + h) * DV + cv[None, :]  # [C, BLOCK_DV]
        # each tile loaded just before its product: loaded all at the chunk's top, five [C, DK] tiles and their
        # TF32 halves spilled (~1.4 KB; 1.11 ms a layer at 4,096 tokens x 32 heads on an H100, against 0.77)
        gcum = tl.load(gcum_ptr + t * H + h, mask=mt, other=0.0)
        wc = tl.load(w_ptr + k_at, mask=k_mask, other=0.0)
        v_new = tl.load(u_ptr + v_at, mask=v_mask, other=0.0) - _dot(wc, s, PREC)
        qc = tl.load(q_ptr + k_at, mask=k_mask, other=0.0)
        pc = tl.load(p_ptr + ((c * H + h) * CHUNK + rc[:, None]) * CHUNK + rc[None, :])  # [C, C]
        out = _dot(tl.exp(gcum)[:, None] * qc, s, PREC) + _dot(pc, v_new, PREC)
        kc = tl.load(k_ptr + k_at, mask=k_mask, other=0.0)
        tl.store(o_ptr + v_at, out, mask=v_mask)
        g_last = tl.sum(tl.where(rc == n - 1, gcum, 0.0), axis=0)
        s = s * tl.exp(g_last) + _dot(tl.trans(tl.exp(g_last - gcum)[:, None] * kc), v_new, PREC)
        s = _as_stored(s, STATE_BF16)  # a piece cut here starts from the stored state: carry on from the same bits
    tl.store(s_out_ptr + at, s, mask=both(mk[:, None] & mv[None, :], live))


def gdn_prefill(q, k, v, beta, g, state, pos0: int):
    """The delta rule over T prompt tokens at absolute position pos0, in chunks cut at multiples of
    GDN_CHUNK. q, k [T, Hv, Dk] (l2-normalised, q scaled), v [T, Hv, Dv], beta, g [T, Hv], state
    [Hv, Dk, Dv] (the state's dtype; the rest fp32) -> (o [T, Hv, Dv], final state). Same contract as
    reference.gdn_prefill."""
    t, h, dk = q.shape
    dv = v.shape[-1]
    if not t:
        return torch.empty(0, h, dv, dtype=torch.float32, device=q.device), state.clone()
    cuts = aligned_cuts(t, pos0, GDN_CHUNK)
    piece, bounds = upload_parts([[0, t, 0, 0, len(cuts)], [a for a, _ in cuts] + [t]], torch.int32, q.device)
    s_out = torch.empty(h, dk, dv, dtype=state.dtype, device=q.device)
    return _prefill(q, k, v, beta, g, bounds, piece.view(1, 5), state.contiguous(), s_out, 0), s_out


def gdn_prefill_pieces(q, k, v, beta, g, pool, pieces, out=None):
    """gdn_prefill for several sequences' pieces in the rows of one wave (memra.kernels.pieces
    .RecurrentPieces), the states stepped in place in pool [slots, Hv, Dk, Dv] -> o [N, Hv, Dv] (into `out`, a
    contiguous fp32 [N, Hv, Dv], where given). The same three launches as one piece's, each piece's programs doing
    what its own call's do."""
    return _prefill(q, k, v, beta, g, pieces.cuts, pieces.table, pool, pool, pool.stride(0), out)


def _prefill(q, k, v, beta, g, cuts, pieces, s_in, s_out, stride_slot, out=None) -> torch.Tensor:
    t, h, dk = q.shape
    dv = v.shape[-1]
    q, k, v, beta, g = (x.contiguous().float() for x in (q, k, v, beta, g))
    f32 = dict(dtype=torch.float32, device=q.device)
    u, w = torch.empty(t, h, dv, **f32), torch.empty(t, h, dk, **f32)
    p, gcum = torch.empty(cuts.numel() - 1, h, GDN_CHUNK, GDN_CHUNK, **f32), torch.empty(t, h, **f32)
    o = output_buffer(out, (t, h, dv), torch.float32, q.device)
    chunk_prep(q, k, v, beta, g, cuts, u, w, p, gcum)
    chunk_scan(q, k, u, w, p, gcum, s_in, o, s_out, cuts, pieces, stride_slot)
    return o


def chunk_prep(q, k, v, beta, g, bounds, u, w, p, gcum) -> None:
    """The first two launches: every chunk's T at once (through an fp32 scratch [chunks, H, C, C]), then
    every chunk's U, W, P and G (neither reads the state)."""
    _, h, dk = q.shape
    dv = v.shape[-1]
    grid, bdk = (bounds.numel() - 1, h), triton.next_power_of_2(dk)
    inv = torch.empty_like(p)
    _gdn_chunk_inverse[grid](k, beta, g, bounds, inv, h, DK=dk, BLOCK_DK=bdk, CHUNK=GDN_CHUNK, PREC=GDN_DOT_PRECISION,
                             num_warps=GDN_PREP_WARPS)
    _gdn_chunk_products[grid](q, k, v, beta, g, bounds, inv, u, w, p, gcum, h, DK=dk, DV=dv, BLOCK_DK=bdk,
                              BLOCK_DV=triton.next_power_of_2(dv), CHUNK=GDN_CHUNK, PREC=GDN_DOT_PRECISION,
                              num_warps=GDN_PREP_WARPS)


def _bf16(state: torch.Tensor) -> bool:
    """Is the state stored in bf16 (else fp32)? The state's tensors are the kernels' only say in it."""
    assert state.dtype in (torch.float32, torch.bfloat16), f"a GDN state is fp32 or bf16, not {state.dtype}"
    return state.dtype == torch.bfloat16


def chunk_scan(q, k, u, w, p, gcum, s_in, o, s_out, bounds, pieces, stride_slot) -> None:
    """The third launch: each piece's state through its chunks in order, writing O and the final state."""
    _, h, dk = q.shape
    dv = u.shape[-1]
    _gdn_chunk_scan[(h, triton.cdiv(dv, GDN_SCAN_BLOCK_DV), pieces.shape[0])](
        q, k, u, w, p, gcum, s_in, o, s_out, bounds, pieces, stride_slot, h, DK=dk, DV=dv,
        BLOCK_DK=triton.next_power_of_2(dk), BLOCK_DV=GDN_SCAN_BLOCK_DV, CHUNK=GDN_CHUNK, PREC=GDN_DOT_PRECISION,
        STATE_BF16=_bf16(s_out), num_warps=GDN_SCAN_WARPS, num_stages=GDN_SCAN_STAGES)


# --- the recurrent step (decode, verify) -------------------------------------------------------

# Value columns of the delta-rule state one program steps, in either state dtype. A launch config that decode and
# the verify share; a tile is its own bits (which lanes reduce a column over Dk). 64 against the earlier 32 on one
# H100 (tools/gpu_tune_gdn_step.py, a layer of the 9B at 256 rows): fp32 385 against 420 us, bf16 283 against 359
# (a bf16 row of 32 columns is 64 bytes); 128 is within 2-3% of 64 either way. Qwen3.5-9B's offline throughput:
# 7,902 against 7,661 output tok/s (docs/PERFORMANCE.md).
GDN_BLOCK_DV = 64
GDN_STEP_WARPS = 4  # its warps a program, Triton's default; 8 spreads the [Dk, 64] tile thinner (the tool times both)


@lean
@triton.jit(do_not_specialize=["T", "INDEXED", "SKIP_INERT"])
def _delta_rule_scan_kernel(q_ptr, k_ptr, v_ptr, beta_ptr, g_ptr, s_ptr, s_rows_ptr, o_ptr, s_out_ptr, T, H, DK, DV,
                            INDEXED, SKIP_INERT, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, INERT: tl.constexpr,
                            STATE_BF16: tl.constexpr):
    # One program per (sequence x head, block of value columns): those columns of the state evolve
    # independently of every other column, head and sequence. The program walks its T tokens in order
    # with the state in registers and writes the state after every token (s_out [n, T, H, DK, DV]).
    # Decode calls it with T=1 per row, the verify with T tokens of one sequence: T is a runtime value
    # (not specialised, not even for 1), so both run the same machine code and a token's step has the
    # same bits either way: the state carried to the next token is the one stored (rounded to the state's
    # dtype, GdnConfig.state_dtype, a no-op for fp32), which the next decode call would load.
    # INDEXED (runtime too, for the same reason): sequence n's state is s[s_rows[n]] and its states go
    # to s_out[s_rows[n]], so a decode updates a pool's slots in place. That is safe because a program
    # reads its whole slice of the state before it writes that slice, and no other program touches it.
    # A slot of INERT or past it is a captured step's padding row (memra.kernels.slots): its state is neither
    # read nor written (m2 off), and its output, which nothing reads, comes from a zero state; or, with
    # SKIP_INERT (MEMRA_INERT_SKIP, runtime like T, so both ways run one machine code), the walk takes none of
    # its tokens and the output is zeros. A live row walks all T either way: its bits do not move.
    r = tl.program_id(0)  # sequence * H + head
    n, h = r // H, r % H
    at = n.to(tl.int64)
    if INDEXED != 0:
        at = tl.load(s_rows_ptr + n)
    live = at < INERT
    at = tl.where(live, at, 0)
    cv = tl.program_id(1) * BLOCK_DV + tl.arange(0, BLOCK_DV)
    ck = tl.arange(0, BLOCK_DK)
    mk, mv = ck < DK, cv < DV
    m2 = mk[:, None] & mv[None, :]
    m2 = both(m2, live)
    s = tl.load(s_ptr + (at * H + h) * DK * DV + ck[:, None] * DV + cv[None, :], mask=m2, other=0.0).to(tl.float32)
    walked = tl.where(live | (SKIP_INERT == 0), T, 0)
    for t in range(walked):
        row = (n * T + t) * H + h  # token t of sequence n, head h
        k = tl.load(k_ptr + row * DK + ck, mask=mk, other=0.0)
        q = tl.load(q_ptr + row * DK + ck, mask=mk, other=0.0)
        v = tl.load(v_ptr + row * DV + cv, mask=mv, other=0.0)
        s = s * tl.exp(tl.load(g_ptr + row))
        predicted = tl.sum(s * k[:, None], axis=0)  # S^T k  [BDV]
        delta = (v - predicted) * tl.load(beta_ptr + row)
        s = s + k[:, None] * delta[None, :]
        tl.store(o_ptr + row * DV + cv, tl.sum(s * q[:, None], axis=0), mask=mv)
        s = _as_stored(s, STATE_BF16)  # carried on as stored, so the next token steps as a decode call would
        tl.store(s_out_ptr + ((at * T + t) * H + h) * DK * DV + ck[:, None] * DV + cv[None, :], s, mask=m2)
    for t in range(walked, T):  # an inert row skipped: its output zeros, so nothing downstream reads junk
        tl.store(o_ptr + ((n * T + t) * H + h) * DV + cv, tl.zeros((BLOCK_DV,), dtype=tl.float32), mask=mv)


def _scan(q, k, v, beta, g, s_in, s_out, s_rows, skip_inert=False, out=None):
    """Launch the scan: q, k [n, T, H, DK], v [n, T, H, DV], beta, g [n, T, H] -> o [n, T, H, DV]
    (fp32); the states read from s_in and written to s_out, at s_rows [n] where given. skip_inert: an inert
    row's programs walk none of its tokens (MEMRA_INERT_SKIP). out: where o goes (common.output_buffer)."""
    n, t, h, dk = q.shape
    dv = v.shape[-1]
    args = [x.contiguous().float() for x in (q, k, v, beta, g)]
    o = output_buffer(out, (n, t, h, dv), torch.float32, q.device)
    rows = s_rows if s_rows is not None else torch.empty(1, dtype=torch.int64, device=q.device)  # not read
    if n * t * h:
        bf16 = _bf16(s_out)
        _delta_rule_scan_kernel[(n * h, triton.cdiv(dv, GDN_BLOCK_DV))](
            *args, s_in, rows, o, s_out, t, h, dk, dv, int(s_rows is not None), int(skip_inert),
            BLOCK_DK=triton.next_power_of_2(dk), BLOCK_DV=GDN_BLOCK_DV, INERT=INERT_SLOT, STATE_BF16=bf16,
            num_warps=GDN_STEP_WARPS)
    return o


def delta_rule_scan(q, k, v, beta, g, s):
    """n sequences x T tokens of the delta rule, in order. q, k [n, T, H, DK], v [n, T, H, DV],
    beta, g [n, T, H], s [n, H, DK, DV] (the state's dtype) -> (o [n, T, H, DV] fp32, state after each
    token [n, T, H, DK, DV] in s's dtype). Same contract as reference.delta_rule_scan."""
    n, t, h, dk = q.shape
    dv = v.shape[-1]
    s_out = torch.empty(n, t, h, dk, dv, dtype=s.dtype, device=q.device)
    return _scan(q, k, v, beta, g, s.reshape(n * h, dk, dv).contiguous(), s_out, None), s_out


def delta_rule_step(q, k, v, beta, g, s):
    """Same contract as reference.delta_rule_step (fp32, the state in its own dtype): one token for each row of the
    leading dims — the scan kernel with T = 1, so decode and the verify share its code."""
    dk, dv = q.shape[-1], v.shape[-1]
    lead = q.shape[:-1]
    rows = q.numel() // dk
    o, s_out = delta_rule_scan(q.reshape(rows, 1, 1, dk), k.reshape(rows, 1, 1, dk), v.reshape(rows, 1, 1, dv),
                               beta.reshape(rows, 1, 1), g.reshape(rows, 1, 1), s.reshape(rows, 1, dk, dv))
    return o.reshape(*lead, dv), s_out.reshape(*lead, dk, dv)


def delta_rule_step_into(q, k, v, beta, g, pool, slots, skip_inert=False, out=None):
    """Same contract as reference.delta_rule_step_into: q, k [B, H, DK], v [B, H, DV], beta, g [B, H];
    pool [n_slots, H, DK, DV] fp32 or bf16 (contiguous), slots [B] int64 -> o [B, H, DV]; pool[slots[b]] is
    stepped in place (the scan kernel, T = 1: the copies in and out of a gathered batch never exist). A slot
    of INERT_SLOT or more is a padding row's, whose state the kernel leaves alone (memra.kernels.slots); with
    skip_inert (MEMRA_INERT_SKIP) its programs also skip the step, and its output is zeros. out: a contiguous
    fp32 [B, H, DV] that o is written into (a mixed step's decode rows of its whole GDN output)."""
    b, h, dk = q.shape
    dv = v.shape[-1]
    assert pool.is_contiguous() and tuple(pool.shape[1:]) == (h, dk, dv), "the kernel addresses pool rows as [H, DK, DV]"
    o = _scan(q.reshape(b, 1, h, dk), k.reshape(b, 1, h, dk), v.reshape(b, 1, h, dv), beta.reshape(b, 1, h),
              g.reshape(b, 1, h), pool, pool, slots.contiguous(), skip_inert, out)
    return o.reshape(b, h, dv)
