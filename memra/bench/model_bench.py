"""`memra bench model`: random-weight models of real shapes, measured against this device's own limits.

One process, one device, no download. For each model shape (memra.random_model.SHAPES) it measures:

- memra decode tokens/s at each batch width B (from primed caches, device-synced, after warm-up),
  in the exact mode and in the non-exact fast path (MEMRA_EXACT=0) — the exact overhead target is
  exact >= 0.9 x fast at every B;
- prefill tokens/s over one chunk (default 4096 tokens) and time to first token (prime of a prompt,
  then the first greedy token on the host);
- the same phases with Hugging Face transformers `generate` on the same weights (shared with memra's
  tensors, not copied) on the same device: the peer.

Every number gets two yardsticks measured in the same run:
- a roofline from two probes (read bandwidth: a sum over a large tensor; matmul peak: a large GEMM):
  decode is bound by the bytes a step must read (weights once + each sequence's KV/recurrent state),
  prefill by max(FLOPs / matmul peak, weight bytes / bandwidth);
- the HF peer's tokens/s for the same phase and batch.

Cells that do not fit the time budget are recorded as skipped, cells that fail as failed (with the
error) — the report always has every requested cell. Importable: `run_bench(BenchConfig(...))`.

Weights: "bf16", or "q8_0" / "q4_k": every 2-D projection kept packed in that GGUF format and run by
the fused dequantizing kernels (memra.kernels.quant); its roofline counts the packed bytes. The HF
peer runs only for bf16 (it has no kernels for these packed formats).

This module is the driver: it walks models and cells, keeps the budget, and records every cell. What
it measures lives beside it in memra.bench: probes, roofline, memra_cells, user_paths, hf_peer, fit;
the results and their table in report; the command line in command.
"""

from __future__ import annotations

import contextlib
import gc
import platform
import sys
import time
from typing import Callable

import torch

from memra.bench.config import MODES, PATHS, PEERS, WEIGHT_FORMATS, BenchConfig
from memra.bench.fit import fit_layers
from memra.bench.hf_peer import hf_notes, hf_peer, time_hf_decode, time_hf_first_token
from memra.bench.memra_cells import mode_view, prompt_ids, time_decode, time_prefill, time_ttft
from memra.bench.probes import Probes
from memra.bench.report import BenchReport, BenchResult, ModelInfo, link_ratios, si
from memra.bench.roofline import (roofline_decode_tokens_per_s, roofline_prefill_tokens_per_s, tensor_bytes,
                                  tensor_numel, trunk_weights)
from memra.bench.timing import Timing, sync
from memra.errors import MemraError
from memra.kernels.table import linear_module
from memra.random_model import SHAPES
from memra.settings import process_env, show_progress


def _environment(device: torch.device) -> dict:
    try:
        import transformers

        tf = transformers.__version__
    except ImportError:
        tf = None
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or platform.machine())
    from memra import __version__

    return {"device": str(device), "device_name": name, "torch": torch.__version__, "transformers": tf,
            "memra": __version__, "python": platform.python_version(), "cuda": torch.version.cuda,
            # the MEMRA_* doors set for this run (each cell's mode sets MEMRA_EXACT for its own view)
            "doors": {k: v for k, v in process_env().items() if k.startswith("MEMRA_") and k != "MEMRA_EXACT"}}

class _Progress:
    """A tqdm bar on an interactive terminal only: in CI or a log file it is noise."""

    def __init__(self, total: int, enabled: bool | None):
        if enabled is None:
            enabled = show_progress()
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc="bench", unit="cell", file=sys.stderr)

    def step(self, label: str) -> None:
        if self.bar is not None:
            self.bar.set_description(label)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def planned_cells(cfg: BenchConfig, model: str) -> list[tuple[str, str, int]]:
    """Every (mode, phase, batch) cell of one model, in run order: memra modes first, then the peers."""
    modes = [m for m in cfg.exact_modes if m in MODES] + [p for p in PEERS if p in cfg.peers]
    cells = [(mode, phase, b) for mode in modes
             for phase, batches in (("decode", cfg.batches), ("prefill", (1,)), ("ttft", (1,))) for b in batches]
    return cells + [(mode, "decode", b) for mode in cfg.exact_modes if mode in PATHS for b in cfg.batches]

class _Run:
    """One benchmark run's state: the rows so far, the clock and the budget."""

    def __init__(self, cfg: BenchConfig, clock: Callable[[], float], log: Callable[[str], None], progress: bool | None):
        self.cfg, self.clock, self.log = cfg, clock, log
        self.start = clock()
        self.rows: list[BenchResult] = []
        self.models: list[ModelInfo] = []
        self.bar = _Progress(sum(len(planned_cells(cfg, m)) for m in cfg.models), progress)

    def over_budget(self) -> bool:
        return self.cfg.budget_s is not None and self.clock() - self.start >= self.cfg.budget_s

    def record(self, row: BenchResult) -> None:
        self.rows.append(row)
        self.bar.step(f"{row.model} {row.mode} {row.phase}" + (f" B={row.batch}" if row.phase == "decode" else ""))

    def cell(self, name: str, mode: str, phase: str, batch: int, measure: Callable[[], Timing],
             roofline: Callable[[Timing], float] | None, note: str = "") -> None:
        base = dict(model=name, weights=self.cfg.weights, mode=mode, phase=phase, batch=batch)
        if self.over_budget():
            self.record(BenchResult(**base, status="skipped",
                                    note=f"time budget of {self.cfg.budget_s:g} s spent before this cell"))
            return
        try:
            t = measure()
        except Exception as e:  # noqa: BLE001 — a failed cell is recorded with its error, and the run goes on
            error = f"{type(e).__name__}: {e}"[:300]
        else:
            error = None
        if error is not None:
            _free_device(torch.device(self.cfg.device))  # here, once the traceback no longer holds the cell's tensors
            self.record(BenchResult(**base, status="failed", note=error))
            return
        tps = t.tokens / t.seconds
        roof = roofline(t) if roofline is not None else None
        self.record(BenchResult(**base, tokens=t.tokens, seconds=t.seconds, tokens_per_s=tps,
                                roofline_tokens_per_s=roof, vs_roofline=tps / roof if roof else None,
                                context=t.context, note=note))

    def skip_model(self, name: str, why: str, status: str = "skipped") -> None:
        for mode, phase, b in planned_cells(self.cfg, name):
            self.record(BenchResult(name, self.cfg.weights, mode, phase, b, status=status, note=why))


def _free_device(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_bench(cfg: BenchConfig, *, clock: Callable[[], float] = time.perf_counter,
              log: Callable[[str], None] | None = None, progress: bool | None = None) -> BenchReport:
    """Run every cell of `cfg` and return the report (also written to cfg.json_path when set).

    `clock` measures the budget (tests pass a fake one); `log` receives one line per event (model
    built, peer built); `progress` forces the tqdm bar on or off (default: on a TTY outside CI)."""
    log = log or (lambda line: None)
    device = torch.device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise MemraError("--device cuda but CUDA is not available here; use --device cpu")
    run = _Run(cfg, clock, log, progress)
    probes = Probes.measure(device, cfg.dtype, cfg.repeats)
    log(f"probes: read {si(probes.read_bytes_per_s)}B/s, matmul {si(probes.matmul_flops_per_s)}FLOP/s")
    env = _environment(device)

    def report() -> BenchReport:
        return BenchReport(cfg, probes, env, tuple(run.models), link_ratios(run.rows), clock() - run.start)

    try:
        for i, name in enumerate(cfg.models):
            _bench_model(run, name, device, probes)
            _free_device(device)  # the model (and its HF peer) went out of scope with _bench_model
            if cfg.json_path and i < len(cfg.models) - 1:  # a partial report, so a later crash keeps these numbers
                report().write_json(cfg.json_path)
    finally:
        run.bar.close()
    final = report()
    if cfg.json_path:
        final.write_json(cfg.json_path)
    return final


def _build(run: _Run, name: str, device: torch.device):
    cfg = run.cfg
    requested, note = cfg.layers_for(name), None
    if cfg.model_factory is None and device.type == "cuda":
        _free_device(device)
        requested, note = fit_layers(name, requested, cfg, torch.cuda.mem_get_info(device)[0])
    factory = cfg.model_factory
    if factory is None:
        from memra.random_model import random_model

        quant = WEIGHT_FORMATS[cfg.weights][1]
        factory = lambda *a: random_model(*a, quant=quant)  # noqa: E731
    t0 = time.perf_counter()
    model = factory(name, device, cfg.dtype, requested, cfg.seed)
    sync(device)
    return model, time.perf_counter() - t0, note


def _bench_model(run: _Run, name: str, device: torch.device, probes: Probes) -> None:
    cfg = run.cfg
    if run.over_budget():
        run.skip_model(name, f"time budget of {cfg.budget_s:g} s spent before this model was built")
        return
    try:
        model, build_s, fit_note = _build(run, name, device)
    except (MemraError, RuntimeError) as e:
        _free_device(device)
        run.skip_model(name, f"could not build: {type(e).__name__}: {e}"[:300], status="failed")
        return
    run.log(f"built {model!r} in {build_s:.1f} s")
    mcfg, bw, peak = model.cfg, probes.read_bytes_per_s, probes.matmul_flops_per_s
    trunk = trunk_weights(model)
    notes = [fit_note] if fit_note else []
    full = SHAPES[name]().n_layers if name in SHAPES else None

    # Rooflines depend only on the model and the probes; computed now, while memra's model is alive.
    decode_roof = lambda t: roofline_decode_tokens_per_s(model, t.tokens, bw, context=t.context)
    prefill_roof = lambda t: roofline_prefill_tokens_per_s(model, t.tokens, bw, peak)
    roofs = {("decode", b): roofline_decode_tokens_per_s(model, b, bw, context=cfg.prompt_tokens + cfg.decode_steps // 2)
             for b in cfg.batches}
    roofs[("prefill", 1)] = roofline_prefill_tokens_per_s(model, cfg.prefill_chunk, bw, peak)
    roofs[("ttft", 1)] = roofline_prefill_tokens_per_s(model, cfg.ttft_tokens, bw, peak)

    for mode in (m for m in cfg.exact_modes if m in MODES):
        view = mode_view(model, mode)
        for b in cfg.batches:
            run.cell(name, mode, "decode", b,
                     lambda: time_decode(view, b, cfg.decode_steps, cfg.warmup, cfg.prompt_tokens, cfg.seed),
                     decode_roof)
        run.cell(name, mode, "prefill", 1, lambda: time_prefill(view, cfg.prefill_chunk, cfg.repeats, cfg.seed),
                 prefill_roof)
        run.cell(name, mode, "ttft", 1, lambda: time_ttft(view, cfg.ttft_tokens, cfg.repeats, cfg.seed),
                 prefill_roof)

    _bench_paths(run, name, model, decode_roof)
    if any(r.model == name and r.mode == "exact" and r.phase == "decode" and r.status == "ok" for r in run.rows):
        notes.append(f"exact decode plan: {_exact_plan(model)}")  # already resolved (and cached) by those cells
    hf_how = "off (--no-hf)"
    if cfg.peers and WEIGHT_FORMATS[cfg.weights][1] is not None:
        hf_how = f"off (the HF peer runs bf16 weights; these are {cfg.weights})"
    elif cfg.peers:
        hf_how = _bench_peer(run, name, model, roofs)
    run.models.append(ModelInfo(name, mcfg.arch, mcfg.n_layers, full, sum(tensor_numel(t) for t in trunk.values()),
                                sum(tensor_bytes(t) for t in trunk.values()), build_s, hf_how,
                                tuple(notes)))


def _bench_paths(run: _Run, name: str, model, decode_roof) -> None:
    """The engine and new_cache cells (memra.bench.user_paths), in the exact mode."""
    from memra.bench.user_paths import time_engine_decode, time_new_cache_decode

    cfg, model = run.cfg, mode_view(model, "exact")
    timers = {"engine": time_engine_decode, "newcache": time_new_cache_decode}
    for mode in (m for m in cfg.exact_modes if m in PATHS):
        for b in cfg.batches:
            prompts = [prompt_ids(model.cfg.vocab_size, cfg.prompt_tokens, i, cfg.seed) for i in range(b)]
            run.cell(name, mode, "decode", b,
                     lambda: timers[mode](model, b, cfg.decode_steps, cfg.warmup, prompts), decode_roof)


def _exact_plan(model) -> str:
    """The plan exact decode used (memra.decode_plan: row | stacked | bucket) — it decides exact speed."""
    from memra.decode_plan import decode_plan

    try:
        return decode_plan(mode_view(model, "exact"))
    except MemraError as e:
        return f"refused ({e})"


def _bench_peer(run: _Run, name: str, model, roofs: dict) -> str:
    """The HF peers' cells for one model (one HF model serves both). -> how the peer was built (or why
    it was not)."""
    cfg, device, mcfg = run.cfg, model.device, model.cfg
    peer_cells = [(mode, phase, b) for mode, phase, b in planned_cells(cfg, name) if mode in PEERS]
    if run.over_budget():
        for mode, phase, b in peer_cells:
            run.record(BenchResult(name, cfg.weights, mode, phase, b, status="skipped",
                                   note=f"time budget of {cfg.budget_s:g} s spent before the peer was built"))
        return "skipped (time budget)"
    try:
        hf, how = hf_peer(model)
    except (MemraError, RuntimeError) as e:
        why = f"no HF peer: {e}"[:300]
        for mode, phase, b in peer_cells:
            run.record(BenchResult(name, cfg.weights, mode, phase, b, status="skipped", note=why))
        return why
    run.log(f"HF peer for {name}: {how}")
    note = hf_notes(hf, mcfg)
    vocab = mcfg.vocab_size
    fixed = lambda key: (lambda t: roofs[key])
    # torch's own cuBLAS flags for the peer where the door changed them (memra's linears past 64 rows on cuBLAS)
    flags = linear_module("cublas").torch_defaults() if model.ops.cublas_linear else contextlib.nullcontext()
    with flags:
        for mode in (p for p in PEERS if p in cfg.peers):
            static = mode == "hf-static"
            for b in cfg.batches:
                run.cell(name, mode, "decode", b,
                         lambda: time_hf_decode(hf, vocab, b, cfg.decode_steps, cfg.warmup, cfg.prompt_tokens, device,
                                                cfg.seed, static), fixed(("decode", b)), note)
            run.cell(name, mode, "prefill", 1, lambda: time_hf_first_token(hf, vocab, cfg.prefill_chunk, cfg.repeats,
                                                                            device, cfg.seed, static),
                     fixed(("prefill", 1)), note)
            run.cell(name, mode, "ttft", 1, lambda: time_hf_first_token(hf, vocab, cfg.ttft_tokens, cfg.repeats,
                                                                         device, cfg.seed + 1, static),
                     fixed(("ttft", 1)), note)
    return how
