"""Prometheus metrics of the server, `memra:`-prefixed (vLLM's names with our prefix where they exist).

Each server owns its registry (no process-global one), so tests can run several servers. The
process-wide liveness counters of memra.counters (pipeline walks, peer probes, speculation, ...) are
exported as they are at scrape time, as `memra:<name>_total`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

from memra import counters

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
                    20.0, 40.0, 80.0)


class _LivenessCounters:
    """memra.counters as Prometheus counters, read at scrape time."""

    def collect(self):
        for name, value in sorted(counters.snapshot().items()):
            fam = CounterMetricFamily(f"memra:{name}", f"memra liveness counter {name} (memra.counters)")
            fam.add_metric([], value)
            yield fam


class Metrics:
    def __init__(self, model_name: str):
        r = self.registry = CollectorRegistry()
        label = {"model_name": model_name}
        self.running = Gauge("memra:num_requests_running", "Sequences being prefilled or decoded", registry=r)
        self.waiting = Gauge("memra:num_requests_waiting", "Sequences queued or preempted", registry=r)
        self.kv_usage = Gauge("memra:kv_cache_usage_perc", "Share of KV-cache blocks in use (0..1)", registry=r)
        self.prompt_tokens = Counter("memra:prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.generation_tokens = Counter("memra:generation_tokens", "Tokens generated", registry=r)
        self.request_success = Counter("memra:request_success", "Sequences finished, by why: stop, length, "
                                       "or abort (cancelled, the client gone, shutdown or an error), as vLLM counts them",
                                       ["finished_reason"], registry=r)  # vLLM's label name
        self.preemptions = Counter("memra:num_preemptions", "Sequences swapped out to make room", registry=r)
        self.ttft = Histogram("memra:time_to_first_token_seconds", "Arrival to first token", registry=r,
                              buckets=_LATENCY_BUCKETS)
        # the same wait seen from the HTTP side: a streamed request's arrival at its route to its first
        # token's chunk on the event loop (parsing, tokenizing, the queue and the text thread included)
        self.http_ttft = Histogram("memra:http_time_to_first_chunk_seconds",
                                   "A streamed request's arrival at the API to its first token's chunk",
                                   registry=r, buckets=_LATENCY_BUCKETS)
        self.inter_token = Histogram("memra:inter_token_latency_seconds", "Between consecutive tokens of a sequence",
                                     registry=r, buckets=_LATENCY_BUCKETS)
        self.batch_size = Histogram("memra:decode_batch_size", "Rows per batched decode step", registry=r,
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))
        # where the engine's time goes: a step that only decodes, only prefills, or does both
        self.step_seconds = Histogram("memra:engine_step_seconds", "Wall time of one engine step, by what it ran",
                                      ["kind"], registry=r, buckets=_LATENCY_BUCKETS)
        # speculative decoding (memra.engine.speculation; vLLM's names): verify rounds, those that carried drafts,
        # the draft tokens they carried and the ones accepted; all zero on a server without --speculative
        self.spec_verifies = Counter("memra:spec_decode_num_verifies", "Speculative verify forwards", registry=r)
        self.spec_drafts = Counter("memra:spec_decode_num_drafts", "Verify rounds that carried drafts", registry=r)
        self.spec_draft_tokens = Counter("memra:spec_decode_num_draft_tokens", "Draft tokens verified", registry=r)
        self.spec_accepted_tokens = Counter("memra:spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                            registry=r)
        # the prefix cache (vLLM's names): prompt tokens looked up, and those served from it, with their ratio
        self.prefix_queries = Counter("memra:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      registry=r)
        self.prefix_hits = Counter("memra:prefix_cache_hits", "Prompt tokens served from the prefix cache", registry=r)
        self.prefix_hit_rate = Gauge("memra:prefix_cache_hit_rate", "prefix_cache_hits / prefix_cache_queries",
                                     registry=r)
        self._prefix = [0, 0]
        self.weights_version = Gauge("memra:weights_version", "Weight updates landed (memra.weights)", registry=r)
        self.info = Gauge("memra:model_info", "The served model", list(label), registry=r)
        self.info.labels(**label).set(1)
        r.register(_LivenessCounters())

    def publish(self, scheduler, batch: int, kind: str | None = None, seconds: float = 0.0) -> None:
        """After an engine step: the scheduler's gauges, the decode batch's width if one ran, and the
        step's wall time by kind (decode | prefill | mixed; None: nothing ran)."""
        self.running.set(scheduler.num_running())
        self.waiting.set(scheduler.num_waiting())
        self.kv_usage.set(scheduler.kv_usage)
        if batch:
            self.batch_size.observe(batch)
        if kind is not None:
            self.step_seconds.labels(kind=kind).observe(seconds)

    def prefix_lookup(self, prompt_tokens: int, cached: int) -> None:
        """A sequence started with `cached` of its `prompt_tokens` from the prefix cache."""
        self.prefix_queries.inc(prompt_tokens)
        self.prefix_hits.inc(cached)
        self._prefix[0] += prompt_tokens
        self._prefix[1] += cached
        self.prefix_hit_rate.set(self._prefix[1] / self._prefix[0])

    def render(self) -> bytes:
        return generate_latest(self.registry)
