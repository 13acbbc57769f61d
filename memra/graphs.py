"""CUDA graphs for the stacked decode step: one captured step per batch bucket, replayed.

A B=1 decode step of an 8B model is ~1600 kernel launches. Issued one by one from Python they took
20.7 ms on the H200 while the kernels themselves needed 8.4 ms (tools/gpu_profile_decode.py). A graph
records the whole step once and replays it with a single launch.

A graph replays fixed addresses and fixed shapes, so everything that changes from step to step lives
in one static int64 buffer that the captured step reads:

    args [Bp, 3 + NB]   column 0: token id   1: position   2: recurrent slot   3..: block table

and everything else is derived on the device inside the graph: rotary tables from the positions, the
flat KV rows of every row's prefix from its block table ([Bp, NB * BLOCK_SIZE], read up to position +
1 by the attention kernel, which takes the lengths from memory), the row each new K/V is written to.
NB, the table width, is a power of two covering the positions the step reads: one attention split's
worth (ATTN_SPLIT positions) while every row fits in it, else the rows' max_ctx (step_blocks). A
narrower table is not only fewer bytes: the attention launches a split per ATTN_SPLIT positions of
the width and a combine after them, whatever the rows' lengths (offline, 64 Llama-shaped rows took
6.04 ms a step with 1,024-position tables, 5.89 with 130-position ones). Which width a row meets
cannot change its bits: a row within the first split gets the unsplit kernel's bits in a split launch
(memra.kernels.triton.attention._combine_splits_kernel). The pools' tensors are captured by address: a
KV pool or recurrent pool that is enlarged bumps its version, and graphs of the old version are
dropped and captured again.

Buckets: a batch of B rows replays the graph of the smallest bucket >= B (BUCKETS). The Bp - B padding
rows are inert: they point at a scratch KV block and a scratch recurrent slot taken from the pools for
this purpose, at position 0, and their logits are never read. Every op of the stacked step is a
batch-invariant kernel (or elementwise), so a live row's bits cannot depend on them. Where the pools
have no room for scratch (a private one-sequence cache), the bucket is B itself. Buckets go to 1024 so that
a max_batch sized from the KV memory (memra.engine.batch_size) past 512 still pads to a few graphs rather
than capturing one per batch size; the warm-up captures none beyond the bucket of max_batch.

Bits: the replay launches the eager stacked step's kernels on the same bytes. Only how the per-row
inputs arrive differs (a gather from the table instead of a host-built index; states gathered by slot
instead of stacked per cache), and those are copies. tests/test_graphs.py holds a graphed decode to the
eager one, bit for bit, on the GPU; on CPU it runs the static step eagerly against decode_step.

MoE layers are graphed where they run as grouped matmuls (memra.kernels.triton.moe: the routing is
planned on the device, the launches are fixed); the per-expert loop of the fast path is not capturable.

Not graphed (eager as before): MoE models off the grouped path, rows whose
caches do not share one KV pool and one recurrent pool, pipeline-split walks, the verify forward.
MEMRA_CUDA_GRAPHS=0 turns graphs off. The engine's mixed step (decode rows and prefill pieces in one
forward) has captured steps of its own, built from the pieces here: memra.mixed_graphs.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch

from memra import counters
from memra.capture import no_host_sync
from memra.cache import BLOCK_SIZE, Cache, KvPool, RecurrentPool
from memra.kernels.cuts import ATTN_SPLIT
from memra.kernels.slots import INERT_SLOT
from memra.model.ffn import Moe
from memra.model.context import RowGroup, StackedStep
from memra.upload import upload

BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
MIN_TABLE_BLOCKS = 16  # NB never below this (256 positions), so short contexts share one graph
SPLIT_BLOCKS = ATTN_SPLIT // BLOCK_SIZE  # NB of a step whose rows all fit in one attention split


def bucket_for(batch: int) -> int | None:
    return next((b for b in BUCKETS if b >= batch), None)


def table_blocks(max_ctx: int) -> int:
    """NB: the block-table width for rows of up to max_ctx positions (a power of two)."""
    need = max(MIN_TABLE_BLOCKS, -(-max_ctx // BLOCK_SIZE))
    return 1 << (need - 1).bit_length()


def step_blocks(caches: list[Cache], ends: list[int]) -> int:
    """NB for a step whose rows read positions below ends[i] (each row's last position + 1): one split's
    worth where every row fits in one attention split, else the width of the rows' max_ctx. So a
    server meets two widths (two graphs a bucket), not one per power of two its contexts pass."""
    full = table_blocks(max(c.max_ctx for c in caches))
    return SPLIT_BLOCKS if max(ends) <= ATTN_SPLIT and SPLIT_BLOCKS < full else full


def long_tables(max_ctx: int) -> bool:
    """Do rows of up to max_ctx positions meet a second table width (step_blocks)?"""
    return table_blocks(max_ctx) > SPLIT_BLOCKS


def full_width_pass(max_ctx: int, steps: int) -> bool:
    """Can a warm-up meet the full table width too: is there a second width, and room in max_ctx for a
    row primed past one attention split and then `steps` more steps of its own (with margin)?"""
    return long_tables(max_ctx) and max_ctx >= ATTN_SPLIT + 2 * steps + 2


@dataclass(frozen=True)
class GraphKey:
    bucket: int
    table_blocks: int
    kv: int  # id() of the KV pool
    kv_version: int
    rec: int | None  # id() of the recurrent pool
    rec_version: int | None
    tokens: int = 0  # a mixed step's prompt-token bucket (memra.mixed_graphs); 0 for a decode step
    decode_blocks: int = 0  # a mixed step's decode rows' table width (memra.mixed_graphs); 0 for a decode step


class StaticDecode:
    """One bucket's static step: its input buffer, its captured graph, its output."""

    def __init__(self, model, kv: KvPool, rec: RecurrentPool | None, bucket: int, nb: int):
        self.model, self.kv, self.rec, self.bucket, self.nb = model, kv, rec, bucket, nb
        dev = model.device
        self.args = torch.zeros(bucket, 3 + nb, dtype=torch.long, device=dev)
        # one buffer for the bucket's table widths over these pools (one engine's), widened out after each replay
        key = (bucket, id(kv))
        if key not in model.decode_logits:  # in the head's dtype: widened as it is read out
            model.decode_logits[key] = torch.zeros(bucket, model.cfg.vocab_size, dtype=model.dtype, device=dev)
        self.logits = model.decode_logits[key]
        if dev.type == "cuda":
            model.decode_graph_pool = capture_pool(model.decode_graphs, model.decode_graph_pool)
        self.offsets = torch.arange(BLOCK_SIZE, device=dev)  # [BLOCK]
        self.starts = torch.arange(bucket, device=dev) * (nb * BLOCK_SIZE)  # row r's prefix in the flat rows
        self.graph: torch.cuda.CUDAGraph | None = None

    def body(self) -> torch.Tensor:
        """The decode step of every row, from `args` alone -> logits [Bp, V] in the head's dtype (into self.logits)."""
        m = self.model
        step = table_step(m, self.kv, self.rec, self.args[:, 1:], self.offsets, self.starts)
        h = m.embed_tokens(self.args[:, 0])
        for block in m.blocks:
            h = block.forward_stacked(h, step)
        return held(self.logits, m.head_logits(m.norm_out(h)))

    def fill(self, ids: torch.Tensor, caches: list[Cache], scratch: tuple[int, int | None] | None) -> None:
        """Write the rows' inputs (live rows first, then inert padding on the pools' scratch block and
        slot) into `args`. The scratch comes with each call, not with the graph: a bucket's graph may
        first be captured by a full batch, which pads nothing."""
        # Only the table columns some row uses come from the host, so a wide table (a long max_ctx) costs
        # no copy per step; the rest are zeroed on the device (never a stale block of an earlier fill).
        b, used = len(caches), min(max(len(c.blocks) for c in caches), self.nb)
        host = host_rows(caches, self.bucket, used, scratch, self.model.settings.inert_padding)
        self.args[:, 1 : 3 + used].copy_(upload(torch.from_numpy(host), self.args.device))  # queued, no wait
        self.args[:, 3 + used :].zero_()
        self.args[:b, 0].copy_(ids)
        self.args[b:, 0] = 0

    def run(self, ids: torch.Tensor, caches: list[Cache], scratch: tuple[int, int | None] | None) -> torch.Tensor:
        """The step for these rows -> their logits [B, V], replayed (or first captured: run_static)."""
        self.fill(ids, caches, scratch)
        run_static(self, self.model.decode_graph_pool)
        return widened(self.logits[: len(caches)])  # the buffer is overwritten by the next run


def held(buffer: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """A captured step's logits [R, V] (the head's dtype) into its shared buffer -> the buffer. Same dtype, or
    loudly not: a copy would round them silently."""
    assert logits.dtype == buffer.dtype, f"the head gave {logits.dtype} logits for a {buffer.dtype} buffer"
    return buffer.copy_(logits)


def widened(*rows: torch.Tensor) -> torch.Tensor:
    """Row ranges of a captured step's logits buffer, read out as one new fp32 tensor [sum of rows, V]: the copy
    that frees the buffer for the next replay and the widening (exact) in one pass over the head's bf16, where
    the fp32 logits used to be made in the graph, copied into an fp32 buffer and cloned out: three passes."""
    out = torch.empty(sum(r.shape[0] for r in rows), rows[0].shape[-1], dtype=torch.float32, device=rows[0].device)
    at = 0
    for r in rows:
        out[at : at + r.shape[0]].copy_(r)
        at += r.shape[0]
    return out


_CAPTURE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def capture_stream(device: torch.device) -> "torch.cuda.Stream":
    """The one stream of this device on which a step that calls cuBLAS runs first eagerly, then its capture
    (run_static). One stream, and the same for both: cuBLAS (the MEMRA_LINEAR_CUBLAS path) takes a workspace
    per stream on its first call there, kept for the process. Taken during a capture it would come from that
    graph's private memory pool and pin it: once the pool's graphs are dropped (pools enlarged, an engine closed)
    the pool can never be freed, and a later capture that names it fails torch's allocator assert
    (use_count > 0). The eager run on this stream takes the workspace outside any capture; and a fresh
    stream per capture would take a new workspace each time."""
    if device not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[device] = torch.cuda.Stream(device)
    return _CAPTURE_STREAMS[device]


def capture_pool(store: dict, pool):
    """The memory pool a new capture among `store`'s steps goes into: `pool`, the one they share (the steps
    never run at once), while any of them holds a captured graph; else a new one. torch refuses to reopen a
    pool whose graphs are all gone (static_for drops an old version's steps) once it cannot free it."""
    live = pool is not None and any(s.graph is not None for s in store.values())
    return pool if live else torch.cuda.graph_pool_handle()


def run_static(static, pool=None) -> None:
    """Run a static step's body() (reading its filled buffers, writing its outputs). The first run on a
    GPU runs it eagerly on a side stream (which also compiles every kernel, so none compiles during
    capture), then records static.graph (in the memory pool `pool`, or one of its own); recording
    launches nothing, so the step happens once. Later runs replay. Off the GPU there are no graphs: the
    body runs eagerly (how the CPU tests exercise it). The eager runs of the GPU's kernel table refuse any op
    that makes the host wait for the device (memra.capture): a path a capture cannot record fails on CPU too."""
    device = static.logits.device
    if device.type != "cuda":
        # With the GPU's kernel table (tests run it in Triton's interpreter), what would break a capture breaks here
        with no_host_sync(f"{type(static).__name__}.body") if static.model.ops.invariant else contextlib.nullcontext():
            static.body()
    elif static.graph is None:
        # One stream for the warm-up and the capture where the step calls cuBLAS (MEMRA_LINEAR_CUBLAS, on by
        # default: the fix its captures need); with the door shut, the side stream and torch's own capture
        # stream, as before the door, until a GPU run of the whole suite holds the one stream there too.
        one_stream = static.model.ops.cublas_linear
        side = capture_stream(device) if one_stream else torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), no_host_sync(f"{type(static).__name__}.body"):
            static.body()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=side if one_stream else None):
            static.body()
        static.graph = graph
        counters.bump("graph_captures")
    else:
        static.graph.replay()
        counters.bump("graph_replays")


def table_step(model, kv: KvPool, rec: RecurrentPool | None, rows: torch.Tensor, offsets: torch.Tensor,
               starts: torch.Tensor) -> StackedStep:
    """The stacked step of rows described on the device by rows [B, 2 + NB] (position, recurrent slot,
    block table): everything derived there, as the captured step derives it. offsets = arange(BLOCK_SIZE);
    starts[r] = r * NB * BLOCK_SIZE, where row r's prefix begins in the flat rows."""
    pos, slots, table = rows[:, 0], rows[:, 1], rows[:, 2:]
    flat = (table[:, :, None] * BLOCK_SIZE + offsets).reshape(rows.shape[0], -1)  # [B, NB*BLOCK]
    write_rows = flat.gather(1, pos[:, None])[:, 0]  # [B] where each row's new K/V goes
    cos, sin = model.ops.rope_cos_sin(pos, model.inv_freq, model.dtype)  # [B, R]
    group = RowGroup(kv, slice(None), write_rows, flat.reshape(-1), starts, pos + 1, flat.shape[1])
    # the slots column made contiguous once a step: each GDN layer's conv and delta-rule steps would otherwise
    # copy it for their kernels, two small copies a layer (48 a Qwen3.5-9B step)
    return StackedStep([], cos, sin, (group,), rec=rec, slots=slots.contiguous() if rec is not None else None)


def host_rows(caches: list[Cache], height: int, width: int,
              scratch: tuple[int, int | None] | None = None, inert: bool = False) -> np.ndarray:
    """[height, 2 + width] int64: each cache's position, recurrent slot (0 without one) and block table
    (its first `width` blocks: those of the positions the step reads), zero beyond (block 0: a valid
    index for paths that gather a row's whole table and mask by length). Rows past the caches are
    inert: position 0 of the pools' scratch block and slot (`scratch`); with `inert` (MEMRA_INERT_PADDING)
    the slot marked as a padding row's, INERT_SLOT past it, which the Triton step kernels leave alone.
    Built in numpy, whose element stores are cheap next to torch's: 64 rows of 20 blocks take 0.05-0.1
    ms against 1.7 ms on a 2-core CPU, host time spent before the step can launch."""
    host = np.zeros((height, 2 + width), dtype=np.int64)
    for i, c in enumerate(caches):
        host[i, 0] = c.pos
        host[i, 1] = c.slot if c.slot is not None else 0
        blocks = c.blocks[:width]
        host[i, 2 : 2 + len(blocks)] = blocks
    if len(caches) < height:
        if scratch is None:
            raise RuntimeError(f"{height - len(caches)} padding rows need the pools' scratch block, and none was given")
        block, slot = scratch
        host[len(caches) :, 1] = (slot if slot is not None else 0) + (INERT_SLOT if inert else 0)
        host[len(caches) :, 2:] = block
    return host


def eager_table_step(model, caches: list[Cache]) -> StackedStep:
    """The captured step's inputs for these rows, built eagerly (the mixed step's decode rows,
    memra.runner.bodies.mixed_layers), at the table width their graph would have."""
    nb = step_blocks(caches, [c.pos + 1 for c in caches])
    dev = model.device
    rows = upload(torch.from_numpy(host_rows(caches, len(caches), nb)), dev)
    return table_step(model, caches[0].kv, caches[0].rec, rows, torch.arange(BLOCK_SIZE, device=dev),
                      torch.arange(len(caches), device=dev) * (nb * BLOCK_SIZE))


def graph_key(bucket: int, nb: int, kv: KvPool, rec: RecurrentPool | None, tokens: int = 0,
              decode_blocks: int = 0) -> GraphKey:
    """Which captured step serves this bucket and width over these pools as they are now (an enlarged
    pool has new tensors, so its version is part of the key)."""
    return GraphKey(bucket, nb, id(kv), kv.version, id(rec) if rec is not None else None,
                    rec.version if rec is not None else None, tokens, decode_blocks)


def static_for(store: dict, key: GraphKey, make):
    """The static step stored under `key`, made by make() on first use. Steps captured against tensors a
    pool has since replaced (KV blocks or state slots: an older version of the same pools) are dropped."""
    static = store.get(key)
    if static is None:
        for old in [k for k in store if (k.kv, k.rec) == (key.kv, key.rec)
                    and (k.kv_version, k.rec_version) != (key.kv_version, key.rec_version)]:
            del store[old]
        static = store[key] = make()
    return static


def graphable(model, caches: list[Cache]) -> bool:
    """May a step over these caches be replayed from a graph here?"""
    if model.device.type != "cuda" or not model.settings.cuda_graphs:  # MEMRA_CUDA_GRAPHS
        return False
    if not all(model.ops.grouped_moe_weights(b.ffn.w_gate_up) for b in model.blocks if isinstance(b.ffn, Moe)):
        return False  # the per-expert loop (packed experts, the torch table) asks the host which experts were chosen
    kv, rec = caches[0].kv, caches[0].rec
    return all(c.kv is kv and c.rec is rec for c in caches)


def reserve_scratch(model, kv: KvPool, rec: RecurrentPool | None) -> None:
    """Set aside one KV block and one recurrent slot of these pools for inert rows, now. A server
    sizes its pools one larger and calls this before admitting anything, so its own accounting of
    blocks and slots never meets the scratch."""
    scratch_of(kv, rec, model.graph_scratch)


def drop_graphs(model, kv: KvPool, rec: RecurrentPool | None) -> None:
    """Forget every captured step and scratch of these pools (their engine is closing): the steps hold the
    pools' tensors, and their graphs a memory pool, which would otherwise live as long as the model."""
    for store in (model.decode_graphs, model.mixed_graphs):
        for key in [k for k in store if (k.kv, k.rec) == (id(kv), id(rec) if rec is not None else None)]:
            del store[key]
    model.graph_scratch.pop((id(kv), id(rec)), None)
    for key in [k for k in model.decode_logits if k[1] == id(kv)]:
        del model.decode_logits[key]
    if not model.decode_graphs:  # the memory pool the decode captures share: none left to use it
        model.decode_graph_pool = None
    if not model.mixed_graphs:  # the same for the mixed steps
        model.mixed_logits.clear()
        model.mixed_graph_pool = None


def scratch_of(kv: KvPool, rec: RecurrentPool | None, memo: dict) -> tuple[int | None, int | None] | None:
    """The pools' scratch block and slot for inert rows, taken once per pool; None if there is no room."""
    key = (id(kv), id(rec))
    if key not in memo:
        if not kv.free or (rec is not None and not rec.free):
            return None
        memo[key] = (kv.allocate(1)[0], rec.allocate() if rec is not None else None)
    return memo[key]


def graphed_decode(model, ids: torch.Tensor, caches: list[Cache]) -> torch.Tensor | None:
    """The stacked decode step of `caches` (ids [B] on the device) replayed from a graph, advancing
    every cache by one position -> logits [B, V] fp32; or None where graphs do not apply (eager then)."""
    if not graphable(model, caches):
        return None
    kv, rec, b = caches[0].kv, caches[0].rec, len(caches)
    bucket, scratch = bucket_for(b), None
    if bucket is not None and bucket > b:
        scratch = scratch_of(kv, rec, model.graph_scratch)
    if bucket is None or (bucket > b and scratch is None):
        bucket = b  # no room for inert rows (or wider than every bucket): a graph of exactly this width
    nb = step_blocks(caches, [c.pos + 1 for c in caches])
    static = static_for(model.decode_graphs, graph_key(bucket, nb, kv, rec),
                        lambda: StaticDecode(model, kv, rec, bucket, nb))
    logits = static.run(ids, caches, scratch)
    for c in caches:
        c.pos += 1
    return logits
