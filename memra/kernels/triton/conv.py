"""GDN's depthwise causal conv + SiLU (Triton): over a prompt's tokens (or the pieces of several
sequences in one wave, their states stepped in the pool), and one step for a batch of decode rows with
their states stepped where they live in the pool. Twins: reference.causal_conv,
reference.causal_conv_pieces, reference.causal_conv_step.

In torch the step is a dozen launches per GDN layer (the window's cat, two casts, Kc multiplies and
Kc - 1 adds, the rounding, the SiLU) plus the gather and scatter of the rows' states; here it is one.

Bits: an output is acc = x0*w0 + x1*w1 + ... in fp32, left to right, each product and each sum rounded
as torch's separate elementwise ops round them (the kernels are built with fp fusion off: a contracted
multiply-add would round once), then rounded to the dtype, then SiLU (Triton's exp, so its last bit
can differ from torch's) rounded to the dtype. Every kernel computes it with the same code
(`_conv_out`; the prompt kernels also share `_conv_acc`), so a token convolved in a prompt, in a wave
of several prompts, in a verify's run of tokens, or as a decode step has the same bits, whatever else
shares the call; that is what the exact path needs of them.
A graph's padding rows name the pools' scratch slot: their read-modify-writes of it race, which touches no
live row's state or output; or, under MEMRA_INERT_PADDING, an inert slot whose state the step leaves alone
(memra.kernels.slots).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from memra.kernels.slots import INERT_SLOT
from memra.kernels.triton.common import both, round_to_dtype
from memra.kernels.triton.launch import lean

CONV_BLOCK = 256  # channels per program


@triton.jit
def _conv_out(acc, ty: tl.constexpr):
    """The conv sum rounded to the dtype, then SiLU rounded to the dtype (torch: silu(acc.to(dtype)))."""
    x = round_to_dtype(acc, ty)
    return round_to_dtype(tl.math.div_rn(x, 1.0 + tl.exp(-x)), ty).to(ty)


@lean
@triton.jit
def _conv_step_kernel(u_ptr, pool_ptr, slots_ptr, w_ptr, out_ptr, C, stride_u, stride_slot, stride_out,
                      KC: tl.constexpr, BLOCK: tl.constexpr, INERT: tl.constexpr):
    # Program (row, channel block): the window is the slot's Kc-1 saved inputs, then the row's new one. A slot
    # of INERT or past it is a captured step's padding row (memra.kernels.slots): its saved inputs are neither
    # read (zeros stand in) nor written; its output is never read.
    row = tl.program_id(0)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = c < C
    slot = tl.load(slots_ptr + row).to(tl.int64)
    live = slot < INERT
    state = pool_ptr + tl.where(live, slot, 0) * stride_slot + c * (KC - 1)
    saved = both(mask, live)
    u = tl.load(u_ptr + row * stride_u + c, mask=mask, other=0.0)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(KC):
        if j < KC - 1:
            x = tl.load(state + j, mask=saved, other=0.0).to(tl.float32)
        else:
            x = u.to(tl.float32)
        wj = tl.load(w_ptr + c * KC + j, mask=mask, other=0.0).to(tl.float32)
        if j == 0:
            acc = x * wj
        else:
            acc = acc + x * wj
    for j in tl.static_range(KC - 1):  # the window moves on by one: every load above is done
        if j < KC - 2:
            tl.store(state + j, tl.load(state + j + 1, mask=saved, other=0.0), mask=saved)
        else:
            tl.store(state + j, u.to(pool_ptr.dtype.element_ty), mask=saved)
    tl.store(out_ptr + row * stride_out + c, _conv_out(acc, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _conv_acc(u_ptr, state_ptr, w_ptr, t, c, mask, stride_u, KC: tl.constexpr, BLOCK: tl.constexpr):
    # Token t of a piece whose rows start at u_ptr: window position t + j is saved input t + j (while
    # < Kc-1, from state_ptr [C, Kc-1]), else the piece's token t + j - (Kc-1).
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(KC):
        i = t + j
        from_state = i < KC - 1
        s = tl.load(state_ptr + c * (KC - 1) + i, mask=both(mask, from_state), other=0.0).to(tl.float32)
        x = tl.load(u_ptr + (i - (KC - 1)) * stride_u + c, mask=both(mask, i >= KC - 1), other=0.0).to(tl.float32)
        x = tl.where(from_state, s, x)
        wj = tl.load(w_ptr + c * KC + j, mask=mask, other=0.0).to(tl.float32)
        if j == 0:
            acc = x * wj
        else:
            acc = acc + x * wj
    return acc


@lean
@triton.jit
def _conv_kernel(u_ptr, state_ptr, w_ptr, out_ptr, C, stride_u, stride_out, KC: tl.constexpr, BLOCK: tl.constexpr):
    # Program (token t, channel block) of one piece.
    t = tl.program_id(0)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = c < C
    acc = _conv_acc(u_ptr, state_ptr, w_ptr, t, c, mask, stride_u, KC, BLOCK)
    tl.store(out_ptr + t * stride_out + c, _conv_out(acc, out_ptr.dtype.element_ty), mask=mask)


@lean
@triton.jit(do_not_specialize=["n_pieces"])
def _conv_pieces_kernel(u_ptr, pool_ptr, w_ptr, out_ptr, pieces_ptr, n_pieces, C, stride_u, stride_out, stride_slot,
                        KC: tl.constexpr, BLOCK: tl.constexpr, BLOCK_P: tl.constexpr):
    # Program (row of the wave, channel block): the row's piece found in the table (rows: first row,
    # tokens, slot, ...), then _conv_kernel's arithmetic for that piece's token, its saved inputs read
    # from the piece's pool slot. The table is read as vectors, all its pieces at once (BLOCK_P >= n_pieces),
    # not walked a piece at a time: a walk is a chain of scalar loads, each waited on before its compare, in
    # every one of the wave's programs (16k a layer at 512 rows on the 9B: 32 channel blocks a row). The
    # pieces are disjoint, so a row hits one piece or none (first and slot 0, as the walk left them).
    n = tl.program_id(0)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = c < C
    i = tl.arange(0, BLOCK_P)
    real = i < n_pieces
    lo = tl.load(pieces_ptr + i * 5, mask=real, other=0)
    hit = real & (n >= lo) & (n < lo + tl.load(pieces_ptr + i * 5 + 1, mask=real, other=0))
    first = tl.sum(tl.where(hit, lo, 0), axis=0)
    slot = tl.sum(tl.load(pieces_ptr + i * 5 + 2, mask=hit, other=0), axis=0)
    acc = _conv_acc(u_ptr + first.to(tl.int64) * stride_u, pool_ptr + slot.to(tl.int64) * stride_slot, w_ptr, n - first,
                    c, mask, stride_u, KC, BLOCK)
    tl.store(out_ptr + n * stride_out + c, _conv_out(acc, out_ptr.dtype.element_ty), mask=mask)


@lean
@triton.jit
def _conv_state_pieces_kernel(u_ptr, pool_ptr, pieces_ptr, C, stride_u, stride_slot, KC: tl.constexpr,
                              BLOCK: tl.constexpr):
    # Program (piece, channel block): the slot's saved inputs become the last Kc-1 of (saved, tokens),
    # in place. Input j comes from window position t + j > j, never from one this loop already wrote.
    p = tl.program_id(0)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = c < C
    first = tl.load(pieces_ptr + p * 5)
    t = tl.load(pieces_ptr + p * 5 + 1)
    state = pool_ptr + tl.load(pieces_ptr + p * 5 + 2).to(tl.int64) * stride_slot + c * (KC - 1)
    for j in tl.static_range(KC - 1):
        i = t + j
        from_state = i < KC - 1
        s = tl.load(state + i, mask=both(mask, from_state), other=0.0)
        x = tl.load(u_ptr + (first + i - (KC - 1)).to(tl.int64) * stride_u + c, mask=both(mask, i >= KC - 1), other=0.0)
        tl.store(state + j, tl.where(from_state, s, x.to(pool_ptr.dtype.element_ty)), mask=mask)


def causal_conv(u: torch.Tensor, state: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """reference.causal_conv: u [T, C], state [C, Kc-1], w [C, Kc] -> (out [T, C], new state [C, Kc-1])."""
    t, c = u.shape
    kc = w.shape[1]
    u = u if u.stride(-1) == 1 else u.contiguous()
    state, w = state.to(u.dtype).contiguous(), w.contiguous()
    out = torch.empty(t, c, dtype=u.dtype, device=u.device)
    if t:
        _conv_kernel[(t, triton.cdiv(c, CONV_BLOCK))](u, state, w, out, c, u.stride(0), out.stride(0), KC=kc,
                                                      BLOCK=CONV_BLOCK, enable_fp_fusion=False)
    return out, last_inputs(state, u, kc)


def last_inputs(state: torch.Tensor, u: torch.Tensor, kc: int) -> torch.Tensor:
    """The state after u: the last Kc-1 of the raw inputs (state's, then u's) -> [C, Kc-1] in u's dtype.
    Only the inputs it keeps are copied: joining the whole window (a transposed [C, Kc-1+T] copy) cost a
    35B-A3B GDN layer 0.3 ms of a 4096-token prefill on an H100."""
    t = u.shape[0]
    if t >= kc - 1:
        return u[t - (kc - 1):].t().contiguous()
    return torch.cat((state[:, t:], u.t()), dim=1)


def causal_conv_pieces(u: torch.Tensor, pool: torch.Tensor, w: torch.Tensor, pieces) -> torch.Tensor:
    """causal_conv for several sequences' pieces in the rows of one wave (memra.kernels.pieces
    .RecurrentPieces): u [N, C] -> out [N, C]; each piece's saved inputs, pool[slot] of pool [slots, C,
    Kc-1] (u's dtype), stepped in place. Two launches: the conv, then the states (after every token
    has read them)."""
    n, c = u.shape
    kc = w.shape[1]
    u = u if u.stride(-1) == 1 else u.contiguous()
    w = w.contiguous()
    out = torch.empty(n, c, dtype=u.dtype, device=u.device)
    blocks = triton.cdiv(c, CONV_BLOCK)
    if n:
        n_pieces = pieces.table.shape[0]
        _conv_pieces_kernel[(n, blocks)](u, pool, w, out, pieces.table, n_pieces, c, u.stride(0), out.stride(0),
                                         pool.stride(0), KC=kc, BLOCK=CONV_BLOCK,
                                         BLOCK_P=max(16, triton.next_power_of_2(n_pieces)), enable_fp_fusion=False)
        _conv_state_pieces_kernel[(n_pieces, blocks)](u, pool, pieces.table, c, u.stride(0), pool.stride(0),
                                                      KC=kc, BLOCK=CONV_BLOCK)
    return out


def causal_conv_step_into(u: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """One new token for each of B rows, whose states are pool[slots[b]] ([slots, C, Kc-1], stepped in
    place): u [B, C] -> out [B, C]. reference.causal_conv_step's values. A slot of INERT_SLOT or more is a
    padding row's, whose state the kernel leaves alone (memra.kernels.slots)."""
    b, c = u.shape
    u = u if u.stride(-1) == 1 else u.contiguous()
    assert pool.is_contiguous() and pool.dtype == u.dtype, "the pool's layout: [slots, C, Kc-1] of the model dtype"
    out = torch.empty(b, c, dtype=u.dtype, device=u.device)
    if b:
        slots = slots.contiguous()  # a no-op for a graph's step (memra.graphs.table_step makes the column contiguous)
        _conv_step_kernel[(b, triton.cdiv(c, CONV_BLOCK))](u, pool, slots, w.contiguous(), out, c, u.stride(0),
                                                           pool.stride(0), out.stride(0), KC=w.shape[1],
                                                           BLOCK=CONV_BLOCK, INERT=INERT_SLOT, enable_fp_fusion=False)
    return out


def causal_conv_step(u: torch.Tensor, states: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """reference.causal_conv_step: u [B, C], states [B, C, Kc-1] -> (out [B, C], new states)."""
    new = states.to(u.dtype, memory_format=torch.contiguous_format, copy=True)
    return causal_conv_step_into(u, new, torch.arange(u.shape[0], device=u.device), w), new
