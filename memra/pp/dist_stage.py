"""One rank's stage: its layer range, the caches of its own layers, and the stage bodies.

The bodies are every executor's (memra.runner.bodies), run over this stage's layer range [a, b) on
this rank's device: rows_layers / rows_head for decode rows, piece_layers for prime pieces,
verify_layers / verify_head for the verify forward.
Same kernels, same shapes, same order as the unsplit walk — so with the boundary moving bytes
unchanged, a walk split across processes is bit-identical to the unsplit one (E2).

Rank 0 runs stage 0 through these same functions; the other ranks run them from the worker loop.
Each rank holds state only for its own layers (a cache per sequence id) and mirrors every sequence's
position: a command carries the positions the driver expects, and a rank whose mirror disagrees
refuses before computing anything (a silent desync would produce plausible wrong logits).
"""

from __future__ import annotations

import gc
import zlib

import torch

from memra.cache import Cache, new_cache
from memra.pp.fence import PipelineError, StageFence
from memra.runner.bodies import piece_layers, rows_head, rows_layers, verify_head, verify_layers
from memra.state_trail import StateTrail

PLANS = {"row": 1, "stacked": 2}  # the decode plans a stage split can run (bucket has none)
PLAN_NAMES = {v: k for k, v in PLANS.items()}


def own_layers(model, fence: StageFence, stage: int) -> frozenset[int]:
    """The layers whose state stage `stage` holds: its trunk range, plus the MTP blocks on the last stage."""
    a, b = fence.ranges[stage]
    mtp = range(model.cfg.n_layers, model.cfg.n_layers + model.cfg.n_mtp) if stage == fence.n_stages - 1 else ()
    return frozenset([*range(a, b), *mtp])


def stage_cache(model, max_ctx: int, own: frozenset[int]) -> Cache:
    """A one-sequence cache holding only `own` layers' KV and recurrent state, on the model's device.
    Other layers are placed on the meta device (no memory) and then dropped from the pools, so the
    cache's snapshot/rollback/reset walk only this stage's layers."""
    cfg = model.cfg
    meta = torch.device("meta")
    elsewhere = {i: meta for i in range(cfg.n_layers + cfg.n_mtp) if i not in own}
    c = new_cache(cfg, max_ctx, model.dtype, model.device, elsewhere)
    for table in (c.kv.k, c.kv.v):
        for i in [i for i in table if i not in own]:
            del table[i]
    c.kv.layers = tuple(i for i in c.kv.layers if i in own)
    if c.rec is not None:
        for table in (c.rec.conv, c.rec.ssm):
            for i in [i for i in table if i not in own]:
                del table[i]
        c.rec.layers = tuple(i for i in c.rec.layers if i in own)
    return c


def fingerprint(model) -> int:
    """A checksum of the config and a few weights every rank loaded (before trimming): ranks that
    loaded different checkpoints, dtypes or conversions must refuse to form one pipeline."""
    crc = zlib.crc32(repr((model.cfg.describe(), str(model.dtype))).encode())
    for t in (model.final_norm, model.embed[:2], model.lm_head[-2:]):
        if not isinstance(t, torch.Tensor):  # a packed weight type: its config is in the describe() above
            continue
        crc = zlib.crc32(t.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy().tobytes(), crc)
    return crc & 0x7FFFFFFF


def release_foreign_weights(model, fence: StageFence, stage: int) -> None:
    """Drop the weights this stage never reads (other stages' blocks, and the embedding or head where
    they live elsewhere), so a rank's memory holds its own stage. The model object is then usable
    only through the stage bodies here."""
    first, last = stage == 0, stage == fence.n_stages - 1
    a, b = fence.ranges[stage]
    for i in range(len(model.blocks)):
        if not a <= i < b:
            model.blocks[i] = None
    tied = model.lm_head is model.embed
    embed, head = model.embed, model.lm_head
    model.embed = embed if first or (last and tied) else None
    model.lm_head = (embed if tied else head) if last else None
    if not last:
        model.mtp = []
    gc.collect()
    if model.device.type == "cuda":
        torch.cuda.empty_cache()


class StageState:
    """What one rank knows: its stage of the fence, its model (own weights), and a cache per sequence."""

    def __init__(self, model, fence: StageFence, stage: int):
        self.model, self.fence, self.stage = model, fence, stage
        self.layers = fence.ranges[stage]
        self.first, self.last = stage == 0, stage == fence.n_stages - 1
        self.own = own_layers(model, fence, stage)
        self.caches: dict[int, Cache] = {}
        self.trails: dict[int, StateTrail] = {}
        self.trail_marks: dict[int, tuple[int, int]] = {}  # seq -> (pos0, T) of the verify its trail holds
        self.prime_rows: dict[int, list[torch.Tensor]] = {}  # last stage: a prime in flight, per sequence
        self.counts = {"messages": 0, "rows": 0, "pieces": 0, "verifies": 0, "canaries": 0}

    # --- sequences ---
    def new_seq(self, seq: int, max_ctx: int) -> Cache:
        if seq in self.caches:
            raise PipelineError(f"stage {self.stage}: sequence {seq} already exists")
        c = self.caches[seq] = stage_cache(self.model, max_ctx, self.own)
        return c

    def free_seq(self, seq: int) -> None:
        c = self.caches.pop(seq, None)
        if c is None:
            raise PipelineError(f"stage {self.stage}: cannot free sequence {seq}: it does not exist here")
        c.free()
        self.trails.pop(seq, None)
        self.trail_marks.pop(seq, None)
        self.prime_rows.pop(seq, None)

    def cache(self, seq: int, pos: int) -> Cache:
        """The sequence's cache, after checking this rank's position mirror against the driver's."""
        c = self.caches.get(seq)
        if c is None:
            raise PipelineError(f"stage {self.stage}: unknown sequence {seq} (never created here, or freed)")
        if c.pos != pos:
            raise PipelineError(f"stage {self.stage}: sequence {seq} stands at position {c.pos} here but the driver "
                                f"says {pos}: the position mirror diverged")
        return c

    # --- bodies over this stage's range ---
    def rows(self, h: torch.Tensor, seqs, positions, plan: str) -> torch.Tensor:
        """Decode rows: h [B, E] in; -> [B, E] (or [B, V] logits on the last stage)."""
        caches = [self.cache(s, p) for s, p in zip(seqs, positions)]
        for c in caches:
            c.reserve(1)
        out = rows_layers(self.model, h, caches, plan, *self.layers)
        for c in caches:
            c.pos += 1
        self.counts["rows"] += len(caches)
        return rows_head(self.model, out, plan) if self.last else out

    def piece(self, h: torch.Tensor, seq: int, pos0: int, last_piece: bool, all_logits: bool):
        """A prime piece: h [n, E] in; -> [n, E] for the next stage. On the last stage: None until the
        final piece, then the prime's logits ([V], or [T, V] with all_logits) — computed as
        the unsplit prime computes them (each piece's normed rows, or the final piece's last row)."""
        c = self.cache(seq, pos0)
        c.reserve(h.shape[0])
        out = piece_layers(self.model, h, c, pos0, *self.layers)
        c.pos += h.shape[0]
        self.counts["pieces"] += 1
        if not self.last:
            return out
        m = self.model
        kept = self.prime_rows.setdefault(seq, [])
        if all_logits:
            kept.append(m.logits(m.norm_out(out)))  # [n, V] per piece, as the unsplit prime computes them
        else:
            kept[:] = [out[-1:]]  # only the final piece's last row is ever read
        if not last_piece:
            return None
        rows = self.prime_rows.pop(seq)
        return torch.cat(rows) if all_logits else m.logits(m.norm_out(rows[-1]))[0]

    def verify(self, h: torch.Tensor, seq: int, pos0: int, plan: str, record: bool):
        """The verify forward of T tokens: h [T, E] in; -> [T, E], or on the last stage (logits [T, V],
        h_seed [T, E]) — verify_layers / verify_head over this stage's range."""
        c = self.cache(seq, pos0)
        c.reserve(h.shape[0])
        trail = self.trails.setdefault(seq, StateTrail()) if record else None
        out = verify_layers(self.model, h, c, pos0, plan, *self.layers, trail=trail, device=self.model.device)
        c.pos += h.shape[0]
        if record:
            self.trail_marks[seq] = (pos0, h.shape[0])
        else:
            self.trail_marks.pop(seq, None)
        self.counts["verifies"] += 1
        return verify_head(self.model, out, plan) if self.last else out

    def rollback(self, seq: int, pos0: int, keep: int) -> None:
        """Keep the first `keep` tokens of the verify from pos0 (GDN state from this rank's trail)."""
        c = self.caches.get(seq)
        if c is None:
            raise PipelineError(f"stage {self.stage}: cannot roll back unknown sequence {seq}")
        mark = self.trail_marks.get(seq)
        if mark is None or mark[0] != pos0:
            raise PipelineError(f"stage {self.stage}: sequence {seq} has no recorded verify from position {pos0} "
                                "to roll back (verify with a trail first)")
        c.rollback(pos0, keep, self.trails[seq])
        self.trail_marks.pop(seq, None)
