"""CUDA graphs for the engine's mixed step: a decode step's rows and a prefill wave's pieces in one
captured forward per (batch bucket, token bucket), replayed.

Why: the mixed forward (memra.step.mixed_step) reads the weights once for both kinds of rows, but
launched one kernel at a time its host time exceeds its kernels' time on a GPU (8B shape, H200: about
14 ms host offline, 21 ms served, against 11 ms of kernels), and a server meets one such step per few
decode steps. A graph replays the ~500 launches with one.

What changes from step to step lives in one static int64 buffer that the captured forward reads:

    ids     [Bp + Tp]           the decode rows' tokens (copied on the device from the sampler's
                                choices), then the prompt tokens
    rows    [Bp, 2 + NB]        each decode row's position, recurrent slot and block table (as the
                                decode graph's: memra.graphs.table_step)
    pos     [Tp]                each prompt token's position
    write   [Tp]                the flat KV row each prompt token's K/V goes to
    out     [Bp + PIECES]       the rows whose logits come back: the decode rows, each piece's last token
    tables  [PIECES, NB]        each piece's block table (its attention's key rows derive from it)
    small   [9 PIECES + C + 1]  int32 in the kernels: the attention table [PIECES, 4], the recurrent
                                table [PIECES, 5], the GDN chunk cuts [C + 1] (memra.kernels.pieces)

Padding keeps every shape fixed and every padded row inert:
- decode rows past B sit at position 0 of the pools' scratch block and slot (as memra.graphs pads);
- prompt rows past T form one padding piece at position 0 of the scratch block and slot;
- piece entries past it are empty (no tokens, tiles or chunks; the GDN scan leaves an empty piece's
  state alone) and name the scratch slot;
- attention tiles and GDN chunks are launched for a bound on their count (Tp / 64 + PIECES, Tp / 64 +
  2 PIECES); the programs past the real ones have no rows and skip their work (an empty chunk's
  products cost as much as a full one's: on the Qwen3.5-9B shape, memra.LLM on a served workload
  took 12.3 ms a step running them, 9.7 skipping them).
Every other op is a batch-invariant kernel or elementwise, so no live row can take bits from the
padding: the replay gives the eager mixed step's bits, which are the two calls' (promise E7; tests/
test_mixed_graphs.py holds them equal on the GPU).

Where it applies (graphed_mixed returns None elsewhere, and the engine makes the two calls): a GPU with
graphs on (MEMRA_CUDA_GRAPHS) running the invariant kernels; every cache in the same two pools, with
room for a scratch; fewer than PIECES pieces (a 1-token piece is one like any other: every prompt token
attends through the prefill kernel); at most the largest token bucket's prompt tokens (512, or
MEMRA_MIXED_TOKENS's 1024 or 2048). The pieces read a table of the step's width (memra.graphs.step_blocks),
or wider where the padding piece reaches past it. Longer waves are prefill-bound, where the launches' host
time hides behind the kernels anyway.
"""

from __future__ import annotations

import numpy as np
import torch

from memra.cache import BLOCK_SIZE, Cache, KvPool, RecurrentPool
from memra.graphs import (
    bucket_for,
    capture_pool,
    graph_key,
    graphable,
    held,
    host_rows,
    run_static,
    scratch_of,
    static_for,
    step_blocks,
    table_blocks,
    table_step,
    widened,
)
from memra.kernels.pieces import ATTENTION_TILE, AttentionPieces, RecurrentPieces, recurrent_rows
from memra.kernels.reference import GDN_CHUNK
from memra.model.context import Segments
from memra.upload import upload

MIXED_TOKENS = (64, 128, 256, 512)  # prompt-token buckets of a captured mixed step
LARGER_TOKENS = (1024, 2048)  # buckets MEMRA_MIXED_TOKENS adds, up to its value (Settings.mixed_tokens)
PIECES = 16  # piece entries of every captured mixed step: the live pieces, the padding piece, empty ones


def token_buckets(largest: int = MIXED_TOKENS[-1]) -> tuple[int, ...]:
    """The prompt-token buckets of a model whose largest is `largest` (its Settings.mixed_tokens)."""
    return tuple(t for t in MIXED_TOKENS + LARGER_TOKENS if t <= largest)


def token_bucket(tokens: int, largest: int = MIXED_TOKENS[-1]) -> int | None:
    return next((t for t in token_buckets(largest) if t >= tokens), None)


class StaticMixed:
    """One (batch bucket, token bucket, table widths)'s static mixed step: its buffer, its captured graph, its
    logits. nb: the prompt pieces' table width; decode_nb: the decode rows' (default nb; MEMRA_MIXED_DECODE_WIDTH
    gives them their own, so that a piece past one attention split does not take every decode row through
    the split attention: the same bits, as _combine_splits_kernel explains)."""

    def __init__(self, model, kv: KvPool, rec: RecurrentPool | None, bucket: int, tokens: int, nb: int,
                 decode_nb: int | None = None):
        self.model, self.kv, self.rec, self.bucket, self.tokens, self.nb = model, kv, rec, bucket, tokens, nb
        self.decode_nb = nb if decode_nb is None else decode_nb
        self.chunks = tokens // GDN_CHUNK + 2 * PIECES  # a piece of t tokens has at most t / 64 + 2 chunks
        b, p = bucket, PIECES
        sizes = dict(ids=b + tokens, rows=b * (2 + self.decode_nb), pos=tokens, write=tokens, out=b + p, tables=p * nb,
                     small=9 * p + self.chunks + 1)
        self.at, n = {}, 0
        for name, size in sizes.items():
            self.at[name] = (n, n + size)
            n += size
        dev = model.device
        self.buf = torch.zeros(n, dtype=torch.long, device=dev)
        if b not in model.mixed_logits:  # shared by the bucket's token buckets: read out after each replay
            model.mixed_logits[b] = torch.zeros(b + p, model.cfg.vocab_size, dtype=model.dtype, device=dev)
        self.logits = model.mixed_logits[b]
        self.offsets = torch.arange(BLOCK_SIZE, device=dev)  # [BLOCK]
        self.starts = torch.arange(b, device=dev) * (self.decode_nb * BLOCK_SIZE)  # decode row r's prefix in its flat rows
        self.spans: tuple[tuple, tuple] = ((), ())  # the last fill's pieces, for the reference kernels (CPU)
        self.graph: torch.cuda.CUDAGraph | None = None

    def _view(self, buf, name: str) -> torch.Tensor:
        a, b = self.at[name]
        return buf[a:b]

    def body(self) -> torch.Tensor:
        """The mixed step of every row, from `buf` alone -> logits [Bp + PIECES, V] in the head's dtype (into
        self.logits)."""
        m, p, width = self.model, PIECES, self.nb * BLOCK_SIZE
        view = lambda name: self._view(self.buf, name)  # noqa: E731
        step = table_step(m, self.kv, self.rec, view("rows").view(self.bucket, -1), self.offsets, self.starts)
        cos, sin = m.ops.rope_cos_sin(view("pos"), m.inv_freq, m.dtype)  # [Tp, R]
        small = view("small").to(torch.int32)
        key_rows = (view("tables").view(p, self.nb, 1) * BLOCK_SIZE + self.offsets).reshape(p * width)
        attn = AttentionPieces(self.spans[0], key_rows, small[: 4 * p].view(p, 4), self.tokens // ATTENTION_TILE + p)
        recurrent = None if self.rec is None else RecurrentPieces(self.spans[1], small[4 * p : 9 * p].view(p, 5),
                                                                  small[9 * p :])
        wave = Segments([], [], self.tokens, cos, sin, self.kv, view("write"), attn, recurrent, self.rec)
        h = m.embed_tokens(view("ids"))
        for block in m.blocks:
            h = block.forward_mixed(h, step, wave)
        return held(self.logits, m.head_logits(m.norm_out(h.index_select(0, view("out")))))

    def fill(self, ids: torch.Tensor, dec_caches: list[Cache], pieces: list[torch.Tensor], pre_caches: list[Cache],
             scratch: tuple[int, int | None]) -> None:
        """Write the step's inputs into `buf`: one upload built in numpy, then the decode rows' ids (on the
        device) and the prompt ids copied in."""
        bp, tp, p, nb, width = self.bucket, self.tokens, PIECES, self.nb, self.nb * BLOCK_SIZE
        block, slot = scratch
        slot = 0 if slot is None else slot
        host = np.zeros(self.buf.numel(), dtype=np.int64)
        view = lambda name: self._view(host, name)  # noqa: E731
        b = len(dec_caches)
        view("rows")[:] = host_rows(dec_caches, bp, self.decode_nb, scratch,  # then the inert decode rows
                                    self.model.settings.inert_padding).reshape(-1)
        pos, write, out, tables = view("pos"), view("write"), view("out"), view("tables").reshape(p, nb)
        attn, rec = view("small")[: 4 * p].reshape(p, 4), view("small")[4 * p : 9 * p].reshape(p, 5)
        out[:bp] = np.arange(bp)
        sizes = [x.numel() for x in pieces]
        t = sum(sizes)
        # the live pieces, then the padding piece of the rest of the rows on the scratch block and slot
        entries = [(c.pos, n, np.asarray(c.blocks, dtype=np.int64), c.slot or 0) for n, c in zip(sizes, pre_caches)]
        entries.append((0, tp - t, np.full(nb, block, dtype=np.int64), slot))
        pos0s, ns, _, slots = (list(column) for column in zip(*entries))
        firsts = np.cumsum([0] + ns[:-1]).tolist()
        rows, cuts = recurrent_rows(firsts, ns, pos0s, slots)
        rec[: len(entries)] = rows
        spans = ([], [])
        for i, ((pos0, n, blocks, piece_slot), first) in enumerate(zip(entries, firsts)):
            where = np.arange(pos0, pos0 + n)
            pos[first : first + n] = where
            write[first : first + n] = blocks[where // BLOCK_SIZE] * BLOCK_SIZE + where % BLOCK_SIZE
            tables[i, : min(len(blocks), nb)] = blocks[:nb]  # the blocks of the positions it reads
            attn[i] = (first, n, pos0, i * width)
            if n:
                spans[0].append((first, n, pos0, i * width))
                spans[1].append((first, n, pos0, piece_slot))
        out[bp : bp + len(pieces)] = bp + np.cumsum(sizes) - 1
        for i in range(len(entries), p):  # empty pieces
            attn[i] = (tp, 0, 0, i * width)
            rec[i] = (tp, 0, slot, len(cuts), len(cuts))
        view("small")[9 * p + len(cuts) :] = tp  # every cut past the last piece's: zero-length chunks
        view("small")[9 * p : 9 * p + len(cuts)] = cuts
        self.spans = (tuple(spans[0]), tuple(spans[1]))
        self.buf.copy_(upload(torch.from_numpy(host), self.buf.device))  # queued, no wait
        self.buf[:b].copy_(ids)
        if t:
            self.buf[bp : bp + t].copy_(torch.cat(pieces) if len(pieces) > 1 else pieces[0])

    def run(self, ids, dec_caches, pieces, pre_caches, scratch, pool=None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The step for these rows and pieces -> (decode logits [B, V], each piece's last-position logits
        [V]), replayed (or first captured: memra.graphs.run_static). Positions are not advanced."""
        self.fill(ids, dec_caches, pieces, pre_caches, scratch)
        run_static(self, pool)
        b, bp = len(dec_caches), self.bucket
        got = widened(self.logits[:b], self.logits[bp : bp + len(pieces)])  # the buffer is the next run's
        return got[:b], list(got[b:])


def captures_mixed(model) -> bool:
    """Does this model's executor replay its mixed steps from graphs (where a step fits one)?"""
    return (model.executor.mixes_steps and model.device.type == "cuda" and model.settings.cuda_graphs
            and model.ops.invariant)


def graphed_mixed(model, ids: torch.Tensor, dec_caches: list[Cache], pieces: list[torch.Tensor],
                  pre_caches: list[Cache]) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
    """The mixed step (decode rows ids [B] on the device into dec_caches, one prompt piece into each of
    pre_caches) replayed from a graph -> (logits [B, V] fp32, each piece's last logits [V]); positions
    not advanced. None where no graph applies (the module docstring's conditions)."""
    caches = [*dec_caches, *pre_caches]
    if not (captures_mixed(model) and graphable(model, caches)) or len(pieces) >= PIECES:
        return None
    tokens = token_bucket(sum(x.numel() for x in pieces), model.settings.mixed_tokens)
    decode_ends = [c.pos + 1 for c in dec_caches]
    nb = step_blocks(caches, decode_ends + [c.pos + x.numel() for x, c in zip(pieces, pre_caches)])
    if tokens is not None and tokens > nb * BLOCK_SIZE:  # the padding piece (from position 0) reaches past a
        nb = table_blocks(tokens)  # narrow table: the pieces read a wider one, which keeps every row's bits
    decode_nb = step_blocks(dec_caches, decode_ends) if model.settings.mixed_decode_width and dec_caches else nb
    bucket = bucket_for(len(dec_caches))
    if tokens is None or bucket is None:
        return None  # a wave past every bucket, or more decode rows than the largest bucket
    kv, rec = caches[0].kv, caches[0].rec
    scratch = scratch_of(kv, rec, model.graph_scratch)
    if scratch is None:
        return None
    static = static_for(model.mixed_graphs, graph_key(bucket, nb, kv, rec, tokens, decode_nb),
                        lambda: StaticMixed(model, kv, rec, bucket, tokens, nb, decode_nb))
    if model.device.type == "cuda" and static.graph is None:  # to be captured: into the pool the others share
        model.mixed_graph_pool = capture_pool(model.mixed_graphs, model.mixed_graph_pool)
    return static.run(ids, dec_caches, pieces, pre_caches, scratch, model.mixed_graph_pool)
