"""The split walks: every step body run stage by stage across the pipeline runtime.

A walk embeds on stage 0, runs each stage's layer range in that stage's scope (its device and
stream), hands the residual across each boundary (tx in the sender's scope, rx in the receiver's),
and applies the head (final norm + lm_head) on the last stage. The arithmetic per row is exactly
the unsplit walk's — same kernels, same shapes, same order — which is why split == unsplit to the
bit (E2); the boundary only moves bytes.

Bodies:
  walk_rows      one decode step for rows of a wave (B=1 decode_step, decode_step_batch, dual waves)
  walk_tokens    T tokens of one sequence (prime pieces)
  walk_verify    the T = K+1 verify forward of speculative decoding (bodies.verify_layers per stage)
  prime_split    prime through the split, piece by piece, or as the PP-2 chunk pipeline
  walk_wave      one prompt piece of each of several sequences in one forward (cross-request prefill)
  decode_waves   the dual-active PP-2 body: two waves in flight on alternating boundary slots
"""

from __future__ import annotations

import contextlib
import threading
import time

import torch

from memra import counters
from memra.pp import fence as pf
from memra.pp.runtime import PpRuntime
from memra.runner.bodies import piece_layers, rows_head, rows_layers, segment_layers, verify_head, verify_layers


def active_runtime(model) -> PpRuntime | None:
    """The in-process pipeline's runtime the model was loaded with (memra.pp.executor), or None."""
    return model.executor.runtime


def _stage_rows(model, rt: PpRuntime, s: int, h: torch.Tensor, caches, plan: str) -> torch.Tensor:
    """Stage s's layers for rows h [n, E], on its device."""
    return rows_layers(model, h, caches, plan, *rt.stages[s].layers, device=rt.stages[s].device)


def caller_stream(model) -> torch.cuda.Stream | None:
    return torch.cuda.current_stream(model.device) if model.device.type == "cuda" else None


def _walk_stages(model, rt: PpRuntime, ids: torch.Tensor, stage_body, pipelined: bool = False) -> torch.Tensor:
    """Embed `ids` on stage 0, run `stage_body(s, h)` in each stage's scope with the residual handed
    across every boundary, and return the last stage's result (ordered for the caller's stream)."""
    caller = caller_stream(model)
    rt.fence_stages_behind(caller)
    h, slot = None, 0
    for s, st in enumerate(rt.stages):
        with st.scope():
            h = model.embed_tokens(ids.to(st.device)) if s == 0 else rt.rx(s - 1, slot)
            h = stage_body(s, h)
            if s < rt.n_stages - 1:
                slot = rt.tx(s, h, pipelined)
    rt.publish_to(rt.n_stages - 1, caller)
    counters.bump("pp_split_walks")
    return h


def walk_rows(model, rt: PpRuntime, ids: torch.Tensor, caches, plan: str, pipelined: bool = False) -> torch.Tensor:
    """One decode step of rows `ids` [n] through every stage, serially. -> logits [n, V] on the last
    stage (ordered for the caller's stream). Cache positions advance after the last stage."""
    def body(s: int, h: torch.Tensor) -> torch.Tensor:
        h = _stage_rows(model, rt, s, h, caches, plan)
        return rows_head(model, h, plan) if s == rt.n_stages - 1 else h

    out = _walk_stages(model, rt, ids, body, pipelined)
    for c in caches:
        c.pos += 1
    return out


def walk_tokens(model, rt: PpRuntime, piece: torch.Tensor, cache) -> torch.Tensor:
    """T tokens of one sequence through every stage (cache.pos is their first position).
    -> the last stage's hidden states [T, E] (pre-norm); the cache position is not advanced."""
    def body(s: int, h: torch.Tensor) -> torch.Tensor:
        st = rt.stages[s]
        return piece_layers(model, h, cache, cache.pos, *st.layers, device=st.device)

    return _walk_stages(model, rt, piece, body)


def walk_verify(model, rt: PpRuntime, ids: torch.Tensor, cache, plan: str, trail=None):
    """The verify forward (T = K+1 tokens of one sequence) through the stage split: each stage runs
    memra.runner.bodies.verify_layers over its range — the body the unsplit verify runs over [0, L) — and the [T, E]
    residual crosses each boundary by byte copy. -> (logits [T, V], h_seed [T, E]) on the last stage;
    the cache position is not advanced (the executor does that once)."""
    out: list[tuple[torch.Tensor, torch.Tensor]] = []

    def body(s: int, h: torch.Tensor) -> torch.Tensor:
        st = rt.stages[s]
        h = verify_layers(model, h, cache, cache.pos, plan, *st.layers, trail=trail, device=st.device)
        if s == rt.n_stages - 1:
            out.append(verify_head(model, h, plan))
        return h

    _walk_stages(model, rt, ids, body)
    counters.bump("spec_verify_split_walks")
    return out[0]


def walk_wave(model, rt: PpRuntime, pieces, caches, bounds) -> torch.Tensor:
    """Several sequences' prompt pieces, concatenated, through every stage in one forward per stage.
    -> the last stage's hidden states [N, E] (pre-norm), ordered for the caller's stream; positions not
    advanced."""
    pos0s = [c.pos for c in caches]

    def body(s: int, h: torch.Tensor) -> torch.Tensor:
        st = rt.stages[s]
        return segment_layers(model, h, caches, pos0s, bounds, *st.layers, device=st.device)

    h = _walk_stages(model, rt, torch.cat(list(pieces)), body)
    counters.bump("prime_split_chunks", len(pieces))
    counters.bump("prime_batch_splits")
    return h


# --- prime ---------------------------------------------------------------------------------------------


def prime_split(model, rt: PpRuntime, pieces: list[torch.Tensor], cache, all_logits: bool, hidden: bool = False):
    """Prime pieces through the split. With MEMRA_PRIME_PIPE (default on) and 2 stages and more than
    one piece, stage 1 of piece k runs while stage 0 runs piece k+1 (each stage only touches its own
    layers' state, and the boundary alternates its two slots). Returns what step.prime returns."""
    keep_all = all_logits or hidden  # else only each piece's last row is kept (long prompts)
    if rt.n_stages == 2 and rt.doors.prime_pipe and len(pieces) > 1:
        outs = _prime_pipelined(model, rt, pieces, cache, keep_all)
    else:
        outs = []
        for piece in pieces:
            h = walk_tokens(model, rt, piece, cache)
            cache.pos += piece.numel()
            counters.bump("prime_split_chunks")
            counters.bump("prime_pieces")
            outs.append(h if keep_all else h[-1:])
    with rt.stages[-1].scope():
        normed = [model.norm_out(h) for h in outs] if keep_all else []
        out = torch.cat([model.logits(n) for n in normed]) if all_logits else model.logits(model.norm_out(outs[-1][-1:]))[0]
        result = (out, torch.cat(normed)) if hidden else out
    rt.publish_to(rt.n_stages - 1, caller_stream(model))
    return result


def _prime_pipelined(model, rt: PpRuntime, pieces, cache, keep_all: bool) -> list[torch.Tensor]:
    """-> each piece's last-stage hidden [n, E] (pre-norm; only its last row unless keep_all), in order."""
    caller = caller_stream(model)
    rt.fence_stages_behind(caller)
    starts = []
    pos = cache.pos
    for p in pieces:
        starts.append(pos)
        pos += p.numel()
    st0, st1 = rt.stages

    base = rt.boundaries[0].step  # pipelined TX k lands in slot (base + k) % 2

    def stage0() -> None:
        for piece, p0 in zip(pieces, starts):
            with rt.section("prime_pipe_overlaps"), st0.scope():
                h = piece_layers(model, model.embed_tokens(piece.to(st0.device)), cache, p0, *st0.layers,
                                 device=st0.device)
                rt.tx(0, h, pipelined=True)

    def stage1() -> list[torch.Tensor]:
        outs = []
        for k, (piece, p0) in enumerate(zip(pieces, starts)):
            with rt.section("prime_pipe_overlaps"), st1.scope():
                h = rt.rx(0, (base + k) % 2)
                h = piece_layers(model, h, cache, p0, *st1.layers, device=st1.device)
                outs.append(h if keep_all else h[-1:])
        return outs

    _, outs = rt.run_concurrent([stage0, stage1])
    cache.pos = starts[-1] + pieces[-1].numel()
    counters.bump("prime_split_chunks", len(pieces))
    counters.bump("prime_pieces", len(pieces))
    return outs


# --- dual-active PP-2 -------------------------------------------------------------------------------


def check_dual(rt: PpRuntime, batch: int) -> bool:
    """Route a batched decode to the dual-wave body? Raises the seed's refusal (before any state
    moves) when the body is asked for on a placement it cannot run on."""
    mode = rt.doors.dual_pp
    host_bounce = any(bd.transport.kind is pf.BoundaryTransport.HOST_BOUNCE for bd in rt.boundaries) \
        or rt.doors.host_bounce
    if not pf.dual_pp_route(mode, batch, rt.n_stages, rt.doors.overlap, host_bounce):
        return False
    if mode is pf.DualPpMode.AUTO and not any(bd.transport.kind is pf.BoundaryTransport.PEER for bd in rt.boundaries):
        # Auto runs waves only in their validated regime, a peer boundary between two devices. On
        # one device the two waves share its bandwidth and each re-reads the stage's weights
        # (measured on the H200: B=16 PP-2 at -57% vs unsplit), so Auto stays serial there.
        return False
    refusal = pf.dual_pp_eligibility(rt.n_stages, rt.doors.overlap, host_bounce)
    if refusal is not None:
        raise pf.PipelineError(refusal)
    return True


def decode_waves(model, rt: PpRuntime, ids: torch.Tensor, caches, plan: str) -> torch.Tensor:
    """Two waves (ceil/floor halves) in flight: stage 0 runs wave B while stage 1 runs wave A.
    Each wave's rows see exactly the per-row arithmetic of the serial body."""
    mid = pf.dual_pp_wave_mid(len(caches))
    waves = [(ids[:mid], caches[:mid]), (ids[mid:], caches[mid:])]
    caller = caller_stream(model)
    rt.fence_stages_behind(caller)
    st0, st1 = rt.stages
    bd = rt.boundaries[0]
    base = bd.step
    slots = [(base + w) % 2 for w in range(2)]
    if not pf.dual_pp_slot_pair_ok(*slots):
        counters.bump("dual_pp_slot_collisions")
        raise pf.PipelineError("dual-wave decode refused: both waves would share one boundary slot")
    counters.bump("dual_pp_slot_pairs")
    for sl in slots:
        counters.bump(f"dual_pp_slot_uses_{sl}")

    timing = rt.doors.dual_pp_timing
    # Both stage threads start their first section only once both are running. Without it a busy host could
    # run stage 0 through both waves (its boundary has two slots) before stage 1's thread was even scheduled:
    # the same bits, but the waves not in flight together, and DUAL_PP_OVERLAPS not advanced. A stage that
    # never arrives breaks the barrier after the timeout: an error run_concurrent raises, never a hang.
    started = threading.Barrier(2, timeout=60.0)

    def stage0():
        started.wait()
        for w, (w_ids, w_caches) in enumerate(waves):
            with rt.section("dual_pp_overlaps"), st0.scope(), _timed(timing, st0, f"wave_{'ab'[w]}_stage0"):
                h = _stage_rows(model, rt, 0, model.embed_tokens(w_ids.to(st0.device)), w_caches, plan)
                rt.tx(0, h, pipelined=True)

    def stage1():
        outs = []
        started.wait()
        for w, (_, w_caches) in enumerate(waves):
            with rt.section("dual_pp_overlaps"), st1.scope(), _timed(timing, st1, f"wave_{'ab'[w]}_stage1"):
                h = _stage_rows(model, rt, 1, rt.rx(0, slots[w]), w_caches, plan)
                outs.append(rows_head(model, h, plan))
        return outs

    _, outs = rt.run_concurrent([stage0, stage1])
    rt.publish_to(1, caller)
    for c in caches:
        c.pos += 1
    counters.bump("pp_split_walks", 2)
    return torch.cat(outs)


@contextlib.contextmanager
def _timed(on: bool, stage, name: str):
    """MEMRA_DUAL_PP_TIMING=1: add this wave-stage section's time (ns) to its counters. On CUDA the
    section is measured to completion of its work on the stage stream (a sync per section, so
    timing runs are for diagnosis, not throughput)."""
    if not on:
        yield
        return
    t0 = time.perf_counter_ns()
    yield
    if stage.stream is not None:
        stage.stream.synchronize()
    counters.bump(f"dual_pp_stage_ns_{name}", time.perf_counter_ns() - t0)
    counters.bump(f"dual_pp_stage_samples_{name}")
