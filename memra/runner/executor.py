"""How a step's layers run: the Executor protocol, and the unsplit executor.

memra.step is the one front of every step (validation, prompt cuts, the decode plan, counters); it
hands the work to the model's executor, chosen once when the model is loaded (memra.runner.choose):

    UnsplitExecutor            every layer in this process, on the model's device (here)
    PipelineExecutor           the layers split into stages in this process (memra.pp.executor)
    DistPipeline               one stage per process, over torch.distributed (memra.pp.dist_driver)

Each runs the same bodies (memra.runner.bodies) over its layer ranges, so which one runs changes
where bytes live and travel, never what a row computes. Every refusal an executor owns (a plan its
placement cannot run, a body over remote weights) happens before any cache moves.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch

from memra import counters
from memra.cache import Cache
from memra.decode_plan import decode_bucketed
from memra.mixed_graphs import graphed_mixed
from memra.state_trail import StateTrail
from memra.runner.bodies import (
    decode_one,
    decode_stacked,
    mixed_layers,
    piece_layers,
    segment_bounds,
    segment_layers,
    verify_head,
    verify_layers,
    verify_rows_layers,
)
from memra.upload import upload_values


class Executor(Protocol):
    """What memra.step asks of a placement. Inputs are validated token ids on the model's device and
    caches with room reserved; the calls advance cache positions."""

    n_stages: int
    runtime: object | None  # the in-process pipeline's runtime (memra.pp.runtime.PpRuntime), else None
    batches_prime: bool  # can run several sequences' prompt pieces in one forward (run_prime_wave)
    mixes_steps: bool  # can run a decode step and a prefill wave in one forward (run_mixed)

    def open_cache(self, max_ctx: int):
        """A new sequence's cache, drawn from the pools this placement owns."""

    def check_plan(self, plan: str) -> str:
        """The decode plan, or a refusal of a plan this placement cannot run."""

    def preflight(self, call: str, caches) -> None:
        """Refusals this placement owns for `call` ("prime", "decode_step", "decode_step_batch",
        "decode_step_t") over these caches, before any cache moves."""

    def run_prime(self, pieces: Sequence[torch.Tensor], cache, all_logits: bool, hidden: bool):
        """Prompt pieces (forwards cut by memra.step.forward_cuts) -> memra.step.prime's result."""

    def run_prime_wave(self, pieces: Sequence[torch.Tensor], caches, want: Sequence[bool]) -> list:
        """One forward over one prompt piece of each of several sequences (only where batches_prime). ->
        the last-position logits [V] of piece i where want[i] (its prompt's final piece), else None."""

    def run_mixed(self, ids: torch.Tensor, dec_caches, pieces: Sequence[torch.Tensor], pre_caches):
        """One stacked decode step of rows ids [B] and one prompt piece into each of pre_caches, in one forward
        (only where mixes_steps). -> (logits [B, V] fp32, each piece's last-position logits [V]), or None
        where it declines (no captured step applies, and it does not mix eagerly): nothing has moved then."""

    def run_decode(self, ids: torch.Tensor, caches, plan: str, batched: bool) -> torch.Tensor:
        """One decode step of rows ids [B] -> logits [B, V] fp32. `batched`: called as decode_step_batch."""

    def run_verify(self, ids: torch.Tensor, cache, plan: str, trail: StateTrail | None):
        """The verify forward of T tokens at cache.pos -> (logits [T, V] fp32, h_seed [T, E])."""


class UnsplitExecutor:
    """Every layer in this process, on the model's device: the bodies over [0, L)."""

    n_stages = 1
    runtime = None
    batches_prime = True

    def __init__(self, model):
        self.model = model
        self.mixes_steps = model.settings.mixes_steps()  # MEMRA_MIXED_STEP, decided at load
        self.mixes_eagerly = model.settings.mixes_eagerly(model.device.type)

    def open_cache(self, max_ctx: int) -> Cache:
        return self.model.pools().new_cache(max_ctx)

    def check_plan(self, plan: str) -> str:
        return plan

    def preflight(self, call: str, caches) -> None:
        pass

    def run_prime(self, pieces, cache: Cache, all_logits: bool, hidden: bool):
        m = self.model
        logits, normed, h_last = [], [], None
        for piece in pieces:
            h = piece_layers(m, m.embed_tokens(piece), cache, cache.pos, 0, None)
            cache.pos += piece.numel()
            counters.bump("prime_pieces")
            if all_logits or hidden:
                normed.append(m.norm_out(h))
                if all_logits:
                    logits.append(m.logits(normed[-1]))
            h_last = h[-1:]
        out = torch.cat(logits) if all_logits else m.logits(m.norm_out(h_last))[0]
        return (out, torch.cat(normed)) if hidden else out

    def run_prime_wave(self, pieces, caches, want) -> list:
        m = self.model
        bounds = segment_bounds(pieces)
        h = segment_layers(m, m.embed_tokens(torch.cat(list(pieces))), caches, [c.pos for c in caches], bounds, 0, None)
        advance_wave(pieces, caches)
        return wave_logits(m, h, bounds, want)

    def run_mixed(self, ids: torch.Tensor, dec_caches, pieces, pre_caches):
        m, b = self.model, len(dec_caches)
        out = graphed_mixed(m, ids, dec_caches, pieces, pre_caches)
        if out is None:
            if not self.mixes_eagerly:
                return None
            bounds = segment_bounds(pieces)
            h = mixed_layers(m, m.embed_tokens(torch.cat([ids, *pieces])), dec_caches, pre_caches, bounds)
            rows = upload_values(list(range(b)) + [b + hi - 1 for _, hi in bounds], torch.long, h.device)
            logits = m.logits(m.norm_out(h.index_select(0, rows)))  # the decode rows, then each piece's last
            out = logits[:b], list(logits[b:])
        for c in dec_caches:
            c.pos += 1
        advance_wave(pieces, pre_caches)
        return out

    def run_decode(self, ids: torch.Tensor, caches, plan: str, batched: bool) -> torch.Tensor:
        m = self.model
        # one row on CPU: the row plan's form, whose layers are one C call each (memra.kernels.cpu_layer), with
        # the stacked form's bits (tests/test_cpu_decode.py)
        if plan == "stacked" and not (len(caches) == 1 and m.device.type == "cpu"):
            counters.bump("stacked_decode_forwards")
            return decode_stacked(m, ids, caches)
        if plan == "bucket":
            return decode_bucketed(m, ids, caches, decode_stacked)
        return torch.stack([decode_one(m, ids[i : i + 1], c) for i, c in enumerate(caches)])

    def run_verify(self, ids: torch.Tensor, cache: Cache, plan: str, trail: StateTrail | None):
        m = self.model
        h = verify_layers(m, m.embed_tokens(ids), cache, cache.pos, plan, trail=trail)
        out = verify_head(m, h, plan)
        cache.pos += ids.numel()
        return out

    def run_verify_batch(self, ids: torch.Tensor, caches, lens: list[int], plan: str, trails):
        """Several sequences' verifies in one forward: ids [N], sequence i's lens[i] tokens in consecutive
        rows -> (logits [N, V] fp32, h_seed [N, E]). Only this executor has it (memra.verify_batch)."""
        m = self.model
        out = verify_head(m, verify_rows_layers(m, m.embed_tokens(ids), caches, lens, plan, trails), plan)
        for c, n in zip(caches, lens):
            c.pos += n
        return out


def advance_wave(pieces, caches) -> None:
    """After a prefill wave: every cache stands after its piece; the liveness counters move."""
    for p, c in zip(pieces, caches):
        c.pos += p.numel()
    counters.bump("prime_pieces", len(caches))
    if len(caches) > 1:
        counters.bump("prime_batches")
        counters.bump("prime_batch_segments", len(caches))


def wave_logits(model, h: torch.Tensor, bounds, want) -> list:
    """The head over each wanted piece's last row: logits [V] fp32 each (None where not wanted). One
    [n, E] head; on the invariant kernels a row's bits are its [1, E] head's (memra.step.prime_batch)."""
    rows = [hi - 1 for (_, hi), w in zip(bounds, want) if w]
    if not rows:
        return [None] * len(bounds)
    last = h[rows[0] : rows[0] + 1] if len(rows) == 1 else h.index_select(0, upload_values(rows, torch.long, h.device))
    logits = iter(model.logits(model.norm_out(last)))
    return [next(logits) if w else None for w in want]
