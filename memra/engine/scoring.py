"""Scoring a text: each token's logprob given the tokens before it, with the arithmetic that would have
produced it (promise E9, docs/EXACTNESS.md).

    ids [n], start s (optional) --> scores[i] for i in 0..n-1: the logprob of ids[i] (None for i = 0)

A logprob is of the raw logits (before temperature, penalties, top-k/p), log_softmax in fp32 over the
one row [V] - exactly what the sampler reports for a sampled token (memra.engine.sampler.launch_pick).

Where the logits come from:
- without `start`, the whole text is a prompt: it is primed in 64-aligned chunks with every position's
  logits (memra.step.prime(all_logits=True)); row i scores ids[i + 1]. E5 makes a row's bits the same
  whatever the chunking, and a prime does not depend on other sequences (E1/E6).
- with `start` = s, ids[:s] is the prompt a sequence was given and ids[s:] what it generated. Rows
  0..s-2 come from the prompt's prime as above. Row s-1, the logits the first generated token was drawn
  from, is the engine's: the head over the last prompt position alone (on a CPU a linear's bits depend
  on its row count, so the row of an all-positions head is not it). Rows s..n-2 are decode steps: the
  verify body (memra.step.decode_step_t), whose column j is bit-identical to decode_step (E4): attention
  row by row, GDN in its recurrent form. Priming the continuation as prompt text instead
  (`prefill_continuation`, the gate's canary) gives other bits: GDN's chunked form is another algorithm,
  and on a CPU a linear's rows depend on how many rows its forward has.

On a server a scoring job runs whole between two engine steps (ScoreJobs), on a cache from the engine's
pools that the scheduler's free blocks and slots cover, so it cannot take memory a running sequence was
promised; it waits for that room. Its cost is one prefill of the text (plus at most 64 tokens primed
again for the row s-1), so a long text delays the other sequences' next step by that much.
"""

from __future__ import annotations

import collections
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from memra import counters
from memra.cache import BLOCK_SIZE
from memra.errors import MemraError
from memra.engine.sampler import lone_row
from memra.engine.scheduler import QueueFull
from memra.kernels.cuts import TILE
from memra.sampling import MAX_LOGPROBS
from memra.step import decode_step_t, prime

SCORE_CHUNK = 4 * TILE  # tokens per prime / verify call: bounds the [T, V] logits held at once (64-aligned: E5)
BATCH_LOGITS = 1 << 25  # score_values_batch: the most logits (128 MiB of fp32) one batched verify holds


@dataclass(frozen=True)
class TokenScore:
    """One position's score: ids[i]'s logprob, its rank among the vocabulary (1 = the argmax), and the
    top n (token id, logprob) of the row it was scored from."""

    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class ScoreJob:
    ids: tuple[int, ...]
    start: int | None = None  # continuation_start: the first generated position
    top: int = 0  # top-n per position
    prefill_continuation: bool = False  # the canary: prime the continuation as prompt text (not decode's bits)

    def check(self, vocab: int, max_len: int, in_process: bool = True) -> None:
        if not in_process:  # a process pipeline (no preemption either) has no all-positions prime
            raise MemraError("scoring (echo with logprobs, prompt_logprobs) needs the model in this process")
        n = len(self.ids)
        if n == 0:
            raise MemraError("cannot score an empty text")
        if n > max_len:
            raise MemraError(f"the text to score has {n} tokens; this server holds at most {max_len} per sequence")
        if self.start is not None and not 1 <= self.start <= n:
            raise MemraError(f"continuation_start must be in 1..{n} (a token position of this text), got {self.start}")
        if not 0 <= self.top <= MAX_LOGPROBS:
            raise MemraError(f"top logprobs must be in 0..{MAX_LOGPROBS}, got {self.top}")
        if min(self.ids) < 0 or max(self.ids) >= vocab:
            raise MemraError(f"token ids must be in 0..{vocab - 1}")


def row_score(logits: torch.Tensor, token: int, top: int) -> TokenScore:
    """The sampler's numbers for one row [V]: log_softmax over the fp32 row (lone_row), the token's value."""
    logp = torch.log_softmax(lone_row(logits), dim=-1)
    lp = logp[token]
    rank = int((logp > lp).sum()) + 1
    tops = ()
    if top:
        vals, ids = torch.topk(logp, top)
        tops = tuple(zip(ids.tolist(), vals.double().tolist()))
    return TokenScore(float(lp.double()), rank, tops)


def row_values(logits: torch.Tensor, tokens: list[int]) -> list[float]:
    """Each row's logprob of its token (logits [T, V]): row_score's logprobs without its rank and top-n, and
    one copy to the host for the block rather than two a row (the trainer's values: memra.train.exact). Row by
    row, as the sampler's log_softmax runs over one row [V] (on a CPU torch splits a lone row's reduction)."""
    at = torch.tensor(tokens, dtype=torch.long).to(logits.device)  # [T]
    picked = [torch.log_softmax(lone_row(logits[j]), dim=-1).index_select(0, at[j : j + 1]) for j in range(len(tokens))]
    return torch.cat(picked).double().tolist() if picked else []


def score(model, job: ScoreJob, cache, values_only: bool = False) -> list[TokenScore | float | None]:
    """Every position's score (None for position 0), on `cache` (empty; left holding the text). values_only:
    each score is its logprob alone, a float (row_values)."""
    ids, n = list(job.ids), len(job.ids)
    s = n if job.start is None else job.start
    rows = _rows_fn(job, values_only)
    out = _score_prompt(model, ids, s, cache, rows)
    # rows s..n-2: the continuation's decode steps (verify columns), each scoring the next token
    for a in range(s, n - 1, SCORE_CHUNK):
        b = min(a + SCORE_CHUNK, n - 1)
        if job.prefill_continuation:  # the canary: the prompt arithmetic where decode's was used
            logits = prime(model, ids[a:b], cache, all_logits=True)
        else:
            logits, _ = decode_step_t(model, ids[a:b], a, cache)
            counters.bump("scored_decode_tokens", b - a)
        out += rows(logits, a + 1, b - a)
    counters.bump("scored_tokens", n - 1)
    assert len(out) == n
    return out


def score_values_batch(model, jobs: list[ScoreJob], caches) -> list[list[float | None]]:
    """score(values_only=True) of several texts (each job on its own empty cache), the continuations' decode
    steps of all of them in one batched verify forward a round (memra.verify_batch: every column has the bits
    of its own sequence's decode step, E4) rather than one forward a sequence: the same values, fewer
    forwards (the trainer's values: memra.train.exact). The prompts are primed one by one, as score does."""
    if any(job.prefill_continuation for job in jobs):
        raise MemraError("score_values_batch scores continuations as decode steps (no prefill_continuation canary)")
    from memra.verify_batch import decode_step_t_batch

    outs, todo = [], []  # todo: (job index, first row a, end n - 1) of each continuation still to verify
    for k, (job, cache) in enumerate(zip(jobs, caches)):
        ids, n = list(job.ids), len(job.ids)
        s = n if job.start is None else job.start
        outs.append(_score_prompt(model, ids, s, cache, _rows_fn(job, True)))
        if s < n - 1:
            todo.append((k, s, n - 1))
    # a round's rows: SCORE_CHUNK, or more where the vocabulary is small (at most BATCH_LOGITS fp32 logits held)
    budget = max(SCORE_CHUNK, BATCH_LOGITS // model.cfg.vocab_size)
    while todo:  # a round: each continuation's next columns, at most `budget` rows in all
        group, rows_left, rest = [], budget, []
        for k, a, end in todo:
            take = min(end - a, rows_left)
            if take <= 0:
                rest.append((k, a, end))
                continue
            group.append((k, a, a + take))
            rows_left -= take
            if a + take < end:
                rest.append((k, a + take, end))
        chunks = [list(jobs[k].ids[a:b]) for k, a, b in group]
        got = decode_step_t_batch(model, chunks, [caches[k] for k, _, _ in group], [None] * len(group))
        for (k, a, b), (logits, _) in zip(group, got):
            outs[k] += row_values(logits, list(jobs[k].ids[a + 1 : b + 1]))
            counters.bump("scored_decode_tokens", b - a)
        todo = rest
    for job, out in zip(jobs, outs):
        counters.bump("scored_tokens", len(job.ids) - 1)
        assert len(out) == len(job.ids)
    return outs


def _rows_fn(job: ScoreJob, values_only: bool):
    """rows(logits, first, count): the scores of ids[first .. first+count-1] from logits[:count]."""
    ids = job.ids

    def rows(logits, first: int, count: int) -> list:
        if values_only:
            return row_values(logits, list(ids[first : first + count]))
        return [row_score(logits[j], ids[first + j], job.top) for j in range(count)]

    return rows


def _score_prompt(model, ids: list[int], s: int, cache, rows) -> list:
    """[None] and the scores of rows 0..s-1 (row i scores ids[i + 1]; row s-1 only where a continuation
    follows), the cache left at position s. Rows 0..s-2 are the prompt's prime with every position's logits;
    where a continuation follows, row s-1 is the engine's own: the final piece (from the last 64-aligned cut)
    is primed once for its rows and once more, from a snapshot, for the head over its last position (once in
    all where the head's rows are alike at any row count: _head_rows_alike)."""
    n = len(ids)
    out: list = [None]
    cut = ((s - 1) // TILE) * TILE if s < n else s
    for a in range(0, cut, SCORE_CHUNK):
        out += _prime_rows(model, ids, a, min(a + SCORE_CHUNK, cut), cache, rows, s)
    if cut < s and _head_rows_alike(model):  # the one-row head's bits are the piece's last row's: one prime
        logits = prime(model, ids[cut:s], cache, all_logits=True)
        counters.bump("scored_prompt_tokens", s - cut)
        out += rows(logits, cut + 1, s - 1 - cut) + rows(logits[-1:], s, 1)
    elif cut < s:
        snap = cache.snapshot()
        out += _prime_rows(model, ids, cut, s, cache, rows, s)
        cache.restore(snap)
        out += rows(prime(model, ids[cut:s], cache)[None], s, 1)
    return out


def _head_rows_alike(model) -> bool:
    """Does the head give a row the same bits over one row as over a piece's rows? On a CPU whose rows decode
    stacked (memra.decode_plan.cpu_rows_invariant: C norms, row-invariant linears, verified on the model),
    without a soft cap (torch's tanh over the logits)."""
    from memra.decode_plan import decode_plan

    return (model.device.type == "cpu" and model.cfg.final_softcap is None and getattr(model, "blocks", None) is not None
            and model.settings.exact and decode_plan(model) == "stacked")


def _prime_rows(model, ids, a: int, b: int, cache, rows, limit: int) -> list:
    """Prime ids[a:b] (a on the 64-grid) with every position's logits [b-a, V] -> the scores (`rows`) of
    ids[a+1 .. min(b, limit-1)] (the prompt part: position limit on is scored elsewhere)."""
    logits = prime(model, ids[a:b], cache, all_logits=True)
    counters.bump("scored_prompt_tokens", b - a)
    return rows(logits, a + 1, min(b, limit - 1) - a)


class ScoreJobs:
    """An engine's queue of scoring jobs: each runs whole between two steps (on the engine's thread), when
    the scheduler's free blocks and slots cover its cache (module docstring). FIFO: a job that does not
    fit holds the ones behind it, so none is overtaken for ever."""

    def __init__(self, engine):
        self.engine = engine
        self._queue: collections.deque[tuple[ScoreJob, Future]] = collections.deque()

    def submit(self, job: ScoreJob) -> Future:
        """Queue `job` (any thread). -> a Future of its scores. Refusals as Engine.submit's: MemraError (a
        bad job), QueueFull (max_waiting jobs already queued), Unavailable (shutting down, stopped)."""
        e = self.engine
        job.check(e.model.cfg.vocab_size, e.cache_ctx, in_process=e.backend.preemption)
        with e._lock:  # as submit: the engine thread's exit fails what is queued under this lock
            e._check_open()
            if len(self._queue) >= e.cfg.max_waiting:
                raise QueueFull(f"{e.cfg.max_waiting} scoring jobs are already waiting; retry later")
            fut: Future = Future()
            self._queue.append((job, fut))
        e._wake.set()
        return fut

    def __len__(self) -> int:
        return len(self._queue)

    def run_ready(self) -> bool:
        """Run the queued jobs that fit now, in order (on the engine's thread). -> whether any ran."""
        e, ran = self.engine, False
        while self._queue:
            job, fut = self._queue[0]
            blocks = -(-len(job.ids) // BLOCK_SIZE)
            slots = e.scheduler.free_slots()
            if blocks > e.scheduler.free_blocks() or (slots is not None and slots < 1):
                return ran
            self._queue.popleft()
            ran = True
            if not fut.set_running_or_notify_cancel():
                continue
            cache = None
            try:
                cache = e.backend.new_cache(e.cache_ctx)  # as wide as every engine cache; blocks come as used
                fut.set_result(score(e.model, job, cache))
            except MemraError as err:
                fut.set_exception(err)
            finally:
                if cache is not None:
                    cache.free()
        return ran

    def fail_all(self, err: BaseException) -> None:
        while self._queue:
            _, fut = self._queue.popleft()
            if fut.set_running_or_notify_cancel():
                fut.set_exception(err)
