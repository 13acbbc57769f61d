"""The checks that turn a `memra bench serve` run into a correctness test, not just a speed number:

- check_against_offline: each completed greedy answer equals what offline generation produces for the
  same prompt (memra's promise: serving under load changes no token); memra_offline supplies memra's own
  (MemraOffline: one at a time, or batched through memra.LLM with its first rows cross-checked alone);
- check_metrics: the server's Prometheus token and request counters moved by what the client saw
  (scrape_metrics reads them before and after; the run must be the server's only client meanwhile,
  since the deltas are global).

Also list_models, which names the model to send when the user gives none.
"""

from __future__ import annotations

import os
from typing import Callable

from memra.bench.serve_client import server_root
from memra.bench.serve_report import ServeBenchReport
from memra.errors import MemraError


def _get(url: str, path: str, api_key: str | None):
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = httpx.get(server_root(url) + path, headers=headers, timeout=30.0, trust_env=False)
    except httpx.HTTPError as e:
        raise MemraError(f"cannot reach {server_root(url)}{path}: {e}") from None
    if resp.status_code >= 400:
        raise MemraError(f"{server_root(url)}{path} answered HTTP {resp.status_code}: {resp.text[:200]}")
    return resp


def list_models(url: str, api_key: str | None = None) -> list[str]:
    """The model ids the server lists at /v1/models."""
    try:
        return [m["id"] for m in _get(url, "/v1/models", api_key).json()["data"]]
    except (ValueError, KeyError, TypeError):
        raise MemraError(f"{server_root(url)}/v1/models did not answer an OpenAI model list") from None


def scrape_metrics(url: str, api_key: str | None = None) -> dict[str, float]:
    """Sample name -> value summed over its label sets, from the server's /metrics; a labelled sample is
    also kept on its own as `name{label=value,...}`.

    Keyed by sample name, not family name: prometheus_client's parser names a counter's family without
    its `_total` suffix, while its sample keeps the name the server exported."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(_get(url, "/metrics", api_key).text):
            for s in family.samples:
                out[s.name] = out.get(s.name, 0.0) + s.value
                labels = {k: v for k, v in s.labels.items() if k != "le"}
                if labels and "le" not in s.labels:
                    out[s.name + "{" + ",".join(f"{k}={v}" for k, v in sorted(labels.items())) + "}"] = s.value
    except ValueError as e:
        raise MemraError(f"{server_root(url)}/metrics is not Prometheus text: {e}") from None
    return out


def engine_time(before: dict[str, float], after: dict[str, float], wall_s: float, prefix: str = "memra:") -> list[str]:
    """Where the server's engine spent the run (memra:engine_step_seconds by kind): steps, their mean
    time and their share of the client's wall time; how full its steps were (memra:decode_batch_size)
    and how long a request waited from its submit to its first token by the engine's own clock
    (memra:time_to_first_token_seconds) and by the HTTP side's, from a stream's arrival at its route to
    its first token's chunk (memra:http_time_to_first_chunk_seconds; the client's TTFT minus this is
    the client's and the connection's); and how many kernels it compiled meanwhile (a compile after the
    warm-up stalls a step). Empty when the server exports none of these."""
    def moved(name: str) -> float:
        return after.get(prefix + name, 0.0) - before.get(prefix + name, 0.0)

    lines, busy = [], 0.0
    for kind in ("decode", "prefill", "mixed"):
        key = f"{prefix}engine_step_seconds_%s{{kind={kind}}}"
        n = after.get(key % "count", 0.0) - before.get(key % "count", 0.0)
        s = after.get(key % "sum", 0.0) - before.get(key % "sum", 0.0)
        if n > 0:
            busy += s
            share = f" ({s / wall_s:.0%} of wall)" if wall_s > 0 else ""
            lines.append(f"engine      {kind:8s}{int(n):7d} steps, {s / n * 1e3:8.2f} ms each, {s:7.2f} s{share}")
    if lines:
        lines.append(f"engine      idle    {max(wall_s - busy, 0.0):7.2f} s of {wall_s:.2f} s wall")
    if moved("decode_batch_size_count") > 0:
        lines.append(f"engine      rows    {moved('decode_batch_size_sum') / moved('decode_batch_size_count'):7.1f} "
                     "live rows a decoding step")
    if moved("time_to_first_token_seconds_count") > 0:
        mean = moved("time_to_first_token_seconds_sum") / moved("time_to_first_token_seconds_count")
        lines.append(f"engine      TTFT    {mean * 1e3:7.1f} ms mean, submit to first token")
    if moved("http_time_to_first_chunk_seconds_count") > 0:
        mean = moved("http_time_to_first_chunk_seconds_sum") / moved("http_time_to_first_chunk_seconds_count")
        lines.append(f"server      TTFT    {mean * 1e3:7.1f} ms mean, a stream's arrival to its first token's chunk")
    if moved("spec_decode_num_verifies_total") > 0:  # a server started with --speculative
        drafted, accepted = moved("spec_decode_num_draft_tokens_total"), moved("spec_decode_num_accepted_tokens_total")
        lines.append(f"engine      spec    {int(moved('spec_decode_num_verifies_total'))} verifies, {int(accepted)}/"
                     f"{int(drafted)} drafts accepted ({accepted / max(drafted, 1):.1%})")
    # After the warm-up each of these stalled a step: a Triton compile, or a CUDA graph recorded (a decode
    # or mixed step's shape the warm-up did not meet), which holds up every live row's next token.
    for counter, what in (("kernel_compiles_total", "kernel compiles"),
                          ("graph_captures_total", "CUDA graph captures")):
        if prefix + counter in after:
            lines.append(f"engine      {what} during the run: {int(moved(counter))}")
    return lines


def _first_difference(want: str, got: str) -> str:
    i = next((k for k, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
    return (f"first difference at char {i}: offline {want[max(0, i - 20): i + 20]!r} vs served "
            f"{got[max(0, i - 20): i + 20]!r} (lengths {len(want)} vs {len(got)})")


def check_against_offline(report: ServeBenchReport, offline: Callable[[str, int], str],
                          check_cancelled: bool = True) -> list[str]:
    """Each completed request that finished by "length" or "stop" must have returned exactly
    offline(prompt, max_tokens); with check_cancelled, what a cancelled stream received must be a prefix
    of it. An `offline` with a `prepare` method (MemraOffline) gets every request first, to generate them
    in one batch. Returns one description per mismatch (empty: all equal)."""
    problems = []
    if hasattr(offline, "prepare"):  # a batched offline generator: every answer it will be asked for, at once
        offline.prepare([(r.prompt, r.max_tokens) for r in report.results
                         if (r.state == "completed" and r.finish_reason in ("length", "stop"))
                         or (check_cancelled and r.state == "cancelled")])
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


ALONE_CHECKS = 4  # requests of a batched offline run also generated one at a time (its E1 cross-check)


class MemraOffline:
    """offline(prompt, max_tokens) for check_against_offline: memra's own greedy generation, with the prompt
    encoded and the output decoded as `memra generate` does (special tokens added, skipped).

    One at a time (generate_tokens, the B=1 path) by default. With `batched`, check_against_offline first
    hands every request it will check to `prepare`, which generates them all in one memra.LLM run and keeps
    the answers: on a GPU the B=1 path takes minutes for a few hundred answers (73k tokens at ~175 tok/s),
    the batch seconds. Each row of a batch is its B=1 run (promise E1); `prepare` re-runs the first
    ALONE_CHECKS requests one at a time and refuses, in one line, where one differs."""

    def __init__(self, model, batched: bool = False, max_batch: int = 256):
        self.model, self.batched, self.max_batch = model, batched, max_batch
        self.tok = model.tokenizer
        self.answers: dict[tuple[str, int], str] = {}

    def alone(self, prompt: str, max_tokens: int) -> str:
        from memra.generate import generate_tokens
        from memra.sampling import SamplingParams

        ids = self.tok.encode(prompt, add_special=True)
        out = generate_tokens(self.model, ids, SamplingParams(max_tokens=max_tokens, temperature=0.0), eos_ids=self.tok.eos_ids)
        return self.tok.decode(list(out), skip_special=True)

    def __call__(self, prompt: str, max_tokens: int) -> str:
        key = (prompt, max_tokens)
        return self.answers[key] if key in self.answers else self.alone(prompt, max_tokens)

    def prepare(self, requests: list[tuple[str, int]]) -> None:
        """Generate `requests` [(prompt, max_tokens)] in one batch (only when batched) and keep the answers."""
        todo = list(dict.fromkeys(r for r in requests if r not in self.answers))
        if not self.batched or not todo:
            return
        from memra.engine.llm import LLM
        from memra.sampling import SamplingParams

        prompts = [{"prompt_token_ids": self.tok.encode(p, add_special=True)} for p, _ in todo]
        params = [SamplingParams(max_tokens=n, temperature=0.0) for _, n in todo]
        ctx = max(len(p["prompt_token_ids"]) + n for p, (_, n) in zip(prompts, todo))
        llm = LLM(self.model, max_batch=min(self.max_batch, len(todo)), max_ctx=ctx, generation_config=None)
        try:
            outs = llm.generate(prompts, params)
        finally:
            llm.close()
        for key, out in zip(todo, outs):
            self.answers[key] = self.tok.decode(list(out.outputs[0].token_ids), skip_special=True)
        for key in todo[:ALONE_CHECKS]:
            if (alone := self.alone(*key)) != self.answers[key]:
                raise MemraError(f"offline generation is not batch-invariant: a {key[1]}-token answer differs alone "
                                 f"({_first_difference(alone, self.answers[key])}); no served answer can be checked")


def memra_offline(model_path, device: str | None = None, dtype: str | None = None, batched: bool = False) -> MemraOffline:
    """MemraOffline for a model path (loaded here) or an already loaded model."""
    import memra

    model = memra.load(model_path, device=device, dtype=dtype) if isinstance(model_path, (str, os.PathLike)) else model_path
    return MemraOffline(model, batched=batched)
