"""`memra bench throughput --variants 256,256/512,512,512/512,auto/512`: several scheduler settings run one
after the other on one loaded model and one workload, then one table.

A variant is MAX_BATCH[/PREFILL_BUDGET]: MAX_BATCH a number or `auto` (memra.engine.batch_size),
PREFILL_BUDGET the scheduler's split budget (memra.engine.scheduler; 0: shared with the decode rows; absent:
the engine's default, EngineConfig.split_budget). Each variant builds its engine (warm-up and graph
captures are outside its timing), runs the whole workload, re-runs --check requests alone, and closes its
engine, giving its pools and graphs back before the next one sizes its own. The table has, per variant: output tokens/s, the decode and mixed
steps (count, mean ms, mean rows, mean prompt tokens), the mean host gap between steps, the GPU's idle
share between steps + within them (CUDA events, memra.engine.step_clock; "-" elsewhere), the share of
decode steps under 128 rows (the tail), the mixed steps run as one forward (the rest made two calls:
the decode rows, then an eager prefill) and the graphs captured mid-run,
and whether the alone re-runs matched. Each variant's full report goes to the log first.
"""

from __future__ import annotations

import dataclasses

from memra.errors import MemraError


def parse_variants(text: str) -> list[tuple[int | str, int | None]]:
    """"256,512/512,auto/0" -> [(256, None), (512, 512), ("auto", 0)]; a bad entry is a one-line error."""
    out = []
    for entry in (e.strip() for e in text.split(",")):
        batch, _, budget = entry.partition("/")
        try:
            mb = "auto" if batch == "auto" else int(batch)
            pb = int(budget) if budget else None
        except ValueError:
            mb = pb = 0
        if mb == 0 or (mb != "auto" and mb < 0) or (pb is not None and pb < 0):
            raise MemraError(f"--variants: {entry!r} is not MAX_BATCH[/PREFILL_BUDGET] (e.g. 256, 512/512, auto/512)")
        out.append((mb, pb))
    if not out:
        raise MemraError("--variants needs at least one MAX_BATCH[/PREFILL_BUDGET]")
    return out


def run_variants(cfg, variants: list[tuple[int | str, int | None]], log=print) -> list:
    """Each variant on one loaded model and workload (memra.bench.throughput.run_on). -> their reports."""
    from memra.bench.throughput import prepare, run_on

    configs = [dataclasses.replace(cfg, max_batch=mb, prefill_budget=pb, json_path=None) for mb, pb in variants]
    model, reqs, workload = prepare(cfg)  # every variant's settings checked first, then the one load
    reports = []
    for i, one in enumerate(configs):
        said = "default" if one.prefill_budget is None else one.prefill_budget or "shared"
        log(f"--- variant {i + 1}/{len(configs)}: max_batch {one.max_batch}, prefill budget {said}")
        reports.append(run_on(model, reqs, workload, one, log))
        log(reports[-1].table())
    return reports


def _kind(report, kind: str) -> str:
    t = report.steps.get(kind, {})
    n = t.get("steps", 0)
    if not n:
        return "-"
    return (f"{n} x {1e3 * t['seconds'] / n:.1f} ms, {t['decode_rows'] / n:.0f} rows"
            + (f" + {t['prompt_tokens'] / n:.0f} tok" if kind == "mixed" else ""))


def variants_table(reports: list) -> str:
    """One line a variant (module docstring)."""
    head = (f"{'max_batch':>9} {'prefill':>8} {'out tok/s':>10}  {'decode steps':<28} {'mixed steps':<36} "
            f"{'host gap':>8} {'GPU idle+wait':>13} {'<128 rows':>9} {'1-fwd mixed':>11} {'captures':>8}  exact")
    lines = [f"memra bench throughput variants: {reports[0].model} on {reports[0].device}; {reports[0].workload}",
             f"{reports[0].requests} requests, {reports[0].prompt_tokens} prompt + {reports[0].output_tokens} "
             "output tokens each", head]
    for r in reports:
        kinds = r.steps.values()
        gaps = sum(t["gaps"] for t in kinds)
        gap = f"{1e3 * sum(t['host_gap'] for t in kinds) / gaps:.2f}ms" if gaps else "-"
        idle = f"{100 * r.idle_share:.1f}%+{100 * r.wait_share:.1f}%" if r.idle_share is not None else "-"
        decode_steps = sum(r.decode_row_bins.values())
        tail = sum(n for k, n in r.decode_row_bins.items() if k in ("<32", "<64", "<128"))
        tail_share = f"{100 * tail / decode_steps:.0f}%" if decode_steps else "-"
        exact = "-" if not r.checked else "equal" if not r.check_failures else "DIFFER"
        one = f"{r.one_forward}/{r.steps.get('mixed', {}).get('steps', 0)}"
        lines.append(f"{r.max_batch:>9} {r.prefill_budget or 'shared':>8} {r.output_tps:>10.1f}  "
                     f"{_kind(r, 'decode'):<28} {_kind(r, 'mixed'):<36} {gap:>8} {idle:>13} {tail_share:>9} {one:>11} {r.captures:>8}  {exact}")
    return "\n".join(lines)
