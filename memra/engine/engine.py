"""The engine: the one loop that decides every next token, for the server, `memra generate`, `memra chat` and memra.LLM.

    submit() --> [commands] --> step(): schedule -> swap out/in -> the decode rows, fed the last step's tokens on
                                        the device, and the prefill chunks, in one forward where they may share it
                                        (memra.step.mixed_step) -> land the last step: its tokens to the host, ended
                                        sequences freed (memra.engine.inflight) -> every row's token chosen on the
                                        device, not waited for (memra.engine.sampler) -> the landed tokens' events to
                                        each request's sink, once this step is launched, so the readers' threads run
                                        while the GPU does

Every request gets the tokens the reference loop (memra.generate.generate_tokens) produces for it alone, bit for bit:
- prefill chunks are cut at absolute multiples of 64 (the scheduler's alignment), which is the very set of forwards a
  one-shot prime runs (E5); a step's chunks share forwards only where a token's bits cannot depend on its forward
  (memra.step.prime_batch; the gate's prime-batch arm);
- a decode row is bit-identical to that sequence decoded alone (E1: decode_step_batch);
- each token is chosen by the reference rule: penalties over its own prompt and output, step counter = its output
  index, noise = f(seed, counter, id) (E3), so what else runs cannot change it;
- preemption swaps the KV blocks and the recurrent slot out to host memory and back, byte for byte (recomputing would
  re-run generated tokens through the chunked GDN form and change the bits).

The engine does model work only. Text is the reader's business: an event carries token ids (and logprobs when asked);
the reader turns them into text, watches for stop strings (memra.tokenizer.TextStream) and ends a sequence that hit
one with cancel(rids, finish_reason="stop"). How a sequence ends, and the error kinds an abort carries:
memra.engine.types.TokenEvent. Backends (memra.engine.backends): the model in this process, or a process pipeline.
Scoring jobs (memra.engine.scoring) run whole between two steps. step() runs on the caller's thread (offline:
run_until_idle) or on the serving thread (start()).
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import sys
import threading
import time
import traceback
from typing import Callable

import torch

from memra.cache import BLOCK_SIZE
from memra.engine.backends import backend_for
from memra.engine.inflight import InFlight, decode_ids
from memra.engine.sampler import Picked, joined_rows, launch_pick
from memra.engine.scheduler import QueueFull, Scheduler, SchedulerConfig
from memra.engine.scoring import ScoreJobs
from memra.engine.seq_state import SeqState, queue_seqs
from memra.engine.speculation import speculation_for
from memra.engine.step_clock import StepClock
from memra.engine.weight_swap import WeightSwaps
from memra.engine.types import EngineConfig, TokenEvent, Unavailable, public_error, refuse_request
from memra.engine.warmup import warm_engine
from memra.errors import MemraError
from memra.sampling import SamplingParams, fresh_seed
from memra.step import EXACT_PIECE, mixed_step
from memra.upload import upload_values

__all__ = ["Engine", "EngineConfig", "QueueFull", "TokenEvent", "Unavailable"]

SHUTDOWN_MESSAGE = "the server shut down before this request finished"


class Engine:
    """Owns the model (or a process pipeline in its place), its caches, the scheduler and the engine thread."""

    def __init__(self, model, cfg: EngineConfig = EngineConfig(), metrics=None):
        self.model, self.cfg, self.metrics = model, cfg, metrics
        self.backend = backend_for(model, cfg)
        self.rt = self.backend.rt
        self.spec = speculation_for(model, cfg.speculative, self.backend)  # draft-and-verify, or plain decoding
        self.scheduler = Scheduler(SchedulerConfig(
            max_running=cfg.max_batch, token_budget=cfg.token_budget, prefill_align=EXACT_PIECE, max_waiting=cfg.max_waiting,
            block_size=BLOCK_SIZE, total_blocks=self.backend.blocks, total_slots=self.backend.slots, preemption=self.backend.preemption,
            max_pieces=self.backend.max_pieces, longest_first=cfg.longest_first(model.settings.admission_order),
            grouping=cfg.grouping(self.backend.mixes_graphed), prefill_budget=cfg.split_budget(self.backend.mixed_tokens)))
        self.seqs: dict[str, SeqState] = {}
        # A step's token events wait here until its forwards are launched: the readers (the server's text
        # and HTTP threads) then take the GIL while the GPU runs, not while the engine launches.
        self._outbox: list[tuple[SeqState, TokenEvent]] = []
        self._inflight: InFlight | None = None  # the last step's tokens, still on the device (memra.engine.inflight)
        self._commands: queue.Queue = queue.Queue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._accepting = True
        self._drain_deadline: float | None = None  # monotonic time at which in-flight work is aborted
        self._lock = threading.Lock()  # submit() vs the scheduler's queue bound
        self._next = 0
        self.steps = 0
        self.clock = StepClock(model.device)  # the host's and the GPU's time between steps (memra.engine.step_clock)
        self.step_mix = self.clock.mix  # steps by kind and their time: what `memra bench throughput` reports
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self.score_jobs = ScoreJobs(self)  # scoring runs between steps; .submit(job) queues one
        self.weight_swaps = WeightSwaps(self)  # weight updates between steps, no request on two versions

    @property
    def max_len(self) -> int:
        """The most tokens (prompt + completion) one sequence may hold."""
        return min(self.cfg.max_ctx, self.model.cfg.max_position)

    @property
    def cache_ctx(self) -> int:
        """Positions a sequence's cache may address: max_len, or what the pools hold if that is fewer."""
        return min(self.max_len, self.backend.blocks * BLOCK_SIZE)

    # --- the caller's side (any thread) ---
    def check_request(self, prompt: list[int], params: SamplingParams) -> None:
        """Every refusal a request can get before it is queued (HTTP 400): memra.engine.types.refuse_request."""
        refuse_request(prompt, params, self.max_len, self.model.cfg.vocab_size)

    def submit(self, prompt: list[int], params: SamplingParams, sink: Callable[[TokenEvent], None], n: int = 1,
               logprobs: int | None = None, eos_ids=(), speculative: bool = True) -> list[str]:
        """Queue a request with n choices (choice i samples with seed + i). -> the sequence ids, in choice
        order; speculative=False: plain decoding on an engine that speculates (same tokens). Raises MemraError
        (bad request), QueueFull (over the bound) or Unavailable (shutting down, stopped by an error, a rank gone)."""
        self.check_request(prompt, params)
        with self._lock:  # the engine thread's exit aborts what is queued under this lock: nothing slips past
            self._check_open()
            if self.scheduler.num_waiting() + self._commands.qsize() + n > self.cfg.max_waiting:
                raise QueueFull(f"{self.cfg.max_waiting} requests are already waiting; retry later")
            seed, seqs = fresh_seed() if params.seed is None else params.seed, []  # seed None: a fresh one
            for i in range(n):
                p = params if n == 1 and seed == params.seed else dataclasses.replace(params, seed=seed + i)
                self._next += 1
                seqs.append(SeqState(f"seq-{self._next}", i, list(prompt), p, logprobs, frozenset(eos_ids), sink))
                seqs[-1].start(self.spec if speculative else None, self.model)  # its drafter, its grammar
            self._commands.put(("add", seqs))
        self._wake.set()
        return [s.rid for s in seqs]

    def _check_open(self) -> None:
        if not self._accepting:
            raise Unavailable("the server is shutting down")
        if self.error is not None:
            raise Unavailable(f"the engine has stopped after an error: {public_error(self.error)}; restart the server")
        problem = self.backend.problem()
        if problem is not None:
            raise Unavailable(f"{problem}; restart the server")

    def health(self) -> str | None:
        """Why the engine cannot serve now (GET /health answers 503 with it), or None."""
        if self.error is not None:
            return f"engine stopped: {public_error(self.error)}"
        return self.backend.problem()

    def cancel(self, rids: list[str], finish_reason: str | None = None) -> None:
        """End these sequences at the next step boundary and free what they hold. Without a reason the
        reader went away; with one (e.g. "stop": its text reached a stop string) the sequence ended as
        the reader wanted and counts as a success."""
        self._commands.put(("cancel", (list(rids), finish_reason)))
        self._wake.set()

    def warm_up(self) -> None:
        """Pay the first-use costs before the first request does (memra.engine.warmup): kernel compilation
        for every prefill size class, the decode plan's check, and on a GPU every batch bucket's decode graph."""
        warm_engine(self)

    def start(self, warm_up: bool = True) -> "Engine":
        if warm_up:
            self.warm_up()
        self._thread = threading.Thread(target=self._run, name="memra-engine", daemon=True)
        self._thread.start()
        return self

    def begin_drain(self, timeout: float) -> None:
        """Stop admitting (submit raises Unavailable) and give in-flight requests `timeout` seconds to
        finish; the engine thread aborts whatever is left then, each with a "shutdown" error, so every
        reader can end its answer properly. Returns at once; a second call keeps the first deadline."""
        with self._lock:
            self._accepting = False
            if self._drain_deadline is None:
                self._drain_deadline = time.monotonic() + max(timeout, 0.0)
        self._wake.set()

    def shutdown(self, drain_timeout: float = 30.0) -> None:
        """Drain (begin_drain, unless it has begun), wait for the deadline's aborts to be sent, then stop
        the engine thread. A process pipeline is shut down with the engine (its workers exit)."""
        self.begin_drain(drain_timeout)
        give_up = self._drain_deadline + 30.0  # a step that never returns must not hold the process forever
        while self.busy() and self._thread is not None and self._thread.is_alive() and time.monotonic() < give_up:
            time.sleep(0.02)
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.backend.close()

    def busy(self) -> bool:
        return bool(self.seqs or self.score_jobs or self.weight_swaps or self._outbox or self._inflight) or not self._commands.empty()

    # --- stepping: the offline caller's thread, or the serving thread ---
    def step(self) -> bool:
        """Take the queued commands, then schedule and run one plan. -> whether anything ran or any event
        went out. Offline callers (memra.LLM, `memra generate`) call it in a loop; the serving thread
        between waits. A step's tokens land, and their events go out, during the next step."""
        self._drain_commands()
        self.weight_swaps.advance()  # an update waiting: admission held until it lands (memra.engine.weight_swap)
        if self._drain_deadline is not None and time.monotonic() >= self._drain_deadline and self.seqs:
            self._abort_all(SHUTDOWN_MESSAGE, "shutdown")
        self.score_jobs.run_ready()  # a job that ran alone sends no event: the idle wait after it is short
        plan = self.scheduler.schedule()
        if plan.empty:
            self.clock.idle()
            landed = self._land()
            self._publish_gauges(0)
            return self._send_events() or landed
        self._step(plan)
        return True

    def run_until_idle(self) -> None:
        """Step until nothing is queued or running (offline use, on the caller's thread)."""
        while self.busy():
            if not self.step() and self.seqs:
                raise MemraError("the engine has requests but can schedule none of them; this is a bug in its "
                                 "sizing (report it with the model and the request lengths)")

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if not self.step():
                    self._wake.wait(0.05)
                    self._wake.clear()
        except MemraError as err:  # a failed pipeline rank (PipelineError names it): clear message, no traceback
            self.error = err
            print(f"memra engine: stopped: {err}", file=sys.stderr, flush=True)
            self._abort_all(f"engine error: {err}", "engine")
        except BaseException as err:  # a bug: the log gets the traceback, each request a clear 500, none hangs
            self.error = err
            print("memra engine: stopped by an internal error:", file=sys.stderr, flush=True)
            traceback.print_exc()
            self._abort_all(f"engine error: {public_error(err)}", "engine")
        finally:
            self._abort_all(SHUTDOWN_MESSAGE, "shutdown")

    def _abort_all(self, error: str, kind: str) -> None:
        """End every sequence, running or still queued, with `error`. Under the submit lock, so a request
        submitted while the thread exits is either aborted here or refused by submit(), never left waiting."""
        with self._lock:
            self.score_jobs.fail_all(Unavailable(error))
            queued = []
            while True:
                try:
                    what, arg = self._commands.get_nowait()
                except queue.Empty:
                    break
                queued += arg if what == "add" else ()
            queued += self.weight_swaps.fail_all(Unavailable(error))
            for s in queued + list(self.seqs.values()):
                with contextlib.suppress(MemraError):  # a free on a pipeline that just failed: it still ends
                    self._finish(s, "abort", error=error, kind=kind)

    def _drain_commands(self) -> None:
        while True:
            try:
                what, arg = self._commands.get_nowait()
            except queue.Empty:  # then: how much of each request that could start is cached (memra.prefix)
                return self.backend.prefix.offer(self.scheduler, self.seqs)
            if what == "add":  # held while a weight update waits: they start on the new weights (weight_swap)
                self.weight_swaps.held.append(arg) if self.weight_swaps.pending else queue_seqs(self, arg)
            else:
                rids, reason = arg
                for rid in rids:
                    s = self.seqs.get(rid)
                    if s is not None:
                        self._finish(s, reason or "abort")

    def _step(self, plan) -> None:
        t0 = time.perf_counter()  # launch to launch: in steady state, the GPU's time per step
        self.backend.before_step()
        for rid in plan.swap_out:  # preemption: to host memory and back, byte for byte (SeqState.swap_out)
            if self.seqs[rid].swap_out(self.backend) and self.metrics is not None:
                self.metrics.preemptions.inc()
        prefilled: dict[str, int] = {}
        rows = [self.seqs[rid] for rid in plan.decode]
        chunks = [(self.seqs[rid], start, n) for rid, start, n in plan.prefill]
        for s, start, _ in chunks:  # before swap_in allocates blocks, which may evict cached pages these resume from
            s.cache = s.cache or (None if s.swapped else self._new_cache(s))
        for rid in plan.swap_in:
            self.seqs[rid].swap_in(self.backend, self.cache_ctx, self._new_cache)
        for s, start, _ in chunks:
            assert s.cache.pos == start, f"{s.rid}: scheduler says prefill from {start}, cache is at {s.cache.pos}"
        # speculating rows draft now and verify after the batch's tokens are launched (memra.engine.speculation)
        rows, chunks, verifying, alone = self.spec.before_step(rows, chunks, self.scheduler, self._inflight, self._land)
        self.clock.launching()
        # The decode rows, fed the last step's tokens on the device, and every prefill chunk: in one forward
        # where memra.step.mixes holds, else a graphed decode (it returns once launched, and the GPU runs it
        # while the host issues the prefill's kernels) and the chunks' shared forwards (memra.step.prime_batch).
        decoded, lasts = mixed_step(self.model, decode_ids(rows, self._inflight, self.model.device) if rows else None,
                                    [s.cache for s in rows], [s.prompt[start : start + n] for s, start, n in chunks],
                                    [s.cache for s, _, _ in chunks])
        ready: list[SeqState] = list(rows)  # sequences that get a token this step, in the order of `logits`' rows
        logits: list[torch.Tensor] = [decoded] if rows else []
        chunks, lasts = self.spec.prime_alone(chunks, lasts, alone)
        for (s, start, n), last in zip(chunks, lasts):
            prefilled[s.rid] = self.backend.prefix.record(s, start, n)  # n; the cache keeps the pages it primed
            if self.metrics is not None:
                self.metrics.prompt_tokens.inc(n)
            if start + n == len(s.prompt):  # its first token comes from the last prompt position (so do its forks')
                for t in self.backend.prefix.forks(s, self.scheduler, self._new_cache):  # memra.prefix
                    ready.append(t)
                    logits.append(last[None])
        # The last step's tokens, after this step's kernels are all queued: waiting for them first held a
        # prefilling step's launches back until the GPU had finished the step before (4.4 ms a mixed step
        # in an H200 profile). A sequence that ends as it lands keeps its blocks until here, which the
        # scheduler counted it as holding anyway. (The clock times the GPU's wait for it: the sampling follows.)
        self.clock.land(self._land)
        live = [i for i, s in enumerate(ready) if not s.done]  # a decode row whose sequence ended as it landed: dropped
        if live:
            batch = joined_rows(logits)  # a view where the read-out holds them in order already
            if len(live) < len(ready):
                batch = batch.index_select(0, upload_values(live, torch.long, batch.device))
            rows = [ready[i] for i in live]
            self._inflight = InFlight(rows, launch_pick(self.model.ops, batch, [s.row for s in rows]))
        extra = self.spec.verify(verifying, self._emit, self._end, self.metrics)
        self.clock.launched()
        for rid in self.scheduler.step_done(prefilled, [ready[i].rid for i in live] + list(extra), [], extra):
            if rid in self.seqs:  # its token in flight is its last (max_tokens): the scheduler freed its blocks
                self._release(self.seqs[rid])
        if not self.backend.device_tokens:  # a process pipeline's decode takes host ids: land now
            self._land()
        self._send_events()
        self.steps += 1
        kind, seconds = self.clock.done(plan, t0)
        self._publish_gauges(len(plan.decode), kind, seconds)

    def _new_cache(self, s: SeqState):
        # As wide as the longest: the decode graphs key on the table width. Blocks come as positions do.
        return self.backend.prefix.attach(s, self.backend.new_cache(self.cache_ctx), self.metrics)  # memra.prefix

    def _emit(self, s: SeqState, picked: Picked) -> None:
        """Record the token the sampler chose for `s` and send it out."""
        token = picked.token
        s.out.append(token)
        now = time.perf_counter()
        if self.metrics is not None:
            self.metrics.generation_tokens.inc()
            if s.last_token_at is None:
                self.metrics.ttft.observe(now - s.arrival)
            else:
                self.metrics.inter_token.observe(now - s.last_token_at)
        s.last_token_at = now
        finish = "stop" if token in s.eos else "length" if len(s.out) >= s.params.max_tokens else None
        self._outbox.append((s, TokenEvent(s.index, token, picked.logprob, picked.top, finish, len(s.prompt),
                                           len(s.out), cached_tokens=s.cached, rank=picked.rank,
                                           weights_version=getattr(self.model, "weights_version", 0))))
        if finish is not None:
            s.done = True
            if self.metrics is not None:
                self.metrics.request_success.labels(finished_reason=finish).inc()

    def _land(self) -> bool:
        """Wait for the step in flight and give each sequence its token (events to the outbox); end the
        sequences that finished with it. -> whether a step was in flight."""
        flight, self._inflight = self._inflight, None
        if flight is None:
            return False
        for s, picked in flight.fetch():
            if s.done or self.seqs.get(s.rid) is not s:  # cancelled while its token was in flight
                continue
            self._emit(s, picked)
            if s.done:
                self._end(s)
        return True

    def _end(self, s: SeqState) -> None:  # a sequence that finished with the token it was just given
        self.scheduler.cancel(s.rid)  # a no-op where max_tokens already ended it there
        self._release(self.seqs.pop(s.rid))

    def _send_events(self) -> bool:
        """Hand the waiting token events to their readers, in order. -> whether there were any."""
        out, self._outbox = self._outbox, []
        for s, ev in out:
            s.sink(ev)
        return bool(out)

    def _finish(self, s: SeqState, reason: str, error: str | None = None, kind: str | None = None) -> None:
        """End a sequence from outside the normal flow (cancel, shutdown, engine error)."""
        self._send_events()  # its tokens before its end
        try:
            if s.rid in self.seqs:
                self.seqs.pop(s.rid)
                self.scheduler.cancel(s.rid)
                self._release(s)
        finally:  # the sequence ends even when freeing its cache fails (a pipeline rank just died)
            if not s.done:
                s.done = True
                if self.metrics is not None:  # as vLLM counts them: an abort too (finished_reason="abort")
                    self.metrics.request_success.labels(finished_reason=reason).inc()
                s.sink(TokenEvent(s.index, None, finish_reason=reason, prompt_tokens=len(s.prompt),
                                  completion_tokens=len(s.out), error=error, error_kind=kind if error else None))

    def _release(self, s: SeqState) -> None:
        cache, s.cache, s.swapped = s.cache, None, None
        if cache is not None:
            cache.free()

    def _publish_gauges(self, batch: int, kind: str | None = None, seconds: float = 0.0) -> None:
        if self.metrics is not None:
            self.metrics.publish(self.scheduler, batch, kind, seconds)
