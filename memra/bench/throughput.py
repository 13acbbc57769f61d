"""`memra bench throughput`: offline batch throughput through memra.LLM.generate, after the convention
of vLLM's benchmark_throughput — N prompts submitted at once, the wall time until the last one ends,
output tokens/s and total (prompt + output) tokens/s.

The workload is N synthetic requests drawn from a fixed seed, or a JSONL file. Synthetic lengths are
ShareGPT-like: input and output lengths each log-normal with median 160 tokens and sigma 1.0, clipped
to [4, 1024] (ShareGPT's conversations, as vLLM filters them, average about 220 input / 200 output
Llama-3 tokens, with a long tail); prompt ids are uniform over the vocabulary. Every request runs to
its output length (ignore_eos), so the token count does not depend on what a random model says.

With --structured every request is held to one grammar (llguidance, memra.structured): the same run
with and without it gives the grammar's cost per token. Beside the rates it prints the engine's step mix
(memra.engine.step_mix) and, with --check K, runs K of the prompts again one at a time and compares their
tokens with the batched run's: the throughput is the exact engine's, and the run shows it. The step mix
includes what sat between the steps (the host's gap, and on CUDA the GPU's idle share,
memra.engine.step_clock) and the decode steps' row histogram. The report ends with the workload's floor on
this device (memra.bench.workload_floor) and the run's share of it. --max-batch auto (the default) sizes the
batch from the KV memory (memra.engine.batch_size); --prefill-budget sets the scheduler's split budget (0:
shared; default: EngineConfig.split_budget's); --variants runs several such settings on one loaded model and
prints one table (memra.bench.throughput_variants).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from memra import counters
from memra.bench.probes import Probes
from memra.bench.workload_floor import WorkloadFloor, workload_floor
from memra.errors import CaptureMemoryError, MemraError
from memra.pools import KvBudget
from memra.sampling import MAX_LOGPROBS, SamplingParams

LENGTH_MEDIAN, LENGTH_SIGMA, MIN_LEN, MAX_LEN = 160, 1.0, 4, 1024


@dataclass(frozen=True)
class ThroughputConfig:
    model: str = "demo"
    num_prompts: int = 1000
    dataset: str | None = None  # JSONL: {"prompt": text | "prompt_token_ids": [...], "output_len": N} a line
    input_len: int | None = None  # fixed lengths instead of the ShareGPT-like draw
    output_len: int | None = None
    seed: int = 0
    temperature: float = 1.0  # vLLM's benchmark samples at 1.0; each request seeded with seed + its index
    max_batch: int | str = "auto"  # the largest graph bucket the KV memory holds (memra.engine.batch_size), or a number
    prefill_budget: int | None = None  # the scheduler's split budget (EngineConfig.prefill_budget): 0 shared, None the default
    kv_fraction: float = 0.8  # of the free device memory after the weights, for the KV pool: the rest holds
    # the activations and the captured graphs of every batch bucket up to max_batch
    device: str | None = None
    dtype: str | None = None
    check: int = 2  # prompts re-run alone and compared with the batched run
    json_path: str | None = None
    structured: str | None = None  # "json_object" | "regex:PATTERN" | "json:SCHEMA": every request held to it
    logprobs: int | None = None  # every request asks for its tokens' logprobs and the top n (an RL sampler's load)

    def constraint(self):
        """--structured as a StructuredOutputs (None without it); a bad spelling is a one-line error."""
        from memra.structured.params import StructuredOutputs

        if self.structured is None:
            return None
        kind, _, value = self.structured.partition(":")
        if kind == "json_object" and not value:
            return StructuredOutputs(json_object=True)
        if kind in ("regex", "json") and value:
            return StructuredOutputs(**{kind: value})
        raise MemraError(f"--structured takes json_object, regex:PATTERN or json:SCHEMA, got {self.structured!r}")

    def __post_init__(self) -> None:
        if self.num_prompts <= 0:
            raise MemraError(f"--num-prompts must be positive, got {self.num_prompts}")
        if self.max_batch != "auto" and not (type(self.max_batch) is int and self.max_batch > 0):
            raise MemraError(f"--max-batch must be a positive integer or auto, got {self.max_batch!r}")
        if self.prefill_budget not in (None, 0) and not (type(self.prefill_budget) is int and self.prefill_budget >= 64):
            raise MemraError(f"--prefill-budget must be an integer of at least 64 (one aligned prefill piece), or 0 "
                             f"(shared with the decode rows), got {self.prefill_budget!r}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise MemraError(f"--logprobs must be in 0..{MAX_LOGPROBS}, got {self.logprobs}")
        for name in ("input_len", "output_len"):
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise MemraError(f"--{name.replace('_', '-')} must be positive, got {v}")
        if self.check < 0:
            raise MemraError(f"--check must be >= 0, got {self.check}")


@dataclass(frozen=True)
class Request:
    prompt: list[int]  # token ids
    output_len: int


def sharegpt_like_lengths(rng: np.random.Generator, n: int) -> np.ndarray:
    """n lengths, log-normal (median LENGTH_MEDIAN, sigma LENGTH_SIGMA) clipped to [MIN_LEN, MAX_LEN]."""
    draw = rng.lognormal(math.log(LENGTH_MEDIAN), LENGTH_SIGMA, size=n)
    return np.clip(np.rint(draw), MIN_LEN, MAX_LEN).astype(np.int64)


def synthetic_workload(cfg: ThroughputConfig, vocab: int, context: int) -> list[Request]:
    """cfg.num_prompts requests from cfg.seed: the same list on every machine for the same arguments.
    Each fits `context` (prompt + output); the output is cut first, and never below one token."""
    rng = np.random.default_rng(cfg.seed)
    n = cfg.num_prompts
    ins = np.full(n, cfg.input_len) if cfg.input_len else sharegpt_like_lengths(rng, n)
    outs = np.full(n, cfg.output_len) if cfg.output_len else sharegpt_like_lengths(rng, n)
    reqs = []
    for i, o in zip(ins.tolist(), outs.tolist()):
        i = min(i, context - 1)
        reqs.append(Request(rng.integers(0, vocab, size=i).tolist(), max(1, min(o, context - i))))
    return reqs


def jsonl_workload(path: str, tokenizer, limit: int) -> list[Request]:
    """The first `limit` lines of a JSONL file; a bad line is a one-line error naming its number."""
    reqs = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise MemraError(f"cannot read --dataset {path}: {e.strerror or e}") from None
    for no, line in enumerate(lines, 1):
        if len(reqs) == limit:
            break
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if "prompt_token_ids" in row:
                ids = [int(t) for t in row["prompt_token_ids"]]
            else:
                ids = tokenizer.encode(str(row["prompt"]), add_special=True)
            out = int(row.get("output_len", row.get("max_tokens", LENGTH_MEDIAN)))
        except (ValueError, KeyError, TypeError) as e:
            raise MemraError(f"{path} line {no}: expected {{\"prompt\" or \"prompt_token_ids\", \"output_len\"}} "
                             f"({type(e).__name__}: {e})") from None
        if not ids or out <= 0:
            raise MemraError(f"{path} line {no}: an empty prompt or an output_len below 1")
        reqs.append(Request(ids, out))
    if not reqs:
        raise MemraError(f"--dataset {path} holds no requests")
    return reqs


@dataclass
class ThroughputReport:
    model: str
    device: str
    workload: str
    requests: int
    prompt_tokens: int
    output_tokens: int
    seconds: float
    steps: dict = field(default_factory=dict)  # StepMix.to_json()
    step_lines: list[str] = field(default_factory=list)
    max_batch: int = 0
    prefill_budget: int | None = None
    longest_first: bool = False  # the waiting requests started longest output first (MEMRA_ADMISSION_ORDER)
    sizing: str = ""  # how --max-batch auto chose, where it did
    decode_row_bins: dict = field(default_factory=dict)  # decode steps by row count (StepMix.rows)
    idle_share: float | None = None  # the GPU's idle time between steps over its step time (CUDA)
    wait_share: float | None = None  # ... and within steps, its sampling waiting for the host's landing (CUDA)
    one_forward: int = 0  # mixed steps run as one forward (memra.step.mixed_step); the rest made the two calls
    captures: int = 0  # CUDA graphs captured during the timed run (the warm-up should have taken them all)
    checked: int = 0
    check_failures: list[str] = field(default_factory=list)
    length_failures: int = 0  # requests that ended before their output length
    floor: WorkloadFloor | None = None  # the workload's floor on this device (memra.bench.workload_floor)
    floor_skipped: str = ""  # why there is none, where the probes could not run

    @property
    def output_tps(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def total_tps(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.seconds

    def table(self) -> str:
        lines = [f"memra bench throughput: {self.model} on {self.device}; {self.workload}",
                 f"{self.requests} requests, {self.prompt_tokens} prompt + {self.output_tokens} output tokens "
                 f"in {self.seconds:.2f} s",
                 f"  {self.requests / self.seconds:10.2f} requests/s",
                 f"  {self.output_tps:10.1f} output tokens/s",
                 f"  {self.total_tps:10.1f} total tokens/s",
                 f"max_batch {self.max_batch}, prefill budget "
                 + (f"{self.prefill_budget} (split)" if self.prefill_budget else "shared with the decode rows")
                 + (", longest outputs first" if self.longest_first else ", first come first served"),
                 *([self.sizing] if self.sizing else []), "engine steps:", *self.step_lines,
                 f"  mixed steps as one forward: {self.one_forward} of {self.steps.get('mixed', {}).get('steps', 0)} "
                 f"(the rest: the decode rows and an eager prefill, two calls); graphs captured mid-run: {self.captures}"]
        if self.checked:
            verdict = "all equal" if not self.check_failures else f"{len(self.check_failures)} DIFFER"
            lines.append(f"exactness: {self.checked} requests re-run alone, tokens {verdict}")
        if self.length_failures:
            lines.append(f"{self.length_failures} requests ended before their output length")
        if self.floor is not None:
            lines.append(self.floor.line(self.output_tokens, self.seconds))
        elif self.floor_skipped:
            lines.append(f"floor on this device: not measured ({self.floor_skipped})")
        return "\n".join(lines)

    def to_json(self) -> dict:
        floor = None if self.floor is None else {**asdict(self.floor), "seconds": self.floor.seconds}
        return {**{k: v for k, v in vars(self).items() if k not in ("step_lines", "floor")}, "floor": floor,
                "output_tokens_per_s": self.output_tps, "total_tokens_per_s": self.total_tps}


def run_throughput(cfg: ThroughputConfig, log=print) -> ThroughputReport:
    """Load the model, build the workload, time one LLM.generate over all of it. -> the report."""
    model, reqs, workload = prepare(cfg)
    return run_on(model, reqs, workload, cfg, log)


def prepare(cfg: ThroughputConfig) -> tuple:
    """-> (the loaded model, the requests, the workload in words)."""
    from memra.loading.checkpoint import load

    cfg.constraint()  # a bad --structured fails before the load
    model = load(cfg.model, device=cfg.device, dtype=cfg.dtype, kv_budget=KvBudget(fraction=cfg.kv_fraction))
    if cfg.dataset:
        reqs, workload = jsonl_workload(cfg.dataset, model.tokenizer, cfg.num_prompts), f"dataset {cfg.dataset}"
    else:
        reqs = synthetic_workload(cfg, model.cfg.vocab_size, model.cfg.max_position)
        workload = (f"synthetic, seed {cfg.seed}, input "
                    + (f"{cfg.input_len}" if cfg.input_len else lengths_said())
                    + ", output " + (f"{cfg.output_len}" if cfg.output_len else lengths_said()))
    workload += f"; every request held to {cfg.structured}" if cfg.structured else ""
    workload += f"; every request asks for logprobs (top {cfg.logprobs})" if cfg.logprobs is not None else ""
    return model, reqs, workload


def run_on(model, reqs: list[Request], workload: str, cfg: ThroughputConfig, log=print) -> ThroughputReport:
    """Time one LLM.generate over `reqs` on a loaded model (cfg's max_batch, prefill_budget, check, ...);
    the engine is closed after, its pools and graphs given back. -> the report."""
    from memra.engine.batch_size import auto_max_batch
    from memra.engine.llm import LLM
    from memra.graphs import BUCKETS
    from memra.loading.checkpoint import progress

    held = cfg.constraint()
    context = max(len(r.prompt) + r.output_len for r in reqs)
    max_batch, sizing = cfg.max_batch, ""
    if max_batch == "auto":  # sized for the mean sequence: blocks are taken as positions are written
        max_batch, sizing = auto_max_batch(model, -(-sum(len(r.prompt) + r.output_len for r in reqs) // len(reqs)))
        log(sizing)
    log(f"{len(reqs)} requests, longest {context} tokens; building the engine (max_batch {max_batch}) ...")
    while True:
        try:
            llm = LLM(model, max_batch=max_batch, max_ctx=context, prefill_budget=cfg.prefill_budget)
            break
        except CaptureMemoryError:  # auto sized the pools only: its captured steps did not fit beside them
            smaller = [b for b in BUCKETS if b < max_batch]
            if cfg.max_batch != "auto" or not smaller:
                raise
            sizing += f"; {max_batch}'s captured steps did not fit beside the pools, so {smaller[-1]}"
            max_batch = smaller[-1]
            log(f"max_batch auto: {sizing.rsplit('; ', 1)[-1]}")
    params = [SamplingParams(max_tokens=r.output_len, temperature=cfg.temperature, seed=cfg.seed + i, ignore_eos=True,
                             structured_outputs=held, logprobs=cfg.logprobs) for i, r in enumerate(reqs)]
    before, counted = llm.engine.step_mix.copy(), counters.snapshot()
    t0 = time.perf_counter()
    outs = llm.generate([r.prompt for r in reqs], params)
    seconds = time.perf_counter() - t0
    counted = counters.delta(counted)
    llm.engine.clock.flush()  # the device times of the last steps
    mix = llm.engine.step_mix.since(before)
    report = ThroughputReport(cfg.model, str(model.device), workload, len(reqs), sum(len(r.prompt) for r in reqs),
                              sum(len(o.outputs[0].token_ids) for o in outs), seconds, mix.to_json(), mix.lines(),
                              max_batch, llm.engine.scheduler.cfg.prefill_budget, llm.engine.scheduler.cfg.longest_first,
                              sizing, dict(mix.rows),
                              mix.idle_share, mix.wait_share,
                              counted.get("mixed_steps", 0), counted.get("graph_captures", 0))
    report.length_failures = sum(len(o.outputs[0].token_ids) != r.output_len for o, r in zip(outs, reqs))
    checks = _spread(len(reqs), cfg.check)
    for i in progress(checks, len(checks), "check alone", unit="req"):  # alone: B=1 from submit to end
        report.checked += 1
        alone = llm.generate([reqs[i].prompt], [params[i]], use_tqdm=False)[0].outputs[0].token_ids
        if alone != outs[i].outputs[0].token_ids:
            report.check_failures.append(f"request {i}: batched and alone differ")
    llm.close()
    try:  # after close: the pools' memory is free again
        probes = Probes.measure(model.device, model.dtype, repeats=3)
    except torch.OutOfMemoryError:  # a model that leaves no room for the probes' buffers: the run's figures stand
        report.floor_skipped = "the probes' buffers did not fit beside the model"
    else:
        report.floor = workload_floor(model, [(len(r.prompt), r.output_len) for r in reqs],
                                      probes.matmul_flops_per_s, probes.read_bytes_per_s)
    if cfg.json_path:
        Path(cfg.json_path).write_text(json.dumps(report.to_json(), indent=1), encoding="utf-8")
    return report


def lengths_said() -> str:
    return f"lognormal(median {LENGTH_MEDIAN}, sigma {LENGTH_SIGMA}) in [{MIN_LEN}, {MAX_LEN}]"


def _spread(n: int, k: int) -> list[int]:
    """k indices spread over 0..n-1 (the first, the last, and between)."""
    k = min(k, n)
    return sorted({round(j * (n - 1) / max(1, k - 1)) for j in range(k)}) if k else []
