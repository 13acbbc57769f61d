"""The results of `memra bench model`: one row per cell (BenchResult), what each model was (ModelInfo),
and the report that holds them with the run's config, probes and environment — as the printed table and
as JSON that reads back equal (BenchReport).

The ratios between rows (vs the HF peer, exact vs fast, a user path vs the pooled step) are filled from
this run's rows only (link_ratios), so no number is ever compared with another run's.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Sequence

from memra.bench.config import PATHS, PEERS, BenchConfig
from memra.bench.probes import Probes


@dataclass(frozen=True)
class BenchResult:
    """One cell: a model, a mode (exact | fast | a user path | an HF peer) and a phase (decode at batch B,
    prefill, ttft)."""

    model: str
    weights: str
    mode: str
    phase: str
    batch: int
    status: str = "ok"  # ok | skipped | failed
    tokens: int = 0  # per operation: B (decode), the chunk (prefill), the prompt (ttft)
    seconds: float | None = None  # one operation: a decode step, a chunk, a first token
    tokens_per_s: float | None = None
    roofline_tokens_per_s: float | None = None
    vs_roofline: float | None = None  # tokens_per_s / roofline_tokens_per_s (<= 1 unless the model is wrong)
    vs_hf: float | None = None  # tokens_per_s / the HF peer's, same phase and batch
    vs_hf_static: float | None = None  # tokens_per_s / the HF static-cache peer's, same phase and batch
    vs_fast: float | None = None  # exact rows: exact / fast tokens/s (the exactness overhead target: >= 0.9)
    vs_pooled: float | None = None  # engine / newcache rows: tokens/s / the exact pooled step's, same B
    context: int = 0  # decode: mean context length the roofline assumes
    note: str = ""

    @property
    def key(self) -> tuple[str, str, int]:
        return (self.model, self.phase, self.batch)


@dataclass(frozen=True)
class ModelInfo:
    name: str
    arch: str
    layers: int
    full_layers: int | None  # the shape's real layer count (None for a custom factory's model)
    params: int  # trunk parameters (MTP blocks excluded)
    weight_bytes: int  # trunk bytes in memory
    build_s: float
    hf_peer: str  # how the peer was built, or why there is none
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class BenchReport:
    config: BenchConfig
    probes: Probes
    environment: dict
    models: tuple[ModelInfo, ...]
    rows: tuple[BenchResult, ...]
    wall_s: float

    def row(self, model: str, mode: str, phase: str, batch: int = 1) -> BenchResult:
        for r in self.rows:
            if (r.model, r.mode, r.phase, r.batch) == (model, mode, phase, batch):
                return r
        raise KeyError((model, mode, phase, batch))

    @property
    def failed(self) -> list[BenchResult]:
        return [r for r in self.rows if r.status == "failed"]

    def to_json(self) -> dict:
        return {"schema": 1, "config": self.config.to_json(), "probes": dataclasses.asdict(self.probes),
                "environment": self.environment, "models": [dataclasses.asdict(m) for m in self.models],
                "rows": [dataclasses.asdict(r) for r in self.rows], "wall_s": self.wall_s}

    @classmethod
    def from_json(cls, d: dict) -> "BenchReport":
        models = tuple(ModelInfo(**{**m, "notes": tuple(m["notes"])}) for m in d["models"])
        return cls(BenchConfig.from_json(d["config"]), Probes(**d["probes"]), d["environment"], models,
                   tuple(BenchResult(**r) for r in d["rows"]), d["wall_s"])

    def write_json(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_json(), f, indent=1)

    def table(self) -> str:
        p, env = self.probes, self.environment
        lines = [f"{env.get('device_name', '?')} | torch {env.get('torch')} | transformers {env.get('transformers')}"
                 f" | weights {self.config.weights} | {self.wall_s:.0f} s",
                 f"probes: read {si(p.read_bytes_per_s)}B/s (sum over a large tensor), "
                 f"{p.matmul_dtype} matmul {si(p.matmul_flops_per_s)}FLOP/s (square GEMM) — the roofline's inputs"]
        if env.get("doors"):
            lines.append("doors: " + " ".join(f"{k}={v}" for k, v in sorted(env["doors"].items())))
        for m in self.models:
            layers = f"{m.layers} of {m.full_layers}" if m.full_layers else str(m.layers)
            lines.append(f"{m.name}: {m.arch}, {layers} layers, {si(m.params)} trunk params, "
                         f"{si(m.weight_bytes)}B; HF peer: {m.hf_peer}")
            lines += [f"  note: {n}" for n in m.notes]
        head = ("model", "mode", "phase", "B", "ctx", "tok/s", "ms/op", "roofline", "of roof", "vs HF", "vs HF static",
                "exact/fast", "of pooled", "notes")
        body = [head]
        fmt = lambda x, spec: "-" if x is None else format(x, spec)
        for r in self.rows:
            tps = r.status if r.status != "ok" else fmt(r.tokens_per_s, ".1f")
            ctx = str(r.context) if r.phase == "decode" and r.context else "-"  # the mean context a decode row reads
            body.append((r.model, r.mode, r.phase, str(r.batch), ctx, tps,
                         fmt(None if r.seconds is None else r.seconds * 1e3, ".2f"),
                         fmt(r.roofline_tokens_per_s, ".1f"), fmt(r.vs_roofline, ".1%"),
                         fmt(r.vs_hf, ".2f") + ("x" if r.vs_hf else ""),
                         fmt(r.vs_hf_static, ".2f") + ("x" if r.vs_hf_static else ""),
                         fmt(r.vs_fast, ".3f"), fmt(r.vs_pooled, ".3f"), r.note))
        widths = [max(len(row[i]) for row in body) for i in range(len(head) - 1)]
        lines.append("")
        for row in body:
            lines.append("  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
                         + "  " + row[-1])
        lines.append("")
        lines.append("roofline: decode = B / (bytes a step must read / read bandwidth) — weights once (routed experts: "
                     "expected share under uniform routing), KV of the context, GDN state read+written; prefill/ttft = "
                     "tokens / max(FLOPs / matmul peak, weight bytes / bandwidth). ms/op: one decode step of the batch, "
                     "one prefill chunk, one first token.")
        return "\n".join(lines)


def si(x: float) -> str:
    """1.23 G, 45.6 M, ...: a number with an SI prefix (the unit follows)."""
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= factor:
            return f"{x / factor:.2f} {prefix}"
    return f"{x:.2f} "


def link_ratios(rows: Sequence[BenchResult]) -> tuple[BenchResult, ...]:
    """Fill vs_hf / vs_hf_static (each memra row against the HF peers' rows of the same model, phase and
    batch), vs_fast (each exact row against the fast row of the same cell) and vs_pooled (a user path
    against the exact pooled step) — all from this run's rows only."""
    by = {(r.mode, *r.key): r for r in rows if r.status == "ok" and r.tokens_per_s}
    out = []
    for r in rows:
        if r.status == "ok" and r.tokens_per_s and r.mode not in PEERS:
            hf, static = by.get(("hf", *r.key)), by.get(("hf-static", *r.key))
            fast = by.get(("fast", *r.key))
            pooled = by.get(("exact", *r.key)) if r.mode in PATHS else None
            r = dataclasses.replace(r, vs_hf=r.tokens_per_s / hf.tokens_per_s if hf else None,
                                    vs_hf_static=r.tokens_per_s / static.tokens_per_s if static else None,
                                    vs_fast=r.tokens_per_s / fast.tokens_per_s if fast and r.mode == "exact" else None,
                                    vs_pooled=r.tokens_per_s / pooled.tokens_per_s if pooled else None)
        out.append(r)
    return tuple(out)
