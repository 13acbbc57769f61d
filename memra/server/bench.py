"""`memra bench serve`: a load-test client for any OpenAI-compatible completions server.

It sends a seeded mix of requests (prompt lengths, max_tokens, streamed or not, some cancelled
mid-stream) at a fixed concurrency and accounts for every one of them: each request ends completed,
cancelled, or with an error — a request that ends as none of these was *lost*, and a stream that
finishes twice (or keeps talking after its finish) is *duplicated*. Both must be zero.

Two checks turn the run into a correctness test, not just a speed number:
- `check_against_offline`: each completed greedy answer equals what offline generation produces for
  the same prompt (memra's promise: serving under load changes no token);
- `check_metrics`: the server's Prometheus token and request counters moved by what the client saw.

The benchmark assumes it is the server's only client while it runs (the metric deltas are global).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

from memra import settings as memra_settings
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


@dataclass(frozen=True)
class ServeBenchConfig:
    requests: int = 200
    concurrency: int = 32
    cancel_fraction: float = 0.1  # this share of requests is closed mid-stream after 1..5 chunks
    min_prompt_words: int = 4
    max_prompt_words: int = 120
    min_tokens: int = 8
    max_tokens: int = 96
    stream_fraction: float = 0.8  # the rest are non-streaming
    seed: int = 0
    timeout_s: float = 600.0  # per request; one that takes longer counts as an error

    def __post_init__(self) -> None:
        if self.requests <= 0 or self.concurrency <= 0:
            raise MemraError(f"requests and concurrency must be positive, got {self.requests} and {self.concurrency}")
        for name in ("cancel_fraction", "stream_fraction"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise MemraError(f"{name} must be in [0, 1], got {getattr(self, name)!r}")
        if self.cancel_fraction > self.stream_fraction:
            # only a stream can be closed mid-answer
            raise MemraError(f"cancel_fraction ({self.cancel_fraction}) cannot exceed stream_fraction "
                             f"({self.stream_fraction}): only streamed requests can be cancelled")
        if not 1 <= self.min_prompt_words <= self.max_prompt_words:
            raise MemraError(f"need 1 <= min_prompt_words <= max_prompt_words, got "
                             f"{self.min_prompt_words}..{self.max_prompt_words}")
        if not 1 <= self.min_tokens <= self.max_tokens:
            raise MemraError(f"need 1 <= min_tokens <= max_tokens, got {self.min_tokens}..{self.max_tokens}")
        if not self.timeout_s > 0:
            raise MemraError(f"timeout_s must be positive, got {self.timeout_s!r}")


@dataclass
class RequestResult:
    index: int
    prompt: str
    max_tokens: int
    stream: bool
    cancel_after: int | None = None  # planned: close the stream after this many chunks (None = read to the end)
    cancelled: bool = False  # the client did close it before its finish_reason arrived
    text: str = ""
    finish_reason: str | None = None
    usage: dict | None = None
    ttft_s: float | None = None  # streaming only: to the first non-empty text chunk
    latency_s: float = 0.0
    error: str | None = None
    status: int | None = None  # HTTP status of the response, when one came
    chunks: int = 0  # SSE data chunks received ([DONE] not counted); a non-streamed body counts as 1
    anomalies: list[str] = field(default_factory=list)  # protocol violations: a second finish, text after it, ...

    @property
    def state(self) -> str:
        """completed | cancelled | error | lost — every request is exactly one of these."""
        if self.error is not None:
            return "error"
        if self.cancelled:
            return "cancelled"
        return "completed" if self.finish_reason is not None else "lost"


def _percentile(values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _usage_int(usage: dict | None, key: str) -> int:
    value = (usage or {}).get(key)
    return int(value) if isinstance(value, (int, float)) else 0


@dataclass
class ServeBenchReport:
    results: list[RequestResult]
    wall_s: float
    config: ServeBenchConfig | None = None

    def _in(self, state: str) -> list[RequestResult]:
        return [r for r in self.results if r.state == state]

    @property
    def completed(self) -> int:
        return len(self._in("completed"))

    @property
    def cancelled(self) -> int:
        return len(self._in("cancelled"))

    @property
    def errors(self) -> int:
        return len(self._in("error"))

    @property
    def lost(self) -> int:
        return len(self._in("lost"))

    @property
    def duplicated(self) -> int:
        return sum(1 for r in self.results if r.anomalies)

    @property
    def client_prompt_tokens(self) -> int:
        return sum(_usage_int(r.usage, "prompt_tokens") for r in self._in("completed"))

    @property
    def client_completion_tokens(self) -> int:
        return sum(_usage_int(r.usage, "completion_tokens") for r in self._in("completed"))

    @property
    def output_tokens_per_s(self) -> float:
        return self.client_completion_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def _ttfts(self) -> list[float]:
        # cancelled streams did see their first token, so their TTFT is as real as a completed one's
        return [r.ttft_s for r in self.results if r.ttft_s is not None and r.state in ("completed", "cancelled")]

    def _latencies(self) -> list[float]:
        return [r.latency_s for r in self._in("completed")]  # a cancelled request's latency is ours, not the server's

    @property
    def ttft_p50(self) -> float | None:
        return _percentile(self._ttfts(), 50)

    @property
    def ttft_p99(self) -> float | None:
        return _percentile(self._ttfts(), 99)

    @property
    def latency_p50(self) -> float | None:
        return _percentile(self._latencies(), 50)

    @property
    def latency_p99(self) -> float | None:
        return _percentile(self._latencies(), 99)

    def to_json(self, per_request: bool = False) -> dict:
        out = {
            "requests": len(self.results), "completed": self.completed, "cancelled": self.cancelled,
            "errors": self.errors, "lost": self.lost, "duplicated": self.duplicated, "wall_s": self.wall_s,
            "output_tokens_per_s": self.output_tokens_per_s, "client_prompt_tokens": self.client_prompt_tokens,
            "client_completion_tokens": self.client_completion_tokens,
            "ttft_p50_s": self.ttft_p50, "ttft_p99_s": self.ttft_p99,
            "latency_p50_s": self.latency_p50, "latency_p99_s": self.latency_p99,
            "finish_reasons": dict(Counter(r.finish_reason for r in self._in("completed"))),
            "error_samples": [f"#{r.index}: {r.error}" for r in self._in("error")][:10],
            "anomaly_samples": [f"#{r.index}: {'; '.join(r.anomalies)}" for r in self.results if r.anomalies][:10],
            "config": asdict(self.config) if self.config is not None else None,
        }
        if per_request:
            out["results"] = [asdict(r) for r in self.results]
        return out

    def table(self) -> str:
        def ms(x: float | None) -> str:
            return "-" if x is None else f"{x * 1e3:.1f} ms"

        lines = [
            f"requests    {len(self.results)}  (completed {self.completed}, cancelled {self.cancelled}, "
            f"errors {self.errors}, lost {self.lost}, duplicated {self.duplicated})",
            f"wall        {self.wall_s:.2f} s",
            f"output      {self.output_tokens_per_s:.1f} tok/s  ({self.client_completion_tokens} completion + "
            f"{self.client_prompt_tokens} prompt tokens over completed requests)",
            f"TTFT        p50 {ms(self.ttft_p50)}  p99 {ms(self.ttft_p99)}",
            f"latency     p50 {ms(self.latency_p50)}  p99 {ms(self.latency_p99)}",
        ]
        for r in [r for r in self.results if r.state == "error"][:3]:
            lines.append(f"error       #{r.index}: {r.error}")
        for r in [r for r in self.results if r.anomalies][:3]:
            lines.append(f"duplicated  #{r.index}: {'; '.join(r.anomalies)}")
        for r in [r for r in self.results if r.state == "lost"][:3]:
            lines.append(f"lost        #{r.index}: the response ended without a finish_reason")
        return "\n".join(lines)


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


def _root(url: str) -> str:
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
    t0 = time.perf_counter()
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
    res.latency_s = time.perf_counter() - t0
    return res


def _progress_bar(total: int):
    """A tqdm bar on an interactive terminal only: in CI or a log file it is noise."""
    if not memra_settings.show_progress():
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="bench", unit="req", file=sys.stderr)


async def run_serve_bench(url: str, model: str, cfg: ServeBenchConfig, api_key: str | None = None,
                          progress: bool = False, words: Sequence[str] = DEFAULT_WORDS) -> ServeBenchReport:
    """Send cfg.requests requests, at most cfg.concurrency at a time; every failure is recorded in its
    RequestResult, none is raised."""
    import httpx

    plan = _plan(cfg, make_prompts(cfg, words))
    sem = asyncio.Semaphore(cfg.concurrency)
    bar = _progress_bar(len(plan)) if progress else None
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=cfg.concurrency, max_keepalive_connections=cfg.concurrency)

    async def send(res: RequestResult) -> RequestResult:
        async with sem:
            await _one(client, model, res, cfg.timeout_s)
        if bar is not None:
            bar.update()
        return res

    # trust_env=False: a proxy from the environment would put itself in the measurement
    async with httpx.AsyncClient(base_url=_root(url), headers=headers, timeout=cfg.timeout_s, limits=limits,
                                 trust_env=False) as client:
        t0 = time.perf_counter()
        done = await asyncio.gather(*(send(r) for r in plan), return_exceptions=True)
        wall = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    for res, outcome in zip(plan, done):
        if isinstance(outcome, BaseException):  # a bug of ours, still not a lost request
            res.error = f"client: {type(outcome).__name__}: {outcome}"
    return ServeBenchReport(plan, wall, cfg)


# ---------------------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------------------

def _get(url: str, path: str, api_key: str | None):
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = httpx.get(_root(url) + path, headers=headers, timeout=30.0, trust_env=False)
    except httpx.HTTPError as e:
        raise MemraError(f"cannot reach {_root(url)}{path}: {e}") from None
    if resp.status_code >= 400:
        raise MemraError(f"{_root(url)}{path} answered HTTP {resp.status_code}: {resp.text[:200]}")
    return resp


def list_models(url: str, api_key: str | None = None) -> list[str]:
    """The model ids the server lists at /v1/models."""
    try:
        return [m["id"] for m in _get(url, "/v1/models", api_key).json()["data"]]
    except (ValueError, KeyError, TypeError):
        raise MemraError(f"{_root(url)}/v1/models did not answer an OpenAI model list") from None


def scrape_metrics(url: str, api_key: str | None = None) -> dict[str, float]:
    """Sample name -> value summed over its label sets, from the server's /metrics.

    Keyed by sample name, not family name: prometheus_client's parser names a counter's family without
    its `_total` suffix, while its sample keeps the name the server exported."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(_get(url, "/metrics", api_key).text):
            for s in family.samples:
                out[s.name] = out.get(s.name, 0.0) + s.value
    except ValueError as e:
        raise MemraError(f"{_root(url)}/metrics is not Prometheus text: {e}") from None
    return out


def _first_difference(want: str, got: str) -> str:
    i = next((k for k, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
    return (f"first difference at char {i}: offline {want[max(0, i - 20): i + 20]!r} vs served "
            f"{got[max(0, i - 20): i + 20]!r} (lengths {len(want)} vs {len(got)})")


def check_against_offline(report: ServeBenchReport, offline: Callable[[str, int], str],
                          check_cancelled: bool = True) -> list[str]:
    """Each completed request that finished by "length" or "stop" must have returned exactly
    offline(prompt, max_tokens); with check_cancelled, what a cancelled stream received must be a prefix
    of it. Returns one description per mismatch (empty: all equal)."""
    problems = []
    for r in report.results:
        if r.state == "completed" and r.finish_reason in ("length", "stop"):
            want = offline(r.prompt, r.max_tokens)
            if want != r.text:
                kind = "stream" if r.stream else "non-stream"
                problems.append(f"request #{r.index} ({kind}, finish {r.finish_reason}): "
                                f"{_first_difference(want, r.text)}")
        elif check_cancelled and r.state == "cancelled":
            want = offline(r.prompt, r.max_tokens)
            if not want.startswith(r.text):
                problems.append(f"cancelled request #{r.index} received text that is not a prefix of the offline "
                                f"output: {_first_difference(want, r.text)}")
    return problems


def check_metrics(before: dict[str, float], after: dict[str, float], report: ServeBenchReport,
                  prefix: str = "memra:") -> list[str]:
    """The server's counter deltas against the client's view. Returns one description per mismatch.

    Completed requests are known exactly. Others may have cost the server work the client never saw:
    a cancelled stream was prefilled and ran for a while (and may even have finished before the
    disconnect reached the server), a timed-out one too. So the checks are bounds, tight when nothing
    was cancelled: prompt delta >= completed prompt tokens; completed completion tokens <= generation
    delta <= that + max_tokens of every request the server may have run without answering; completed
    <= request_success delta <= completed + those requests. A request refused with an HTTP error
    status ran nothing."""
    problems = []
    done = [r for r in report.results if r.state == "completed"]
    no_usage = [r.index for r in done if not isinstance(r.usage, dict) or "completion_tokens" not in r.usage]
    if no_usage:
        problems.append(f"{len(no_usage)} completed requests carried no usage (e.g. #{no_usage[0]}); "
                        "the token counters cannot be checked against them")
    unanswered = [r for r in report.results
                  if r.state != "completed" and not (r.state == "error" and (r.status or 0) >= 400)]

    def delta(name: str) -> float | None:
        key = f"{prefix}{name}_total"
        if key not in after:
            problems.append(f"the server does not export {key}")
            return None
        return after[key] - before.get(key, 0.0)

    prompt = delta("prompt_tokens")
    if prompt is not None and prompt < report.client_prompt_tokens:
        problems.append(f"{prefix}prompt_tokens_total rose by {prompt:g}, less than the {report.client_prompt_tokens} "
                        "prompt tokens of completed requests")
    gen = delta("generation_tokens")
    lo = report.client_completion_tokens
    hi = lo + sum(r.max_tokens for r in unanswered)
    if gen is not None and not lo <= gen <= hi:
        problems.append(f"{prefix}generation_tokens_total rose by {gen:g}; completed requests got {lo} tokens and "
                        f"the {len(unanswered)} unanswered ones could account for at most {hi - lo} more")
    ok = delta("request_success")
    if ok is not None and not len(done) <= ok <= len(done) + len(unanswered):
        problems.append(f"{prefix}request_success_total rose by {ok:g}; expected {len(done)} completed requests "
                        f"(up to {len(unanswered)} more for cancelled/unanswered ones)")
    return problems


def memra_offline(model_path, device: str | None = None, dtype: str | None = None) -> Callable[[str, int], str]:
    """offline(prompt, max_tokens) for check_against_offline: memra's own greedy generation, with the
    prompt encoded and the output decoded as `memra generate` does (special tokens added, skipped).
    `model_path` may also be an already loaded model."""
    import memra
    from memra.generate import generate_tokens
    from memra.sampling import SamplingParams

    model = memra.load(model_path, device=device, dtype=dtype) if isinstance(model_path, (str, os.PathLike)) else model_path
    tok = model.tokenizer

    def offline(prompt: str, max_tokens: int) -> str:
        ids = tok.encode(prompt, add_special=True)
        out = list(generate_tokens(model, ids, SamplingParams(max_tokens=max_tokens), eos_ids=tok.eos_ids))
        return tok.decode(out, skip_special=True)

    return offline


# ---------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------

def add_bench_parser(sub) -> None:
    """`memra bench serve ...` and `memra bench model ...` on the CLI's subparsers (memra.cli wires it;
    `python -m memra.server.bench` runs it alone). The model benchmark lives in memra.benchmark."""
    from memra.benchmark import add_model_parser

    bench = sub.add_parser("bench", help="benchmarks: serve (load-test a server), model (tokens/s vs roofline and HF)")
    kinds = bench.add_subparsers(dest="bench_command", required=True, metavar="{serve,model}")
    p = kinds.add_parser("serve", help="load-test an OpenAI-compatible server; checks that no request is lost")
    d = ServeBenchConfig()
    p.add_argument("url", nargs="?", default="http://127.0.0.1:8000", help="server root (default %(default)s)")
    p.add_argument("--launch", metavar="MODEL", default=None,
                   help="start memra's server in this process with MODEL on a free loopback port and test it "
                        "(then --offline-check uses the same loaded model); 'demo' = the bundled model")
    p.add_argument("--max-batch", type=int, default=32, help="with --launch: the server's --max-batch")
    p.add_argument("--max-ctx", type=int, default=1024, help="with --launch: the server's --max-ctx")
    p.add_argument("--model", default=None, help="model name to send (default: the first one /v1/models lists)")
    p.add_argument("--requests", type=int, default=d.requests)
    p.add_argument("--concurrency", type=int, default=d.concurrency)
    p.add_argument("--cancel-fraction", type=float, default=d.cancel_fraction,
                   help="share of requests closed mid-stream (default %(default)s)")
    p.add_argument("--stream-fraction", type=float, default=d.stream_fraction)
    p.add_argument("--min-prompt-words", type=int, default=d.min_prompt_words)
    p.add_argument("--max-prompt-words", type=int, default=d.max_prompt_words)
    p.add_argument("--min-tokens", type=int, default=d.min_tokens)
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--timeout", type=float, default=d.timeout_s, help="per-request bound in seconds")
    p.add_argument("--api-key", default=memra_settings.api_key(), help="bearer token (default $MEMRA_API_KEY)")
    p.add_argument("--no-metrics", action="store_true", help="skip the /metrics check (a server without it)")
    p.add_argument("--metrics-prefix", default="memra:", help="counter prefix, e.g. vllm: (default %(default)s)")
    p.add_argument("--offline-check", metavar="MODEL", default=None,
                   help="afterwards, generate every completed prompt offline with this model and compare")
    p.add_argument("--no-offline-check", action="store_true",
                   help="with --launch: skip comparing every completed answer with offline generation")
    p.add_argument("--device", default=None, help="device for --offline-check")
    p.add_argument("--dtype", default=None, help="dtype for --offline-check")
    p.add_argument("--json", metavar="PATH", default=None, help="write the report (per request too) as JSON")
    add_model_parser(kinds)


def cmd_bench(args: argparse.Namespace) -> int:
    """serve: exit 0 when nothing was lost, duplicated or failed and every check passed; 1 otherwise.
    model: memra.benchmark.cmd_model (exit 1 when a cell failed)."""
    if args.bench_command == "model":
        from memra.benchmark import cmd_model

        return cmd_model(args)
    cfg = ServeBenchConfig(requests=args.requests, concurrency=args.concurrency, cancel_fraction=args.cancel_fraction,
                           min_prompt_words=args.min_prompt_words, max_prompt_words=args.max_prompt_words,
                           min_tokens=args.min_tokens, max_tokens=args.max_tokens,
                           stream_fraction=args.stream_fraction, seed=args.seed, timeout_s=args.timeout)
    server = None
    if args.launch:
        server, args.url = _launch(args)
    try:
        return _bench(args, cfg, server)
    finally:
        if server is not None:
            server.stop()


def _launch(args):
    """An in-process memra server on a free port: (ServerThread, url)."""
    import memra
    from memra.server.api import build_app
    from memra.engine.engine import Engine, EngineConfig
    from memra.server.http import ServerThread
    from memra.server.metrics import Metrics
    from memra.server.options import ServerOptions

    model = memra.load(args.launch, device=args.device, dtype=args.dtype)
    metrics = Metrics("memra")
    engine = Engine(model, EngineConfig(max_batch=args.max_batch, max_ctx=args.max_ctx), metrics)
    server = ServerThread(build_app(engine, "memra", ServerOptions(api_key=args.api_key), metrics=metrics)).start()
    server.model = model
    return server, server.url


def _bench(args, cfg: ServeBenchConfig, server) -> int:
    model = args.model
    if model is None:
        ids = list_models(args.url, args.api_key)
        if not ids:
            raise MemraError(f"{args.url} lists no models; pass --model")
        model = ids[0]
    before = None if args.no_metrics else scrape_metrics(args.url, args.api_key)
    report = asyncio.run(run_serve_bench(args.url, model, cfg, api_key=args.api_key, progress=True))
    print(report.table())
    problems = []
    if before is not None:
        problems += check_metrics(before, scrape_metrics(args.url, args.api_key), report, prefix=args.metrics_prefix)
    if args.offline_check or (server is not None and not args.no_offline_check):
        target = server.model if server is not None else args.offline_check
        problems += check_against_offline(report, memra_offline(target, args.device, args.dtype))
    for p in problems:
        print(f"check failed: {p}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({**report.to_json(per_request=True), "model": model, "check_failures": problems}, f, indent=1)
    return 0 if not (problems or report.lost or report.duplicated or report.errors) else 1


def main(argv: list[str] | None = None) -> int:
    """`python -m memra.server.bench bench serve ...`: the same entry point as `memra bench`."""
    from memra.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
