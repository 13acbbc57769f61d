"""What the serving engine runs on: the model in this process, or a process-per-stage pipeline in
its place. Both give the engine the same few operations (new cache, swap out / in, health, close);
`backend_for` picks one when the engine is built.

`InProcess`: the shared KV pool and recurrent slots, stage-owned under the in-process PP door,
preemption by swapping to host memory. `ProcessPipeline`: a memra.pp.dist.DistPipeline; see its
docstring for what a pipeline does not do (preemption, MTP drafting) and how a failed rank ends requests.
"""

from __future__ import annotations

import torch

from memra.cache import BLOCK_SIZE, Cache
from memra.decode_plan import settle_plan
from memra.pools import ModelPools
from memra.errors import MemraError
from memra.graphs import BUCKETS, bucket_for, drop_graphs, full_width_pass, reserve_scratch
from memra.kernels.cuts import ATTN_SPLIT
from memra.mixed_graphs import PIECES, captures_mixed
from memra.pp.fence import PipelineError
from memra.prefix.policy import prefix_cache, snapshot_slots
from memra.prefix.serving import NoPrefixCache
from memra.engine.types import EngineConfig


class InProcess:
    """The model in this process: KV and recurrent pools of the engine's own, stage-owned when the
    in-process PP door is open, that the scheduler's counts stand for; preemption by swapping to host.

    The pools are sized by the model's KV budget (memra.cache.KvBudget: --kv-memory / --kv-fraction),
    and never beyond what the running set can use: max_batch sequences of max_ctx tokens (or
    `kv_blocks`). On a GPU they are reserved at start, so the captured decode graphs keep their
    addresses; on a CPU they grow as sequences need them. One block and one slot beyond what the
    scheduler hands out are the CUDA graphs' inert padding rows."""

    preemption = True
    device_tokens = True  # decode_step_batch takes the last step's tokens where they are, on the device

    def __init__(self, model, cfg: EngineConfig):
        self.model = model
        self.rt = model.executor.runtime  # stage-owned pools when the model was loaded with the PP door open
        layer_devices = self.rt.layer_devices() if self.rt is not None else None
        want = cfg.kv_blocks or cfg.max_batch * -(-cfg.max_ctx // BLOCK_SIZE)
        settle_plan(model)  # its check's caches come from the model's own pools: before these take the memory
        budget = model.kv_budget.bytes_on(model.device)
        self.snapshots = snapshot_slots(model, cfg, budget)  # the prefix cache's recurrent snapshots (memra.prefix)
        self.pools = ModelPools(model.cfg, model.dtype, model.device, budget, layer_devices,
                                max_slots=cfg.max_batch + 1 + self.snapshots, max_blocks=want + 1)
        self.kv, self.rec = self.pools.kv, self.pools.rec
        self.prefix = prefix_cache(model, self.kv, self.rec, cfg, self.snapshots)
        self.blocks = self.kv.max_blocks - 1
        if self.blocks < -(-cfg.max_ctx // BLOCK_SIZE):
            raise MemraError(f"the KV budget ({self.pools.budget_bytes / (1 << 30):.2f} GiB) holds {self.blocks * BLOCK_SIZE} "
                             f"tokens, less than one sequence of --max-ctx {cfg.max_ctx}; raise --kv-memory / "
                             "--kv-fraction or lower --max-ctx")
        if model.device.type == "cuda":
            self.pools.reserve_all()
            # only a captured graph's inert rows use the scratch (memra.graphs.graphable: CUDA only); on a CPU,
            # taking it would zero (make resident) a recurrent slot nothing reads: 18 MiB on Qwen3.5-0.8B
            reserve_scratch(model, self.kv, self.rec)
        self.slots = cfg.max_batch if self.rec is not None else None
        self.mixes_graphed = captures_mixed(model)  # a step that starts requests replays a graph (memra.mixed_graphs)
        self.mixed_tokens = model.settings.mixed_tokens if self.mixes_graphed else 0  # its largest prompt bucket
        self.max_pieces = PIECES - 1 if self.mixes_graphed else None  # prefill chunks a step: one entry pads

    def warm_graphs(self, max_batch: int, max_ctx: int) -> None:
        """Capture the decode graph of every batch bucket a step of up to max_batch rows can use, now,
        rather than on the first step that meets each bucket (a capture costs tens of steps), at both
        table widths a step can have (memra.graphs.step_blocks: rows within one attention split, then
        a row past it). Scratch sequences of one token; each batch size is the largest that lands in
        its bucket, up to max_batch. GPU only (graphs are a CUDA feature)."""
        if self.model.device.type != "cuda":
            return
        rows = min(max_batch, len(self.kv.free), self.slots or max_batch)
        top = bucket_for(rows) or rows
        sizes = sorted({min(b, rows) for b in BUCKETS if b <= top})
        caches = [self.new_cache(max_ctx) for _ in range(rows)]
        try:
            self.model.prime_batch([[1]] * rows, caches)
            for n in sizes:
                if caches[0].pos + 1 >= max_ctx:  # a short max_ctx (fewer positions than buckets): start them over
                    for c in caches:
                        c.reset()
                    self.model.prime_batch([[1]] * rows, caches)
                self.model.decode_step_batch([1] * n, caches[:n])
            if full_width_pass(max_ctx, len(sizes)):
                self.model.prime([1] * ATTN_SPLIT, caches[0])  # a row past one split: the graphs of the full width
                for n in sizes:
                    self.model.decode_step_batch([1] * n, caches[:n])
        finally:
            for c in caches:
                c.free()

    def describe(self) -> str:
        """One line for the server's log: what the pools may hold and hold now."""
        p = self.pools
        return (f"KV cache: {p.capacity_bytes / (1 << 30):.2f} GiB budgeted ({self.blocks * BLOCK_SIZE:,} tokens in "
                f"{self.blocks:,} blocks, {self.slots or 0} recurrent slots), {p.reserved_bytes / (1 << 30):.2f} GiB "
                f"held now{'' if self.model.device.type == 'cuda' else ', growing as sequences need it'}")

    def new_cache(self, max_ctx: int) -> Cache:
        slot = self.rec.allocate() if self.rec is not None else None
        return Cache(kv=self.kv, rec=self.rec, max_ctx=max_ctx, slot=slot)

    def before_step(self) -> None:
        if self.rt is not None:
            from memra.pp.probe import service_runtime_probe

            service_runtime_probe(self.rt, scheduler_idle=False)

    def swap_out(self, c: Cache) -> dict:
        """Host copies of the sequence's KV blocks and recurrent slot, byte for byte; frees the cache."""
        blocks = torch.tensor(c.blocks, dtype=torch.long)
        saved = {
            "pos": c.pos, "n_blocks": len(c.blocks),
            "k": {i: self.kv.k[i][blocks.to(self.kv.k[i].device)].cpu() for i in self.kv.layers},
            "v": {i: self.kv.v[i][blocks.to(self.kv.v[i].device)].cpu() for i in self.kv.layers},
            # copy=True: on a CPU model .cpu() would return a view of the slot, which the next sequence reuses
            "conv": {i: c.conv_state(i).to("cpu", copy=True) for i in (self.rec.layers if self.rec else ())},
            "ssm": {i: c.ssm_state(i).to("cpu", copy=True) for i in (self.rec.layers if self.rec else ())},
        }
        c.free()
        return saved

    def swap_in(self, saved: dict, max_ctx: int) -> Cache:
        c = self.new_cache(max_ctx)
        c.blocks += self.kv.allocate(saved["n_blocks"])
        c.pos = saved["pos"]
        blocks = torch.tensor(c.blocks, dtype=torch.long)
        for i in self.kv.layers:
            self.kv.k[i][blocks.to(self.kv.k[i].device)] = saved["k"][i].to(self.kv.k[i].device)
            self.kv.v[i][blocks.to(self.kv.v[i].device)] = saved["v"][i].to(self.kv.v[i].device)
        for i in saved["conv"]:
            c.conv_state(i).copy_(saved["conv"][i])
            c.ssm_state(i).copy_(saved["ssm"][i])
        return c

    def problem(self) -> str | None:
        return None

    def close(self) -> None:
        """Drop the model's captured steps over these pools and the pools themselves (memra.LLM.close)."""
        drop_graphs(self.model, self.kv, self.rec)
        self.prefix = NoPrefixCache()  # the prefix store holds the pools too (kv.reclaim)
        self.kv.reclaim = None
        self.pools = self.kv = self.rec = None


class ProcessPipeline:
    """A process-per-stage pipeline (memra.pp.dist.DistPipeline, rank 0's driver) in the model's place.

    - No shared pools, scratch or CUDA graphs here: every sequence is `pipe.new_cache(prompt + max_tokens)`,
      a cache of its own layers on every rank, freed on every rank when the sequence ends.
    - No preemption. Swapping would have to move every rank's state to host and back, which the wire
      does not carry; so the scheduler counts max_batch x ceil(max_ctx / BLOCK_SIZE) blocks — every
      admitted sequence fits for its whole life and no step ever needs a victim — and runs with
      preemption=False, which raises instead of planning a swap (fail closed). The pipeline's memory is
      bounded by that same product, on every rank. `kv_blocks` (a smaller pool that relies on swapping)
      is refused.
    - No speculative drafting: the engine never drafts (on any backend); the pipeline itself refuses the
      MTP drafter (its head runs on the last rank), so nothing can ask for it by accident.
    - A failed rank: the pipeline raises PipelineError naming the rank on the step that meets it (every
      wait is bounded by MEMRA_PP_DIST_TIMEOUT_S); the engine ends every request in flight with that
      error and refuses later ones (Unavailable, HTTP 503). A local worker found dead between requests is
      reported the same way before any work is queued. Only a restart brings the pipeline back.
    - close() (the engine's shutdown) shuts the pipeline down: SHUTDOWN travels down the chain and the
      workers exit 0 (a broken pipeline's workers are stopped instead).
    """

    preemption = False
    device_tokens = False
    mixes_graphed = False
    mixed_tokens = 0
    max_pieces = None
    rt = None
    prefix = NoPrefixCache()  # no shared pools: no prefix cache either (its ranks keep their own caches)

    def __init__(self, pipe, cfg: EngineConfig):
        if cfg.kv_blocks is not None:
            raise MemraError(f"kv_blocks={cfg.kv_blocks} sizes the in-process KV pool, which relies on swapping; a "
                             "process pipeline keeps each sequence on its ranks and never swaps. Leave kv_blocks unset "
                             "(max_batch x max_ctx bounds the pipeline's memory)")
        self.pipe = pipe
        self.blocks = cfg.max_batch * -(-cfg.max_ctx // BLOCK_SIZE)  # the worst case: nobody ever waits for blocks
        self.slots = None  # each sequence brings its own recurrent state on every rank

    def new_cache(self, max_ctx: int):
        return self.pipe.new_cache(max_ctx)

    def before_step(self) -> None:
        pass

    def swap_out(self, *_) -> dict:
        raise PipelineError("preemption is off for a process pipeline (its scheduler never plans a swap); "
                            "this is a bug in the engine's sizing")

    swap_in = swap_out  # never reached either: nothing is ever swapped out

    def warm_graphs(self, max_batch: int, max_ctx: int) -> None:
        pass  # a pipeline's walks are not graphed

    def describe(self) -> str:
        return "KV cache: each rank's own, for max_batch sequences of max_ctx tokens"

    def problem(self) -> str | None:
        """Why the pipeline cannot serve (a known failure, or a local worker that exited), or None."""
        if self.pipe.closed:
            return "the pipeline has been shut down"
        if self.pipe.broken is not None:
            return f"the pipeline is down: {self.pipe.broken}"
        gone = self.pipe.workers.exited() if self.pipe.workers is not None else None
        return f"a pipeline rank is gone ({gone})" if gone else None

    def close(self) -> None:
        self.pipe.shutdown()


def backend_for(model, cfg: EngineConfig):
    from memra.pp.dist_driver import DistPipeline

    return ProcessPipeline(model, cfg) if isinstance(model, DistPipeline) else InProcess(model, cfg)
