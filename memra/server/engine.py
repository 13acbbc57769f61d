"""The serving engine: one thread owns the model and runs the scheduler's plans, step after step.

    submit() --> [commands] --> engine thread: schedule -> swap out/in -> prefill chunks -> one batched
                                decode -> sample per request -> events to each request's sink

Every request's tokens are the ones offline `generate_tokens` produces for it, bit for bit:
- prefill chunks are cut at absolute multiples of 64 (the scheduler's alignment), which is the very
  set of forwards a one-shot prime runs (E5);
- a decode row is bit-identical to that sequence decoded alone (E1: decode_step_batch);
- each token is chosen by the offline rule: penalties over its own prompt and output, step counter =
  its output index, noise = f(seed, counter, id) (E3), so what else runs cannot change it;
- preemption swaps the KV blocks and the recurrent slot out to host memory and back, byte for byte
  (recomputing would re-run generated tokens through the chunked GDN form and change the bits).

All model work happens on the engine thread; other threads only enqueue commands and read sinks.

What the engine runs on is a backend: the model in this process (`_InProcess`: the shared KV pool and
recurrent slots, stage-owned under the in-process PP door, swapping to host), or a process-per-stage
pipeline in the model's place (`_ProcessPipeline`, over a memra.pp.dist.DistPipeline: each sequence is
a cache on every rank, no swapping, the pipeline shut down with the engine). See `_ProcessPipeline`
for what a pipeline does not do (preemption, MTP drafting) and how a failed rank ends requests.
"""

from __future__ import annotations

import contextlib
import queue
import secrets
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from memra.cache import BLOCK_SIZE, Cache, RecurrentPool, kv_pool
from memra.graphs import reserve_scratch
from memra.errors import ContextOverflowError, MemraError
from memra.pp.fence import PipelineError
from memra.sampling import SamplingParams, apply_penalties, sample
from memra.server.scheduler import QueueFull, Scheduler, SchedulerConfig
from memra.step import EXACT_PIECE
from memra.tokenizer import IncrementalDetokenizer, StopStringFilter

__all__ = ["Engine", "EngineConfig", "QueueFull", "TokenEvent", "Unavailable"]


class Unavailable(MemraError):
    """The engine takes no requests now: shutting down, stopped after an error, or a pipeline rank is
    gone (HTTP 503). The message says which, and what brings the server back."""


@dataclass(frozen=True)
class EngineConfig:
    max_batch: int = 32  # sequences running at once
    max_ctx: int = 4096  # prompt + generated tokens of one sequence
    token_budget: int = 2048  # tokens per engine step (decode rows + prefill chunk tokens)
    max_waiting: int = 256  # queued requests beyond which submit() raises QueueFull (HTTP 429)
    kv_blocks: int | None = None  # shared KV pool size; default: max_batch sequences of max_ctx (in-process only)

    def __post_init__(self) -> None:
        for name in ("max_batch", "max_ctx", "token_budget", "max_waiting"):
            if getattr(self, name) <= 0:
                raise MemraError(f"engine {name} must be positive, got {getattr(self, name)}")
        if self.token_budget < EXACT_PIECE:
            raise MemraError(f"token_budget must be at least {EXACT_PIECE} (one aligned prefill piece)")

    @property
    def blocks(self) -> int:
        return self.kv_blocks or self.max_batch * -(-self.max_ctx // BLOCK_SIZE)


@dataclass(frozen=True)
class TokenEvent:
    """One step of a request's output, in order. `text` may be empty (a partial character is held back)."""

    index: int  # which choice of the request (n > 1)
    text: str
    token_id: int | None
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    finish_reason: str | None = None  # "stop" | "length" | "abort" on the last event
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None


@dataclass
class _Seq:
    """Engine-side state of one sequence (one choice of one request)."""

    rid: str
    index: int
    prompt: list[int]
    params: SamplingParams
    logprobs: int | None
    eos: frozenset[int]
    sink: Callable[[TokenEvent], None]
    detok: IncrementalDetokenizer | None
    stops: StopStringFilter
    arrival: float = field(default_factory=time.perf_counter)
    out: list[int] = field(default_factory=list)
    cache: Cache | None = None
    swapped: dict | None = None  # host copies while preempted
    last_token_at: float | None = None
    done: bool = False


# --- what the engine runs on ------------------------------------------------------------------------------


class _InProcess:
    """The model in this process: the shared KV pool and recurrent slots the scheduler's counts stand
    for (stage-owned when the in-process PP door is open), and preemption by swapping to host memory."""

    preemption = True

    def __init__(self, model, cfg: EngineConfig):
        from memra.pp.walk import active_runtime

        self.model = model
        mcfg = model.cfg
        self.rt = active_runtime(model)  # stage-owned pools when the PP door is open
        layer_devices = self.rt.layer_devices() if self.rt is not None else None
        # One block and one slot beyond what the scheduler hands out: the CUDA graphs' inert padding rows.
        self.kv = kv_pool(mcfg, cfg.blocks + 1, model.dtype, model.device, layer_devices)
        self.rec = (RecurrentPool(mcfg, cfg.max_batch + 1, model.dtype, model.device, layer_devices)
                    if mcfg.gdn_layers else None)
        reserve_scratch(model, self.kv, self.rec)
        self.blocks = cfg.blocks
        self.slots = cfg.max_batch if self.rec is not None else None

    def new_cache(self, max_ctx: int) -> Cache:
        slot = self.rec.allocate() if self.rec is not None else None
        return Cache(kv=self.kv, rec=self.rec, max_ctx=max_ctx, slot=slot)

    def scratch_cache(self, max_ctx: int):
        """A sequence outside the shared pools (warm-up)."""
        return (self.rt.new_cache if self.rt is not None else self.model.new_cache)(max_ctx)

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
        c.blocks = self.kv.allocate(saved["n_blocks"])
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
        pass


class _ProcessPipeline:
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
    rt = None

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

    scratch_cache = new_cache

    def before_step(self) -> None:
        pass

    def swap_out(self, *_) -> dict:
        raise PipelineError("preemption is off for a process pipeline (its scheduler never plans a swap); "
                            "this is a bug in the engine's sizing")

    swap_in = swap_out  # never reached either: nothing is ever swapped out

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


def _backend(model, cfg: EngineConfig):
    from memra.pp.dist_driver import DistPipeline

    return _ProcessPipeline(model, cfg) if isinstance(model, DistPipeline) else _InProcess(model, cfg)


class Engine:
    """Owns the model (or a process pipeline in its place), its caches, the scheduler and the engine thread."""

    def __init__(self, model, cfg: EngineConfig = EngineConfig(), metrics=None):
        self.model, self.cfg, self.metrics = model, cfg, metrics
        self.backend = _backend(model, cfg)
        self.rt = self.backend.rt
        self.scheduler = Scheduler(SchedulerConfig(
            max_running=cfg.max_batch, token_budget=cfg.token_budget, prefill_align=EXACT_PIECE,
            max_waiting=cfg.max_waiting, block_size=BLOCK_SIZE, total_blocks=self.backend.blocks,
            total_slots=self.backend.slots, preemption=self.backend.preemption))
        self.seqs: dict[str, _Seq] = {}
        self._commands: queue.Queue = queue.Queue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._accepting = True
        self._lock = threading.Lock()  # submit() vs the scheduler's queue bound
        self._next = 0
        self.steps = 0
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None

    # --- the caller's side (any thread) ---
    def check_request(self, prompt: list[int], params: SamplingParams) -> None:
        """Every refusal a request can get before it is queued (HTTP 400)."""
        if not prompt:
            raise MemraError("the prompt is empty")
        vocab = self.model.cfg.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise MemraError(f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
        for tok, _ in params.logit_bias:
            if tok >= vocab:
                raise MemraError(f"logit_bias names token {tok}, outside the vocabulary (0..{vocab - 1})")
        limit = min(self.cfg.max_ctx, self.model.cfg.max_position)
        if len(prompt) + params.max_tokens > limit:
            raise ContextOverflowError(
                f"this model's maximum context length is {limit} tokens; the request needs {len(prompt)} prompt "
                f"+ {params.max_tokens} completion tokens = {len(prompt) + params.max_tokens}; shorten the prompt "
                f"or lower max_tokens")

    def submit(self, prompt: list[int], params: SamplingParams, sink: Callable[[TokenEvent], None], n: int = 1,
               logprobs: int | None = None, eos_ids=()) -> list[str]:
        """Queue a request with n choices (choice i samples with seed + i). -> the sequence ids.
        Raises MemraError (bad request), QueueFull (over the bound) or Unavailable (shutting down, stopped
        after an error, a pipeline rank gone)."""
        self.check_request(prompt, params)
        with self._lock:  # the engine thread's exit aborts what is queued under this lock: nothing slips past
            self._check_open()
            if self.scheduler.num_waiting() + self._commands.qsize() + n > self.cfg.max_waiting:
                raise QueueFull(f"{self.cfg.max_waiting} requests are already waiting; retry later")
            seqs = []
            base_seed = params.seed
            for i in range(n):
                p = params if n == 1 else _with_seed(params, base_seed + i)
                self._next += 1
                seqs.append(_Seq(f"seq-{self._next}", i, list(prompt), p, logprobs, frozenset(eos_ids), sink,
                                 IncrementalDetokenizer(self.model.tokenizer, skip_special=True)
                                 if self.model.tokenizer is not None else None, StopStringFilter(p.stop)))
            self._commands.put(("add", seqs))
        self._wake.set()
        return [s.rid for s in seqs]

    def _check_open(self) -> None:
        if not self._accepting:
            raise Unavailable("the server is shutting down")
        if self.error is not None:
            raise Unavailable(f"the engine has stopped after an error: {self.error}; restart the server")
        problem = self.backend.problem()
        if problem is not None:
            raise Unavailable(f"{problem}; restart the server")

    def health(self) -> str | None:
        """Why the engine cannot serve now (GET /health answers 503 with it), or None."""
        if self.error is not None:
            return f"engine stopped: {self.error}"
        return self.backend.problem()

    def cancel(self, rids: list[str]) -> None:
        """Stop these sequences at the next step boundary and free what they hold (client went away)."""
        self._commands.put(("cancel", list(rids)))
        self._wake.set()

    def warm_up(self) -> None:
        """Pay the first-use costs before the first request does: the decode plan's on-model check,
        kernel compilation, allocator growth (a scratch sequence, outside the shared pools)."""
        c = self.backend.scratch_cache(2 * EXACT_PIECE)
        try:
            logits = self.model.prime([(7 + 31 * i) % self.model.cfg.vocab_size for i in range(EXACT_PIECE + 2)], c)
            self.model.decode_step_batch([int(logits.argmax())], [c])
        finally:
            c.free()

    def start(self, warm_up: bool = True) -> "Engine":
        if warm_up:
            self.warm_up()
        self._thread = threading.Thread(target=self._run, name="memra-engine", daemon=True)
        self._thread.start()
        return self

    def shutdown(self, drain_timeout: float = 30.0) -> None:
        """Stop admitting; let in-flight requests finish (up to drain_timeout), then abort the rest.
        A process pipeline is shut down with the engine (its workers exit)."""
        self._accepting = False
        deadline = time.monotonic() + drain_timeout
        while self.busy() and time.monotonic() < deadline and self._thread is not None and self._thread.is_alive():
            time.sleep(0.02)
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.backend.close()

    def busy(self) -> bool:
        return bool(self.seqs) or not self._commands.empty()

    # --- the engine thread ---
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain_commands()
                plan = self.scheduler.schedule()
                if plan.empty:
                    self._publish_gauges(0)
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                self._step(plan)
        except MemraError as err:  # a failed pipeline rank (PipelineError names it): clear message, no traceback
            self.error = err
            print(f"memra engine: stopped: {err}", file=sys.stderr, flush=True)
            self._abort_all(f"engine error: {err}")
        except BaseException as err:  # a broken engine fails every request loudly, never hangs them
            self.error = err
            self._abort_all(f"engine error: {err}")
            raise
        finally:
            self._abort_all("the server shut down before this request finished")

    def _abort_all(self, error: str) -> None:
        """End every sequence, running or still queued, with `error`. Under the submit lock, so a request
        submitted while the thread exits is either aborted here or refused by submit(), never left waiting."""
        with self._lock:
            queued = []
            while True:
                try:
                    kind, arg = self._commands.get_nowait()
                except queue.Empty:
                    break
                queued += arg if kind == "add" else ()
            for s in queued + list(self.seqs.values()):
                with contextlib.suppress(MemraError):  # a free on a pipeline that just failed: it still ends
                    self._finish(s, "abort", error=error)

    def _drain_commands(self) -> None:
        while True:
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                for s in arg:
                    try:
                        self.scheduler.add(s.rid, len(s.prompt), s.params.max_tokens)
                    except (ValueError, QueueFull) as err:  # cannot fit this pool, or raced past the bound
                        s.done = True
                        s.sink(TokenEvent(s.index, "", None, finish_reason="abort", error=str(err)))
                        continue
                    self.seqs[s.rid] = s
            else:
                for rid in arg:
                    s = self.seqs.get(rid)
                    if s is not None:
                        self._finish(s, "abort")

    def _step(self, plan) -> None:
        self.backend.before_step()
        for rid in plan.swap_out:
            self._swap_out(self.seqs[rid])
        for rid in plan.swap_in:
            self._swap_in(self.seqs[rid])
        prefilled: dict[str, int] = {}
        sampled: list[str] = []
        for rid, start, n in plan.prefill:
            s = self.seqs[rid]
            if s.cache is None:
                s.cache = self._new_cache(s)
            assert s.cache.pos == start, f"{rid}: scheduler says prefill from {start}, cache is at {s.cache.pos}"
            logits = self.model.prime(s.prompt[start : start + n], s.cache)
            prefilled[rid] = n
            if self.metrics is not None:
                self.metrics.prompt_tokens.inc(n)
            if start + n == len(s.prompt):
                self._emit(s, logits)
                sampled.append(rid)
        if plan.decode:
            rows = [self.seqs[rid] for rid in plan.decode]
            logits = self.model.decode_step_batch([s.out[-1] for s in rows], [s.cache for s in rows])
            for s, row in zip(rows, logits):
                self._emit(s, row)
                sampled.append(s.rid)
        finished = [rid for rid in sampled if self.seqs[rid].done]
        self.scheduler.step_done(prefilled, sampled, finished)
        for rid in finished:
            self._release(self.seqs.pop(rid))
        self.steps += 1
        self._publish_gauges(len(plan.decode))

    def _new_cache(self, s: _Seq):
        return self.backend.new_cache(len(s.prompt) + s.params.max_tokens)

    def _emit(self, s: _Seq, logits: torch.Tensor) -> None:
        """Choose the next token exactly as offline generation does, and send it out."""
        p = s.params
        token = sample(apply_penalties(logits, p, s.prompt, s.out), p, ctr=len(s.out))
        s.out.append(token)
        now = time.perf_counter()
        if self.metrics is not None:
            self.metrics.generation_tokens.inc()
            if s.last_token_at is None:
                self.metrics.ttft.observe(now - s.arrival)
            else:
                self.metrics.inter_token.observe(now - s.last_token_at)
        s.last_token_at = now
        lp, top = None, ()
        if s.logprobs is not None:
            logp = torch.log_softmax(logits.float(), dim=-1)
            lp = float(logp[token])
            if s.logprobs > 0:
                vals, ids = torch.topk(logp, s.logprobs)
                top = tuple(zip(ids.tolist(), vals.tolist()))
        text = s.stops.push(s.detok.push(token)) if s.detok is not None else ""
        finish = None
        if token in s.eos:
            finish = "stop"
        elif s.stops.stopped:
            finish = "stop"
        elif len(s.out) >= p.max_tokens:
            finish = "length"
        if finish is not None and not s.stops.stopped and s.detok is not None:
            text += s.stops.push(s.detok.flush()) + s.stops.flush()
        s.sink(TokenEvent(s.index, text, token, lp, top, finish, len(s.prompt), len(s.out)))
        if finish is not None:
            s.done = True
            if self.metrics is not None:
                self.metrics.request_success.labels(finish_reason=finish).inc()

    def _finish(self, s: _Seq, reason: str, error: str | None = None) -> None:
        """End a sequence from outside the normal flow (cancel, shutdown, engine error)."""
        try:
            if s.rid in self.seqs:
                self.seqs.pop(s.rid)
                self.scheduler.cancel(s.rid)
                self._release(s)
        finally:  # the sequence ends even when freeing its cache fails (a pipeline rank just died)
            if not s.done:
                s.done = True
                s.sink(TokenEvent(s.index, "", None, finish_reason=reason, prompt_tokens=len(s.prompt),
                                  completion_tokens=len(s.out), error=error))

    def _release(self, s: _Seq) -> None:
        cache, s.cache, s.swapped = s.cache, None, None
        if cache is not None:
            cache.free()

    # --- preemption: swap to host and back, byte for byte (the backend's copies) ---
    def _swap_out(self, s: _Seq) -> None:
        if s.cache is None:  # preempted before its first prefill chunk: nothing to keep
            s.swapped = {"empty": True}
            return
        s.swapped = self.backend.swap_out(s.cache)
        s.cache = None
        if self.metrics is not None:
            self.metrics.preemptions.inc()

    def _swap_in(self, s: _Seq) -> None:
        saved, s.swapped = s.swapped, None
        if saved is None or saved.get("empty"):
            return
        s.cache = self.backend.swap_in(saved, len(s.prompt) + s.params.max_tokens)

    def _publish_gauges(self, batch: int) -> None:
        if self.metrics is None:
            return
        self.metrics.running.set(self.scheduler.num_running())
        self.metrics.waiting.set(self.scheduler.num_waiting())
        self.metrics.kv_usage.set(self.scheduler.kv_usage)
        if batch:
            self.metrics.batch_size.observe(batch)


def _with_seed(p: SamplingParams, seed: int) -> SamplingParams:
    import dataclasses

    return dataclasses.replace(p, seed=seed)


def fresh_seed() -> int:
    """A seed for a request that gave none (OpenAI: unseeded sampling is not reproducible)."""
    return secrets.randbits(62)
