"""The per-step facts every layer needs, passed explicitly (no module globals)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from memra.cache import Cache, KvPool, RecurrentPool
from memra.kernels.pieces import AttentionPieces, RecurrentPieces
from memra.state_trail import StateTrail
from memra.upload import upload_values


@dataclass(frozen=True)
class StepContext:
    cache: Cache
    pos0: int  # position of the first token of this step
    n_tokens: int  # T
    cos: torch.Tensor  # [T, R] rotary tables for positions pos0..pos0+T-1, model dtype
    sin: torch.Tensor
    recurrent: bool  # GDN mode: True = token-by-token recurrence (generated tokens), False = chunked (prompt)
    kv_write_rows: torch.Tensor  # [T] flat KV-pool rows (block * BLOCK_SIZE + offset) the new tokens go to
    kv_read_rows: torch.Tensor  # [pos0 + T] flat rows of the whole prefix, in position order
    trail: StateTrail | None = None  # verify: record each token's recurrent state here (rollback)
    column: int = 0  # verify: which of the T columns this (T=1) context's token is


def joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat(parts), without its copy kernel when there is one part (a wave of one sequence)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


@dataclass(frozen=True)
class Segments:
    """Prompt pieces of several sequences in one forward (cross-request prefill): piece i in rows
    bounds[i] = [lo, hi) with context ctxs[i], and what every layer shares joined once per wave, not
    once per layer (the rotary tables; where the pieces share a KV pool, the K/V write rows and the
    table that lets one attention launch serve every piece; where they share a
    recurrent pool, the table that lets GDN's launches serve every piece)."""

    ctxs: list[StepContext]  # (empty in a captured step, whose pieces are only its tables: memra.mixed_graphs)
    bounds: list[tuple[int, int]]
    n_rows: int  # N
    cos: torch.Tensor  # [N, R]
    sin: torch.Tensor
    kv: KvPool  # the first piece's KV pool (every piece's, with kv_write_rows)
    kv_write_rows: torch.Tensor | None  # [N], or None: pools of their own (offline caches), piece by piece
    attn: AttentionPieces | None = None  # every piece (one pool), for one prefill-attention launch
    recurrent: RecurrentPieces | None = None  # GDN states in one pool: every piece in one launch per kernel
    rec: RecurrentPool | None = None  # with recurrent: that pool

    @classmethod
    def of(cls, ctxs: list[StepContext], bounds: list[tuple[int, int]]) -> "Segments":
        cos, sin = joined([c.cos for c in ctxs]), joined([c.sin for c in ctxs])
        rec = ctxs[0].cache.rec
        recurrent = None
        if rec is not None and all(c.cache.rec is rec and not c.recurrent and c.trail is None for c in ctxs):
            recurrent = RecurrentPieces.of([a for a, _ in bounds], [b - a for a, b in bounds], [c.pos0 for c in ctxs],
                                           [c.cache.slot for c in ctxs], ctxs[0].kv_read_rows.device)
        n, kv, rec = bounds[-1][1], ctxs[0].cache.kv, rec if recurrent is not None else None
        if any(c.cache.kv is not kv for c in ctxs):
            return cls(ctxs, bounds, n, cos, sin, kv, None, recurrent=recurrent, rec=rec)
        attn = AttentionPieces.of([a for a, _ in bounds], [c.pos0 for c in ctxs], [c.kv_read_rows for c in ctxs])
        return cls(ctxs, bounds, n, cos, sin, kv, joined([c.kv_write_rows for c in ctxs]), attn, recurrent, rec)


@dataclass(frozen=True)
class RowGroup:
    """The rows of a stacked step whose KV lives in one pool (one attention launch per group)."""

    kv: KvPool
    sel: torch.Tensor | slice  # which of the step's rows
    write_rows: torch.Tensor  # [n] flat pool rows the rows' new K/V go to
    read_rows: torch.Tensor  # the rows' prefixes, concatenated (one table when they share a sequence)
    starts: torch.Tensor  # [n] where each row's prefix begins in read_rows
    lens: torch.Tensor  # [n] its length (positions 0..its own)
    max_len: int  # a bound on every length, known on the host (how many splits a long prefix gets)


@dataclass(frozen=True)
class StackedStep:
    """One new token for each of B rows — B sequences of a batched decode, or the T consecutive
    positions of one sequence in a verify — with what every layer shares computed once per step
    (rotary tables, the attention's write rows, prefixes and lengths), not once per layer."""

    ctxs: list[StepContext]
    cos: torch.Tensor  # [B, R]
    sin: torch.Tensor
    groups: tuple[RowGroup, ...]
    # A step whose rows all keep their GDN state in one pool may name the rows' slots instead of
    # their caches (a CUDA graph's static step, memra.graphs): states are then gathered and scattered
    # by index on the device, with no per-row Python.
    rec: RecurrentPool | None = None
    slots: torch.Tensor | None = None  # [B] each row's slot in rec

    @classmethod
    def of(cls, ctxs: list[StepContext]) -> "StackedStep":
        device = ctxs[0].cos.device
        pools: dict[int, list[int]] = {}
        for i, c in enumerate(ctxs):
            pools.setdefault(id(c.cache.kv), []).append(i)  # private pools (offline) or one shared (server)
        groups = []
        for idx in pools.values():
            lens = [ctxs[i].kv_read_rows.numel() for i in idx]
            if all(ctxs[i].cache is ctxs[idx[0]].cache for i in idx):  # one sequence: prefixes of one table
                read, starts = max((ctxs[i].kv_read_rows for i in idx), key=len), [0] * len(idx)
            else:
                read = torch.cat([ctxs[i].kv_read_rows for i in idx])
                starts = [sum(lens[:j]) for j in range(len(idx))]
            as_dev = lambda xs: upload_values(xs, torch.long, device)  # noqa: E731
            groups.append(RowGroup(ctxs[idx[0]].cache.kv, as_dev(idx) if len(idx) < len(ctxs) else slice(None),
                                   torch.cat([ctxs[i].kv_write_rows for i in idx]), read, as_dev(starts), as_dev(lens),
                                   max(lens)))
        return cls(ctxs, torch.cat([c.cos for c in ctxs]), torch.cat([c.sin for c in ctxs]), tuple(groups))
