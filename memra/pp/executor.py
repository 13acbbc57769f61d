"""The in-process pipeline as an executor: built when the model is loaded, when the PP doors open it.

`build_pipeline(model)` reads the fence and placement from the model's settings, checks them (bad
door values: warn-and-off or PipelineError, as memra.pp.fence rules), shards the weights onto the
stages' devices and brings the boundaries up (the peer byte-integrity probe) — all at load, so no
step ever changes the placement. `PipelineExecutor` then routes each step body through the stage split
(memra.pp.walk) or, where a door asks for the unsplit body, through the unsplit executor over the same
placement, refused when that body would read remote weights.
"""

from __future__ import annotations

import torch

from memra.pp import fence as pf
from memra.pp.runtime import PpRuntime
from memra.pp.walk import caller_stream, check_dual, decode_waves, prime_split, walk_rows, walk_verify, walk_wave
from memra.runner.bodies import segment_bounds
from memra.runner.executor import UnsplitExecutor, advance_wave, wave_logits


def build_pipeline(model) -> PipelineExecutor | None:
    """The pipeline executor for the placement the model's doors describe, or None when the door is shut."""
    env = model.settings.pp_env  # the doors as the model was loaded with them
    if env.get("MEMRA_PP_STAGES") in (None, "", "0", "1"):
        return None
    doors = pf.PpDoors.from_env(env)
    fence = doors.fence(model.cfg.n_layers)
    if fence is None:
        return None
    cuda = model.device.type == "cuda"
    if doors.devices is not None and not cuda:
        raise pf.PipelineError(f"MEMRA_PP_DEVICES={doors.devices!r} names CUDA devices but the model is on "
                               f"{model.device}; unset it to run every stage on {model.device}")
    primary = (model.device.index or 0) if cuda else 0
    placement = pf.plan_placement(doors, primary, torch.cuda.device_count() if cuda else 1)
    if placement.n_stages != fence.n_stages:
        raise pf.PipelineError(f"MEMRA_PP_DEVICES places {placement.n_stages} stages but the fence has "
                               f"{fence.n_stages}; make MEMRA_PP_DEVICES, MEMRA_PP_STAGES and MEMRA_PP_SPLITS agree")
    if cuda:  # before anything moves: native peer transport needs access both ways between every pair
        pf.peer_capable_pairs(placement, torch.cuda.can_device_access_peer)
    from memra.pp.probe import bring_up
    from memra.pp.shard import shard_weights

    rt = PpRuntime(model, fence, placement, doors)
    if placement.shard:
        shard_weights(model, rt)
    bring_up(rt)
    return PipelineExecutor(model, rt)


class PipelineExecutor:
    """The stage split in this process: each stage on its device and stream, the residual handed
    across each boundary by its transport."""

    def __init__(self, model, rt: PpRuntime):
        self.model, self.runtime = model, rt
        self.unsplit = UnsplitExecutor(model)  # the bodies the doors may ask for instead of the split

    @property
    def n_stages(self) -> int:
        return self.runtime.n_stages

    def open_cache(self, max_ctx: int):
        return self.runtime.new_cache(max_ctx)  # each layer's state on the stage that owns it

    def check_plan(self, plan: str) -> str:
        if plan == "bucket":
            raise pf.PipelineError("MEMRA_DECODE_PLAN=bucket has no stage split; use row or stacked with "
                                   "pipeline parallelism")
        return plan

    def run_prime(self, pieces, cache, all_logits: bool, hidden: bool):
        # MEMRA_PRIME_PP=0 (the unsplit prime) is deliberately not refused on a sharded placement, unlike
        # the unsplit decode and verify: it is the prime gate's reference arm, and a 4096-token prime
        # amortises its remote weight reads (the reference system's rule, fence.prime_pp_on).
        if not self.runtime.doors.prime_pp:
            return self.unsplit.run_prime(pieces, cache, all_logits, hidden)
        return prime_split(self.model, self.runtime, list(pieces), cache, all_logits, hidden)

    def preflight(self, call: str, caches) -> None:
        """The refusals this placement owns, before any cache moves: the unsplit body a door asks for
        over remote weights, or the dual-wave body on a placement that cannot run it."""
        doors = self.runtime.doors
        if call == "decode_step_batch" and not doors.batch_pp:
            self.refuse_unsplit(call, "MEMRA_BATCH_PP=1 (the split batched body)")
        elif call == "decode_step_batch":
            check_dual(self.runtime, len(caches))
        elif call == "decode_step_t" and not doors.spec_pp:
            self.refuse_unsplit(call, "MEMRA_SPEC_PP=1 (the split verify)")

    batches_prime = True
    mixes_steps = False  # the stages walk a decode or a wave; a mixed forward is the unsplit executor's

    def run_prime_wave(self, pieces, caches, want) -> list:
        if not self.runtime.doors.prime_pp:
            return self.unsplit.run_prime_wave(pieces, caches, want)
        rt, bounds = self.runtime, segment_bounds(pieces)
        h = walk_wave(self.model, rt, pieces, caches, bounds)
        advance_wave(pieces, caches)
        with rt.stages[-1].scope():
            out = wave_logits(self.model, h, bounds, want)
        rt.publish_to(rt.n_stages - 1, caller_stream(self.model))
        return out

    def run_decode(self, ids: torch.Tensor, caches, plan: str, batched: bool) -> torch.Tensor:
        rt = self.runtime
        if batched and not rt.doors.batch_pp:  # the unsplit batched body over the pipeline's placement
            return self.unsplit.run_decode(ids, caches, plan, batched)
        if batched and check_dual(rt, len(caches)):
            return decode_waves(self.model, rt, ids, caches, plan)
        return walk_rows(self.model, rt, ids, caches, plan)

    def run_verify(self, ids: torch.Tensor, cache, plan: str, trail):
        if not self.runtime.doors.spec_pp:
            return self.unsplit.run_verify(ids, cache, plan, trail)
        out = walk_verify(self.model, self.runtime, ids, cache, plan, trail)
        cache.pos += ids.numel()
        return out

    def refuse_unsplit(self, path: str, alt: str) -> None:
        """The unsplit body over a sharded cross-device placement: refused unless overridden."""
        rt = self.runtime
        view = pf.UnsplitView(rt.placement.sharded_cross_device,
                              rt.latch.host_bounce or (rt.placement.host_bounce and rt.placement.sharded_cross_device),
                              rt.doors.allow_unsplit_batch)
        pf.refuse_unsplit_if_remote(path, alt, view)
