"""What a `memra bench serve` run is and what it yields: its config (ServeBenchConfig, validated when
built), each request's outcome (RequestResult) and the run's report (ServeBenchReport) — counts by
outcome, tokens/s, TTFT and latency percentiles — as a table and as JSON. Plain data: the client
(memra.bench.serve_client) fills it, the checks (memra.bench.serve_checks) read it.

Every request ends completed, cancelled, or with an error; one that ends as none of these was *lost*,
and one with protocol anomalies (a second finish, text after it) is *duplicated*. Both must be zero.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Sequence

from memra.errors import MemraError


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
    # Client processes sharing the concurrency (memra.bench.serve_client): one Python event loop parses
    # every streamed chunk, and at thousands of chunks a second its own delays become the server's idle rows.
    client_processes: int = 1

    def __post_init__(self) -> None:
        if self.requests <= 0 or self.concurrency <= 0:
            raise MemraError(f"requests and concurrency must be positive, got {self.requests} and {self.concurrency}")
        if not 1 <= self.client_processes <= min(self.concurrency, 64):
            raise MemraError(f"client_processes must be in 1..{min(self.concurrency, 64)} (at most the concurrency), "
                             f"got {self.client_processes}")
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
    # wall-clock times (time.time(): one clock for every client process): sent, ended, each text chunk's arrival
    sent_at: float | None = None
    ended_at: float | None = None
    text_at: list[float] = field(default_factory=list)

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

    def steady_window(self) -> tuple[float, float] | None:
        """(start, end) of the span with every one of the concurrency's requests in flight: from the moment the
        in-flight count first reaches it to the last end after which it never does again. Outside it the
        server ramps up (the first prefills) or drains (the last answers, fewer rows a step) -- what a
        closed-loop run of few requests mixes into its rate. None without a config or a full span."""
        if self.config is None:
            return None
        events = sorted([(r.sent_at, 1) for r in self.results if r.sent_at is not None and r.ended_at is not None]
                        + [(r.ended_at, -1) for r in self.results if r.sent_at is not None and r.ended_at is not None],
                        key=lambda e: (e[0], e[1]))  # an end before a start at the same instant
        live, start, end = 0, None, None
        for t, step in events:
            if step < 0 and live == self.config.concurrency:
                end = t
            live += step
            if live == self.config.concurrency and start is None:
                start = t
        return (start, end) if start is not None and end is not None and end > start else None

    @property
    def steady_window_s(self) -> float | None:
        window = self.steady_window()
        return None if window is None else window[1] - window[0]

    @property
    def steady_output_tokens_per_s(self) -> float | None:
        """Output tokens a second inside steady_window, from the completed streams' text chunks (each chunk
        weighted by its request's completion tokens over its chunks); None without such a window or streams."""
        window = self.steady_window()
        streams = [r for r in self._in("completed") if r.stream and r.text_at]
        if window is None or not streams:
            return None
        t0, t1 = window
        tokens = sum(_usage_int(r.usage, "completion_tokens") * sum(t0 <= t <= t1 for t in r.text_at) / len(r.text_at)
                     for r in streams)
        return tokens / (t1 - t0)

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
            "steady_output_tokens_per_s": self.steady_output_tokens_per_s,
            "steady_window_s": self.steady_window_s,
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
            f"wall        {self.wall_s:.2f} s" + (f"  ({self.config.client_processes} client processes)"
                                                  if self.config is not None and self.config.client_processes > 1
                                                  else ""),
            f"output      {self.output_tokens_per_s:.1f} tok/s  ({self.client_completion_tokens} completion + "
            f"{self.client_prompt_tokens} prompt tokens over completed requests)",
            *([f"steady      {steady:.1f} tok/s  (the {self.steady_window_s:.2f} s with all {self.config.concurrency} "
               "requests in flight; streams only)"] if (steady := self.steady_output_tokens_per_s) is not None else []),
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
