"""`memra bench serve`: a load-test client for any OpenAI-compatible completions server.

It sends a seeded mix of requests (prompt lengths, max_tokens, streamed or not, some cancelled
mid-stream) at a fixed concurrency and accounts for every one of them in a ServeBenchReport
(memra.bench.serve_report): each request ends completed, cancelled, or with an error — a request that
ends as none of these was *lost*, and a stream that finishes twice (or keeps talking after its finish)
is *duplicated*. Both must be zero.

The checks that turn the run into a correctness test (each answer equals offline generation; the
server's counters moved by what the client saw) are in memra.bench.serve_checks; the command line in
memra.bench.command. This is a client of the server, not part of it: it imports nothing of memra's
server or engine.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import random
import sys
import threading
import time
from typing import Callable, Sequence

from memra import settings as memra_settings
from memra.bench.serve_report import RequestResult, ServeBenchConfig, ServeBenchReport
from memra.errors import MemraError


# Ordinary words for prompts: any model tokenizes them, and their length in words tracks their length
# in tokens closely enough to get a spread of short and long prompts.
DEFAULT_WORDS: tuple[str, ...] = (
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by", "on", "not",
    "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an", "had", "they", "you", "were",
    "their", "one", "all", "we", "can", "her", "has", "there", "been", "if", "more", "when", "will", "would",
    "who", "so", "no", "river", "mountain", "city", "light", "winter", "garden", "letter", "music", "window",
    "story", "machine", "ocean", "market", "king", "forest", "road", "silver", "morning", "bridge", "stone",
    "question", "answer", "number", "friend", "house", "paper", "voice", "night", "water", "fire", "iron",
)

MAX_CANCEL_AFTER = 5  # a cancelled stream is closed after 1..5 chunks


# ---------------------------------------------------------------------------------------------------
# The request mix
# ---------------------------------------------------------------------------------------------------

def make_prompts(cfg: ServeBenchConfig, words: Sequence[str]) -> list[tuple[str, int]]:
    """(prompt, max_tokens) per request: prompt lengths and max_tokens drawn uniformly from the config's
    ranges by a generator seeded with cfg.seed, so a run is repeatable."""
    if not words:
        raise MemraError("make_prompts needs a non-empty word list")
    rng = random.Random(cfg.seed)
    out = []
    for _ in range(cfg.requests):
        n = rng.randint(cfg.min_prompt_words, cfg.max_prompt_words)
        out.append((" ".join(rng.choices(words, k=n)), rng.randint(cfg.min_tokens, cfg.max_tokens)))
    return out


def _plan(cfg: ServeBenchConfig, prompts: list[tuple[str, int]]) -> list[RequestResult]:
    """Which requests stream and which are cancelled (after how many chunks). Exact counts, not coin
    flips, so a small run still has its share of each; a generator of its own, so changing a fraction
    does not change the prompts."""
    rng = random.Random(f"memra-bench-plan:{cfg.seed}")
    order = list(range(len(prompts)))
    rng.shuffle(order)
    n_stream = round(len(prompts) * cfg.stream_fraction)
    n_cancel = min(round(len(prompts) * cfg.cancel_fraction), n_stream)
    streamed, cancel_after = set(order[:n_stream]), {i: rng.randint(1, MAX_CANCEL_AFTER) for i in order[:n_cancel]}
    return [RequestResult(index=i, prompt=p, max_tokens=m, stream=i in streamed, cancel_after=cancel_after.get(i))
            for i, (p, m) in enumerate(prompts)]


# ---------------------------------------------------------------------------------------------------
# One request
# ---------------------------------------------------------------------------------------------------

class _Failed(Exception):
    """A response we can name the fault of (HTTP status, an error object, a malformed body)."""


def server_root(url: str) -> str:
    """The server root: OpenAI clients are often given `.../v1`; /metrics lives beside it, not under it."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def _take_chunk(res: RequestResult, chunk, t0: float) -> None:
    """Fold one streamed completion chunk into the result, noting protocol violations."""
    if not isinstance(chunk, dict):
        raise _Failed(f"malformed chunk: {str(chunk)[:120]}")
    if chunk.get("error") is not None:  # servers report a failure mid-stream as an error object
        raise _Failed(f"error in stream: {json.dumps(chunk['error'])[:200]}")
    if chunk.get("usage"):
        res.usage = chunk["usage"]
    choices = chunk.get("choices") or []  # the usage chunk has "choices": []
    if not isinstance(choices, list):
        raise _Failed(f"malformed chunk: choices is {type(choices).__name__}")
    if len(choices) > 1:
        res.anomalies.append(f"chunk {res.chunks} has {len(choices)} choices (asked for 1)")
    for c in choices:
        if not isinstance(c, dict):
            raise _Failed(f"malformed choice: {str(c)[:120]}")
        text, finish = c.get("text") or "", c.get("finish_reason")
        if text:
            if res.finish_reason is not None:
                res.anomalies.append(f"text after finish_reason {res.finish_reason!r}: {text[:40]!r}")
            if res.ttft_s is None:
                res.ttft_s = time.perf_counter() - t0
            res.text += text
            res.text_at.append(time.time())
        if finish is not None:
            if res.finish_reason is not None:
                res.anomalies.append(f"a second finish_reason {finish!r} after {res.finish_reason!r}")
            else:
                res.finish_reason = finish


async def _http_error(resp) -> _Failed:
    body = (await resp.aread()).decode("utf-8", errors="replace")
    return _Failed(f"HTTP {resp.status_code}: {body[:200]}")


async def _streamed(client, body: dict, res: RequestResult, t0: float) -> None:
    close_early = False
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        res.status = resp.status_code
        if resp.status_code >= 400:
            raise await _http_error(resp)
        async for line in resp.aiter_lines():
            # Each OpenAI event is one `data:` line; blank separators, `: comments` and other SSE fields
            # (event:, id:, retry:) carry nothing for us.
            if not line.startswith("data:"):
                continue
            payload = line[len("data:"):].strip()
            if payload == "[DONE]":
                break
            try:
                chunk = json.loads(payload)
            except ValueError:
                raise _Failed(f"malformed JSON in stream: {payload[:120]!r}") from None
            res.chunks += 1
            _take_chunk(res, chunk, t0)
            if res.cancel_after is not None and res.finish_reason is None and res.chunks >= res.cancel_after:
                close_early = True
                break
    # leaving the block above closed the response unread: the server sees the client disconnect
    res.cancelled = close_early


async def _plain(client, body: dict, res: RequestResult) -> None:
    resp = await client.post("/v1/completions", json=body)
    res.status = resp.status_code
    if resp.status_code >= 400:
        raise await _http_error(resp)
    try:
        obj = resp.json()
    except ValueError:
        raise _Failed(f"malformed JSON body: {resp.text[:120]!r}") from None
    res.chunks = 1
    choices = obj.get("choices") if isinstance(obj, dict) else None
    if not isinstance(choices, list):
        raise _Failed(f"malformed body (no choices list): {resp.text[:120]!r}")
    if len(choices) != 1:
        res.anomalies.append(f"body has {len(choices)} choices (asked for 1)")
    if choices:
        c = choices[0]
        if not isinstance(c, dict):
            raise _Failed(f"malformed choice: {str(c)[:120]}")
        res.text, res.finish_reason = c.get("text") or "", c.get("finish_reason")
    res.usage = obj.get("usage") or None


async def _one(client, model: str, res: RequestResult, timeout_s: float) -> RequestResult:
    body = {"model": model, "prompt": res.prompt, "max_tokens": res.max_tokens, "temperature": 0, "stream": res.stream}
    if res.stream:
        body["stream_options"] = {"include_usage": True}
    t0, res.sent_at = time.perf_counter(), time.time()
    try:
        async with asyncio.timeout(timeout_s):
            if res.stream:
                await _streamed(client, body, res, t0)
            else:
                await _plain(client, body, res)
    except TimeoutError:
        res.error = f"timed out after {timeout_s:g} s"
    except _Failed as e:
        res.error = str(e)
    except Exception as e:  # connection refused/reset, a protocol error: recorded, the run goes on
        res.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    res.latency_s, res.ended_at = time.perf_counter() - t0, time.time()
    return res


def _progress_bar(total: int):
    """A tqdm bar on an interactive terminal only: in CI or a log file it is noise."""
    if not memra_settings.show_progress():
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="bench", unit="req", file=sys.stderr)


async def run_serve_bench(url: str, model: str, cfg: ServeBenchConfig, api_key: str | None = None,
                          progress: bool = False, words: Sequence[str] = DEFAULT_WORDS) -> ServeBenchReport:
    """Send cfg.requests requests, at most cfg.concurrency at a time, from cfg.client_processes processes;
    every failure is recorded in its RequestResult, none is raised."""
    plan = _plan(cfg, make_prompts(cfg, words))
    bar = _progress_bar(len(plan)) if progress else None
    try:
        if cfg.client_processes == 1:
            t0 = time.perf_counter()
            await _send_all(url, model, plan, cfg.concurrency, cfg.timeout_s, api_key, bar.update if bar else None)
            wall = time.perf_counter() - t0
        else:  # the wait for the processes runs off this event loop
            wall = await asyncio.get_running_loop().run_in_executor(None, _send_from_processes, url, model, plan,
                                                                    cfg, api_key, bar)
    finally:
        if bar is not None:
            bar.close()
    return ServeBenchReport(plan, wall, cfg)


async def _send_all(url: str, model: str, plan: list[RequestResult], concurrency: int, timeout_s: float,
                    api_key: str | None, on_done: Callable[[], object] | None) -> None:
    """Every request of `plan`, at most `concurrency` at a time, on this event loop; fills the results."""
    import httpx

    sem = asyncio.Semaphore(concurrency)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async def send(res: RequestResult) -> RequestResult:
        async with sem:
            await _one(client, model, res, timeout_s)
        if on_done is not None:
            on_done()
        return res

    # trust_env=False: a proxy from the environment would put itself in the measurement
    async with httpx.AsyncClient(base_url=server_root(url), headers=headers, timeout=timeout_s, limits=limits,
                                 trust_env=False) as client:
        done = await asyncio.gather(*(send(r) for r in plan), return_exceptions=True)
    for res, outcome in zip(plan, done):
        if isinstance(outcome, BaseException):  # a bug of ours, still not a lost request
            res.error = f"client: {type(outcome).__name__}: {outcome}"


# ---------------------------------------------------------------------------------------------------
# Several client processes
# ---------------------------------------------------------------------------------------------------

PROCESS_START_TIMEOUT_S = 120.0  # every client process imported and ready, or the run is refused
STREAMS_PER_PROCESS = 16  # the automatic choice: a process per this many concurrent requests


def auto_client_processes(concurrency: int) -> int:
    """One process per STREAMS_PER_PROCESS concurrent requests, on at most half the machine's cores (the
    other half is the server's when it runs here)."""
    return max(1, min(-(-concurrency // STREAMS_PER_PROCESS), (os.cpu_count() or 2) // 2))


def _send_from_processes(url: str, model: str, plan: list[RequestResult], cfg: ServeBenchConfig,
                         api_key: str | None, bar) -> float:
    """Deal the plan round-robin to cfg.client_processes spawned processes, each with its share of the
    concurrency, released together; fill `plan` with their results. -> the wall time from the first
    process's start to the last one's end (wall clocks of one machine)."""
    ctx = multiprocessing.get_context("spawn")  # fork would copy this process's threads' locks mid-use
    n = cfg.client_processes
    start, finished = ctx.Barrier(n + 1), ctx.Value("i", 0)
    pipes, procs = [], []
    for i in range(n):
        share = cfg.concurrency // n + (i < cfg.concurrency % n)
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_client_process, name=f"memra-bench-client-{i}", daemon=True,
                           args=(send, start, finished, url, model, plan[i::n], share, cfg.timeout_s, api_key))
        proc.start()
        send.close()
        pipes.append(recv)
        procs.append(proc)
    try:
        try:
            start.wait(PROCESS_START_TIMEOUT_S)
        except threading.BrokenBarrierError:
            dead = [p.name for p in procs if not p.is_alive()]
            raise MemraError(f"the bench's client processes did not start ({', '.join(dead) or 'timed out'}); "
                             "run with --client-processes 1") from None
        outcomes, shown = [], 0
        for recv, proc in zip(pipes, procs):
            while not recv.poll(0.2):
                shown = _show(bar, finished.value, shown)
                if not proc.is_alive() and not recv.poll(0):
                    raise MemraError(f"bench client process {proc.name} exited with code {proc.exitcode} "
                                     "before reporting; run with --client-processes 1 to see why")
            outcomes.append(recv.recv())
        _show(bar, finished.value, shown)
    finally:
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
    by_index = {r.index: r for part, _, _ in outcomes for r in part}
    plan[:] = [by_index[r.index] for r in plan]
    return max(t1 for _, _, t1 in outcomes) - min(t0 for _, t0, _ in outcomes)


def _show(bar, finished: int, shown: int) -> int:
    if bar is not None and finished > shown:
        bar.update(finished - shown)
    return max(finished, shown)


def _client_process(conn, start, finished, url: str, model: str, part: list[RequestResult], concurrency: int,
                    timeout_s: float, api_key: str | None) -> None:
    """One client process: wait for the others, send its part, report (results, start, end)."""
    def bump() -> None:
        with finished.get_lock():
            finished.value += 1

    start.wait()
    t0 = time.time()
    asyncio.run(_send_all(url, model, part, concurrency, timeout_s, api_key, bump))
    conn.send((part, t0, time.time()))
    conn.close()
