"""The driver of a process-per-stage pipeline (rank 0): DistPipeline and its sequence handles.

DistPipeline offers the model's step API (new_cache, prime, decode_step, decode_step_batch[_sampled],
decode_step_t) over the pipeline, through memra.step's front with itself as the executor
(memra.runner.executor's protocol): rank 0 runs stage 0 itself (embedding + its layers, through the
same stage bodies as every rank, memra.pp.dist_stage), sends each command with its boundary payload
down the chain (memra.pp.dist_wire) and waits, bounded by MEMRA_PP_DIST_TIMEOUT_S, for the last
stage's reply. Every refusal happens before any rank moves (the front's checks, then the preflight's). Any transport failure or a rank's
ERROR makes the call raise PipelineError and marks the pipeline down: later calls refuse until it is
shut down and started again (a half-advanced pipeline cannot be trusted). How pipelines are started:
memra.pp.dist.
"""

from __future__ import annotations

import collections
import os
import threading
import weakref

import torch

from memra import counters, step
from memra.cache import Cache
from memra.errors import MemraError
from memra.pp import fence as pf
from memra.pp.dist_launch import DistConfig, LocalWorkers, leave_group
from memra.pp.dist_stage import PLANS, StageState
from memra.pp.dist_wire import Flag, Link, Message, Op
from memra.pp.dist_worker import REPLY, STAT_WORDS, comm_device, links_for
from memra.runner.bodies import verify_layers
from memra.state_trail import StateTrail

PipelineError = pf.PipelineError
STAT_NAMES = ("rank", "messages", "rows", "pieces", "verifies", "canaries", "sequences", "bytes")


class DistCache:
    """Rank 0's handle on one sequence of the pipeline: its id (every rank keys its caches by it), the
    stage-0 cache `local` (rank 0's own layers), and the position every rank mirrors."""

    def __init__(self, pipe: DistPipeline, seq: int, local: Cache):
        self.pipe, self.seq, self.local = pipe, seq, local
        self.last_logits_dev: torch.Tensor | None = None  # lean sampling parks device logits here
        # A handle dropped without free() (the generate loop just lets its cache go) must not leak the
        # sequence on every rank. The finalizer only queues the id (it may run inside any call, on any
        # thread); the driver frees queued sequences at its next command, under its lock.
        self._finalizer = weakref.finalize(self, pipe._orphans.append, seq)

    @property
    def pos(self) -> int:
        return self.local.pos

    @property
    def max_ctx(self) -> int:
        return self.local.max_ctx

    def reserve(self, n_tokens: int) -> None:
        self.local.reserve(n_tokens)  # every rank's cache has the same max_ctx: rank 0's refusal is theirs

    def drop_out_of_window(self) -> int:
        """A sliding window's blocks are not given back across processes (the other ranks would need a
        command for it): every rank keeps them, which changes no value. -> 0."""
        return 0

    def rollback(self, pos0: int, keep: int, trail: StateTrail) -> None:
        """After a verify of T tokens from pos0 (recorded with `trail`): keep the first `keep`, on every rank."""
        self.pipe._rollback(self, pos0, keep, trail)

    def snapshot(self):
        raise PipelineError("cache snapshots are not wired across processes; speculative decoding rolls back "
                            "through the verify trail (the default)")

    def restore(self, snap) -> None:
        self.snapshot()

    def free(self) -> None:
        self._finalizer.detach()
        self.pipe._free(self)

    def __repr__(self) -> str:
        return f"DistCache(seq={self.seq}, pos={self.pos}, max_ctx={self.max_ctx})"


class DistPipeline:
    """The driver: the model's step API (new_cache, prime, decode_step, decode_step_batch[_sampled],
    decode_step_t) over a process-per-stage pipeline. One call at a time (a lock serialises callers)."""

    def __init__(self, model, cfg: DistConfig, fence: pf.StageFence, workers: LocalWorkers | None = None):
        self.model, self.dist_cfg, self.fence, self.workers = model, cfg, fence, workers
        self.stage = StageState(model, fence, 0)
        self.first_stop = fence.ranges[0][1]  # stage 0 runs layers [0, first_stop)
        wire = comm_device(cfg, model.device)
        _, self.down = links_for(cfg, wire)  # rank 0 -> stage 1
        self.replies = Link(cfg.last, REPLY, wire, f"stage {cfg.last} -> rank 0", cfg.backend == "nccl")
        self.broken: str | None = None
        self.closed = False
        self.description = ""
        self.exit_codes: dict[int, int] = {}
        self._lock = threading.RLock()
        self._cmd = 0
        self._seq = 0
        self._canary = False
        self._orphans: collections.deque[int] = collections.deque()  # dropped handles' sequence ids

    # --- what the model offers, so callers can take a pipeline where they took a model ---
    @property
    def cfg(self):
        return self.model.cfg

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def settings(self):
        return self.model.settings

    @property
    def ops(self):
        return self.model.ops

    @property
    def tokenizer(self):
        return self.model.tokenizer

    @property
    def source(self) -> str:
        return self.model.source

    @property
    def mtp(self) -> list:
        """Refused, not empty: the checkpoint may well have an MTP block (the last rank holds it), but the
        drafter runs on rank 0 and is not wired across processes. An empty list would make callers say
        "this checkpoint has no MTP block", which is false."""
        raise PipelineError("the MTP drafter is not wired across processes (the MTP block lives on the last rank, "
                            "the drafter would run on rank 0): use speculative 'ngram' (--speculative ngram), or "
                            "plain decoding, or load the model in one process for MTP drafting")

    @property
    def n_stages(self) -> int:
        return self.fence.n_stages

    # --- plumbing ---
    def _check_up(self) -> None:
        if self.closed:
            raise PipelineError("this pipeline has been shut down; start a new one")
        if self.broken is not None:
            raise PipelineError(f"the pipeline is down ({self.broken}); shut it down and start a new one")
        while self._orphans:  # sequences whose handles were dropped without free()
            seq = self._orphans.popleft()
            if seq in self.stage.caches:
                self.stage.free_seq(seq)
                self._post(Message(Op.FREE, seqs=(seq,)))

    def _fail(self, reason: str, err: BaseException | None = None):
        gone = self.workers.status(settle_s=0.5) if self.workers is not None else None
        self.broken = reason + (f" [workers: {gone}]" if gone else "")
        counters.bump("pp_dist_failures")
        raise PipelineError(f"pipeline failed: {self.broken}. The pipeline is down: shut it down and start a "
                            "new one") from err

    def _next_cmd(self) -> int:
        self._cmd += 1
        return self._cmd

    def _send(self, msg: Message) -> None:
        try:
            self.down.send(msg, self.dist_cfg.timeout_s)
        except PipelineError as err:
            self._fail(str(err), err)
        counters.bump("pp_dist_sends")

    def _reply(self, cmd: int, timeout_s: float | None = None) -> Message:
        try:
            msg = self.replies.recv(timeout_s or self.dist_cfg.timeout_s)
        except PipelineError as err:
            self._fail(str(err), err)
        if msg.op is Op.ERROR:
            self._fail(msg.text)
        if msg.op is not Op.REPLY or msg.cmd != cmd:
            self._fail(f"protocol: expected the reply to command {cmd}, got {msg.op.name} for command {msg.cmd}")
        counters.bump("pp_dist_replies")
        return msg

    def _call(self, msg: Message, timeout_s: float | None = None) -> Message:
        cmd = self._next_cmd()
        self._send(msg.but(cmd=cmd))
        return self._reply(cmd, timeout_s)

    def _post(self, msg: Message) -> None:
        """A command with no reply on success (NEW, FREE, ROLLBACK): a failure comes back in place of
        the next command's reply."""
        self._send(msg.but(cmd=self._next_cmd()))

    def _mine(self, cache) -> DistCache:
        if not isinstance(cache, DistCache) or cache.pipe is not self:
            raise MemraError(f"{cache!r} is not a cache of this pipeline; make it with pipeline.new_cache()")
        if cache.seq not in self.stage.caches:
            raise MemraError(f"sequence {cache.seq} has been freed")
        return cache

    def arm_canary(self) -> None:
        """Negative control for the gate: the next decode's boundary payload gets one byte flipped by the
        stage that receives it (a real corruption on the real path, which the gate must catch)."""
        self._canary = True

    def _free(self, cache: DistCache) -> None:
        with self._lock:
            if self.closed or cache.seq not in self.stage.caches:
                return
            self.stage.free_seq(cache.seq)
            if self.broken is None:
                self._post(Message(Op.FREE, seqs=(cache.seq,)))

    def _rollback(self, cache: DistCache, pos0: int, keep: int, trail: StateTrail) -> None:
        with self._lock:
            self._check_up()
            cache.local.rollback(pos0, keep, trail)  # refuses a bad keep before any rank moves
            self._post(Message(Op.ROLLBACK, seqs=(cache.seq,), args=(pos0, keep)))
            cache.last_logits_dev = None

    # --- the step API: memra.step's front (the same checks, cuts, plans and counters as in one process),
    # with this pipeline as its executor ---
    def new_cache(self, max_ctx: int) -> DistCache:
        """A sequence on every rank, each holding its own layers' KV and recurrent state."""
        return step.new_cache(self, max_ctx)

    def prime(self, ids, cache: DistCache, all_logits: bool = False, chunk_size: int | None = None,
              hidden: bool = False):
        """Prompt tokens through every stage, in memra.step.prime's pieces; stage 0 runs piece k+1 while
        the next stages run piece k. -> the last position's logits [V] (or [T, V] with all_logits), fp32."""
        if hidden:
            raise PipelineError("prime(hidden=True) (the MTP drafter's seed) is not wired across processes")
        return step.prime(self, ids, cache, all_logits=all_logits, chunk_size=chunk_size)

    def prime_batch(self, prompts, caches, chunk_size: int | None = None) -> list[torch.Tensor]:
        """Several prompts, each primed on its own: the wire carries one sequence's pieces per command."""
        return step.prime_batch(self, prompts, caches, chunk_size=chunk_size)

    def decode_step(self, token: int, cache: DistCache) -> torch.Tensor:
        """Feed one generated token; -> next-token logits [V] fp32."""
        return step.decode_step(self, token, cache)

    def decode_step_batch(self, tokens, caches) -> torch.Tensor:
        """One decode step for B sequences at their own positions. -> logits [B, V] fp32; row i is
        bit-identical to the single-process model's decode of that sequence (E1 + E2)."""
        return step.decode_step_batch(self, tokens, caches)

    def decode_step_batch_sampled(self, tokens, caches, samp, lean: bool = False):
        """decode_step_batch, then each device row's next token chosen on rank 0 (memra.step's contract)."""
        return step.decode_step_batch_sampled(self, tokens, caches, samp, lean=lean)

    def decode_step_t(self, chunk, pos0: int, cache: DistCache, trail: StateTrail | None = None):
        """The verify forward of T = K+1 tokens at pos0 across the stages (memra.step.decode_step_t's
        contract). With `trail`, every rank records its GDN states per column, so
        cache.rollback(pos0, keep, trail) can drop a rejected suffix everywhere."""
        return step.decode_step_t(self, chunk, pos0, cache, trail=trail)

    def restore(self, cache, snap) -> None:
        raise PipelineError("cache snapshots are not wired across processes; roll back through the verify trail")

    # --- the executor protocol (memra.runner.executor): what memra.step asks of this placement ---
    @property
    def executor(self) -> DistPipeline:
        return self

    runtime = None  # no in-process stage runtime: the stages are processes
    batches_prime = False  # a PRIME command carries one sequence's piece
    mixes_steps = False  # a decode and a prefill are commands of their own

    @property
    def plan_verified(self) -> dict:
        """The decode plan's on-model checks, run on rank 0's full model at bring-up (memra.pp.dist)."""
        return self.model.plan_verified

    def open_cache(self, max_ctx: int) -> DistCache:
        with self._lock:
            self._check_up()
            self._seq += 1
            local = self.stage.new_seq(self._seq, max_ctx)
            self._post(Message(Op.NEW, seqs=(self._seq,), args=(max_ctx,)))
            return DistCache(self, self._seq, local)

    def check_plan(self, plan: str) -> str:
        if plan not in PLANS:
            raise MemraError(f"MEMRA_DECODE_PLAN={plan} has no stage split; use row or stacked with pipeline "
                             "parallelism")
        return plan

    def preflight(self, call: str, caches) -> None:
        with self._lock:
            self._check_up()
            for c in caches:
                self._mine(c)

    def run_prime(self, pieces, cache: DistCache, all_logits: bool, hidden: bool):
        with self._lock:
            self._check_up()
            cmd = self._next_cmd()
            for k, piece in enumerate(pieces):
                pos0 = cache.pos
                h = self.stage.piece(self.model.embed_tokens(piece), cache.seq, pos0, False, False)  # [n, E]
                flags = (Flag.LAST_PIECE if k == len(pieces) - 1 else Flag.NONE) | \
                    (Flag.ALL_LOGITS if all_logits else Flag.NONE)
                self._send(Message(Op.PRIME, cmd, flags, (cache.seq,), (pos0,), tensors=(h,)))
                counters.bump("pp_dist_prime_pieces")
            cache.last_logits_dev = None
            return self._reply(cmd).tensors[0].to(self.device)

    def run_decode(self, ids: torch.Tensor, caches, plan: str, batched: bool) -> torch.Tensor:
        with self._lock:
            self._check_up()
            seqs = tuple(c.seq for c in caches)
            positions = tuple(c.pos for c in caches)
            h = self.stage.rows(self.model.embed_tokens(ids), seqs, positions, plan)  # [B, E]; positions advance
            flags = Flag.CANARY if self._canary else Flag.NONE
            self._canary = False
            reply = self._call(Message(Op.DECODE, flags=flags, seqs=seqs, positions=positions,
                                       args=(PLANS[plan],), tensors=(h,)))
            for c in caches:
                c.last_logits_dev = None
            return reply.tensors[0].to(self.device)

    def run_verify(self, ids: torch.Tensor, cache: DistCache, plan: str, trail: StateTrail | None):
        with self._lock:
            self._check_up()
            pos0, local = cache.pos, cache.local
            # stage 0 records its GDN states into the caller's trail: DistCache.rollback hands it back
            h = verify_layers(self.model, self.model.embed_tokens(ids), local, pos0, plan, 0, self.first_stop,
                              trail=trail, device=self.device)  # [T, E]
            local.pos += ids.numel()
            reply = self._call(Message(Op.VERIFY, flags=Flag.TRAIL if trail is not None else Flag.NONE,
                                       seqs=(cache.seq,), positions=(pos0,), args=(PLANS[plan],), tensors=(h,)))
            cache.last_logits_dev = None
            logits, h_seed = reply.tensors
            return logits.to(self.device), h_seed.to(self.device)

    # --- inspection ---
    def stats(self) -> list[dict[str, int]]:
        """Every rank's counters (messages handled, rows, prime pieces, verifies, canaries, live sequences,
        link bytes); rank 0's first. Also the proof that the workers are alive and in step."""
        with self._lock:
            self._check_up()
            s = self.stage
            mine = dict(zip(STAT_NAMES, (0, self._cmd, s.counts["rows"], s.counts["pieces"], s.counts["verifies"],
                                         s.counts["canaries"], len(s.caches), self.down.bytes + self.replies.bytes)))
            words = self._call(Message(Op.STATS)).args
            return [mine] + [dict(zip(STAT_NAMES, words[i : i + STAT_WORDS])) for i in range(0, len(words), STAT_WORDS)]

    # --- bring-up and shutdown ---
    def _hello(self, fp: int) -> None:
        msg = Message(Op.HELLO, args=(fp, self.fence.n_stages, *self.fence.bounds))
        first = f"rank 0: stage 0, layers [0, {self.first_stop}), {self.device}, pid {os.getpid()} (driver)"
        self.description = first + "\n" + self._call(msg, self.dist_cfg.start_timeout_s).text

    def shutdown(self, timeout_s: float | None = None) -> dict[int, int]:
        """Orderly: SHUTDOWN travels down the chain, the last rank acknowledges, every rank leaves the
        process group and the workers exit 0. On a broken pipeline the workers are stopped instead.
        -> each local worker's exit code (empty under torchrun)."""
        with self._lock:
            if self.closed:
                return self.exit_codes
            wait = self.dist_cfg.timeout_s if timeout_s is None else timeout_s
            orderly = self.broken is None
            if orderly:
                try:
                    cmd = self._next_cmd()
                    self.down.send(Message(Op.SHUTDOWN, cmd), wait)
                    for _ in range(8):  # replies still owed to earlier commands come first
                        msg = self.replies.recv(wait)
                        if msg.cmd == cmd:
                            break
                    self.down.drain_all(wait)
                    self.replies.drain_all(wait)
                except PipelineError as err:
                    self.broken, orderly = f"shutdown: {err}", False
            leave_group()
            self.closed = True
            if self.workers is not None:
                self.exit_codes = self.workers.finish(wait if orderly else 0.5)
            return self.exit_codes

    close = shutdown

    def __enter__(self) -> DistPipeline:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
