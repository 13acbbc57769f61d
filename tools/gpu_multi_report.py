"""The multi-GPU pipeline report (run through the device tool on nvidia-h200-x2 or -x4, one call):

    python tools/gpu_multi_report.py [--budget 540] [--jobs 4] [--log-dir DIR]
    python tools/gpu_multi_report.py --dry-run [--gpus 4]     # the plan, every run with its doors; no CUDA

Runs (the 0,1,2,3 ones only with >= 4 GPUs; with < 2 GPUs everything is skipped, said, exit 0):

1. gates   `memra gate demo --mode pp` and `--mode ppspec` with MEMRA_PP_DEVICES = 0,1 / 1,0 (/ 0,1,2,3),
           each over peer transport and with MEMRA_PP_HOST_BOUNCE=1, MEMRA_PEER_PROBE=1 (the boot probe
           runs; its ladder must log PASS). Every gate is a child process with its own wall limit; its
           output is parsed for ALL GREEN / FAIL arms / a crash, and for the probe's PASS lines.
2. inproc  per placement, in a child process: the split model built in-process (MEMRA_PP_SHARD=1): every
           stage's layer tensors on that stage's device, memory per device, the probe ladder re-run by
           hand; split == unsplit to the bit against a second, never-sharded copy of the model (peer and
           host bounce); the refusals — unsplit batched walk (MEMRA_BATCH_PP=0), the same under host
           bounce even with MEMRA_PP_ALLOW_UNSPLIT_BATCH=1, the unsplit verify (MEMRA_SPEC_PP=0), and
           MEMRA_PEER_PROBE=0 without host bounce — each must raise PipelineError (not refusing = FAIL);
           MEMRA_PEER_PROBE=0 with host bounce must be accepted (the control).
3. bench   PP-2 on cuda:0,1, random-weight Qwen3.5-9B shape in bf16: decode tok/s at B = 1, 8, 16, 32,
           serial walker (MEMRA_DUAL_PP=0) vs dual-active waves (MEMRA_DUAL_PP=1, MEMRA_PP_OVERLAP=1); and
           the cost the unsplit-walk refusal prevents: B=1 split vs the unsplit walk over sharded weights
           (MEMRA_BATCH_PP=0 + MEMRA_PP_ALLOW_UNSPLIT_BATCH=1, peer reads of every remote weight).
4. dist    `memra gate demo --mode pp --transport dist --stages 2` over NCCL, rank r on cuda:r (memra's
           local launcher puts rank r on rank 0's GPU + r), then B=1 per-token latency: one process
           (graphs on / eager) vs two ranks over NCCL on two GPUs.

Every child keeps NVLink multicast off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
NVSHMEM_DISABLE_NVLS=1). The in-process sections load the model on the LAST stage's device (the "primary"
must hold the head for host bounce, and the pp battery's dual-negative host-bounce cell needs it on every
run) and make it the current CUDA device (Triton launches on the current device). Prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOOLS = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(TOOLS))

GATE_MODEL = "demo"
PLACEMENTS = ((0, 1), (1, 0), (0, 1, 2, 3))
BENCH_BATCHES = (1, 8, 16, 32)
BENCH_PLACEMENT = (0, 1)
# NVLink multicast stays off in every process this report starts (the host's GPUs are shared).
SAFETY_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
# Doors a caller's shell may have set; every child starts without them so its doors are exactly the plan's.
DOOR_PREFIXES = ("MEMRA_PP_", "MEMRA_PEER_PROBE", "MEMRA_BATCH_PP", "MEMRA_PRIME_PP", "MEMRA_PRIME_PIPE",
                 "MEMRA_SPEC_PP", "MEMRA_DUAL_PP", "MEMRA_CUDA_GRAPHS", "MEMRA_GATE_CANARY")
# `memra gate` with the primary made the current CUDA device first: memra's CLI never calls set_device, and
# Triton launches on the current device, so a model on cuda:1 would run its kernels from cuda:0.
BOOT = "import sys, torch; torch.cuda.set_device(int(sys.argv.pop(1))); from memra.cli import main; sys.exit(main(sys.argv[1:]))"
ROW_TAG = "@@ROW "
VERDICT_MAX = 200  # the table must fit the device tool's last 12,000 characters of output
PHASE_SHARE = {"check": 0.45, "bench": 0.75, "dist": 1.0}  # absolute deadlines, as a share of --budget


# ---------------------------------------------------------------------------------------------------
# The plan: every run, its doors and (for child gates) its command. Shared by --dry-run and execution.
# ---------------------------------------------------------------------------------------------------


@dataclass
class Arm:
    label: str
    doors: dict[str, str]
    argv: list[str] | None = None  # a child command (gates); None: runs inside a section child


@dataclass
class Run:
    key: str  # unique; names the log file
    title: str  # the table row (sections may emit several rows)
    kind: str  # gate | inproc | bench | dist-gate | dist-latency
    phase: str  # check | bench | dist (which deadline it runs under)
    min_gpus: int
    arms: list[Arm]
    placement: tuple[int, ...] = ()
    limit_s: float = 150.0
    order: int = 0  # its place in the plan: the table keeps the plan's order whatever finishes first


def dev_list(devs: tuple[int, ...]) -> str:
    return ",".join(map(str, devs))


def pp_doors(devs: tuple[int, ...], host_bounce: bool = False, probe: bool = True, **extra: str) -> dict[str, str]:
    """The in-process placement doors: N stages on `devs`, weights sharded per stage, the boot probe on."""
    d = {"MEMRA_PP_STAGES": str(len(devs)), "MEMRA_PP_DEVICES": dev_list(devs), "MEMRA_PP_SHARD": "1",
         "MEMRA_PEER_PROBE": "1" if probe else "0"}
    if host_bounce:
        d["MEMRA_PP_HOST_BOUNCE"] = "1"
    return {**d, **extra}


def gate_argv(mode: str, devs: tuple[int, ...], plain_cli: bool) -> list[str]:
    args = ["gate", GATE_MODEL, "--device", f"cuda:{devs[-1]}", "--dtype", "bfloat16", "--mode", mode,
            "--stages", str(len(devs))]
    if plain_cli:
        return [sys.executable, "-m", "memra", *args]
    return [sys.executable, "-c", BOOT, str(devs[-1]), *args]


def inproc_arms(devs: tuple[int, ...]) -> list[Arm]:
    return [
        Arm("shard + memory + probe ladder", pp_doors(devs)),
        Arm("split == unsplit, peer", pp_doors(devs)),
        Arm("split == unsplit, host bounce", pp_doors(devs, host_bounce=True)),
        Arm("refuse: unsplit batched walk", pp_doors(devs, MEMRA_BATCH_PP="0")),
        Arm("refuse: unsplit walk under host bounce, override set",
            pp_doors(devs, host_bounce=True, MEMRA_BATCH_PP="0", MEMRA_PP_ALLOW_UNSPLIT_BATCH="1")),
        Arm("refuse: unsplit verify", pp_doors(devs, MEMRA_SPEC_PP="0")),
        Arm("refuse: peer probe off without host bounce", pp_doors(devs, probe=False)),
        Arm("accept: peer probe off with host bounce (control)", pp_doors(devs, host_bounce=True, probe=False)),
    ]


def bench_doors() -> dict[str, dict[str, str]]:
    base = pp_doors(BENCH_PLACEMENT)
    return {
        "split": base,
        "serial": {**base, "MEMRA_DUAL_PP": "0"},
        "dual": {**base, "MEMRA_DUAL_PP": "1", "MEMRA_PP_OVERLAP": "1"},
        # what refuse_unsplit prevents: the whole trunk on cuda:0, stage 1's weights read over peer
        "unsplit": {**base, "MEMRA_BATCH_PP": "0", "MEMRA_PRIME_PP": "0", "MEMRA_PP_ALLOW_UNSPLIT_BATCH": "1",
                    "MEMRA_CUDA_GRAPHS": "0"},
    }


def bench_arms(model: str) -> list[Arm]:
    d = bench_doors()
    arms = [Arm(f"{model} shard + memory per device", d["split"])]
    for b in BENCH_BATCHES:
        arms += [Arm(f"B={b} serial walker", d["serial"]), Arm(f"B={b} dual-active waves", d["dual"])]
    arms += [Arm("peer-read cost B=1: split", d["serial"]),
             Arm("peer-read cost B=1: unsplit over sharded weights (refusal overridden)", d["unsplit"])]
    return arms


DIST_DOORS = {"MEMRA_PP_DIST_BACKEND": "nccl", "MEMRA_PP_DIST_SHARE_GPUS": "0"}


def build_plan(args) -> list[Run]:
    plan: list[Run] = []
    for devs in PLACEMENTS:
        need = max(devs) + 1
        for mode in ("pp", "ppspec"):
            for bounce in (False, True):
                transport = "host bounce" if bounce else "peer"
                plan.append(Run(f"gate-{mode}-{dev_list(devs).replace(',', '')}-{'bounce' if bounce else 'peer'}",
                                f"gate {mode} {dev_list(devs)} {transport}", "gate", "check", need,
                                [Arm(transport, pp_doors(devs, host_bounce=bounce), gate_argv(mode, devs, args.plain_cli))],
                                devs, args.gate_limit))
        plan.append(Run(f"inproc-{dev_list(devs).replace(',', '')}", f"in-process {dev_list(devs)}", "inproc", "check",
                        need, inproc_arms(devs), devs, args.gate_limit))
    plan.append(Run("bench", f"bench PP-2 {dev_list(BENCH_PLACEMENT)}", "bench", "bench", 2, bench_arms(args.bench_model),
                    BENCH_PLACEMENT, 0))
    dist_cmd = [sys.executable, "-m", "memra", "gate", GATE_MODEL, "--device", "cuda:0", "--dtype", "bfloat16",
                "--mode", "pp", "--transport", "dist", "--stages", "2"]
    plan.append(Run("dist-gate", "dist gate 2 ranks nccl", "dist-gate", "dist", 2,
                    [Arm("rank 0 cuda:0, rank 1 cuda:1", dict(DIST_DOORS), dist_cmd)], (0, 1), args.dist_limit))
    plan.append(Run("dist-latency", "dist B=1 latency", "dist-latency", "dist", 2,
                    [Arm("1 process, graphs on", {}), Arm("1 process, eager", {"MEMRA_CUDA_GRAPHS": "0"}),
                     Arm("2 ranks nccl, cuda:0 + cuda:1", dict(DIST_DOORS))], (0, 1), 0))
    plan = [r for r in plan if not args.only or r.kind.split("-")[0] in args.only]
    for i, r in enumerate(plan):
        r.order = i
    return plan


def doors_str(doors: dict[str, str]) -> str:
    return " ".join(f"{k}={v}" for k, v in doors.items()) or "(defaults)"


def short_doors(doors: dict[str, str]) -> str:
    """The table's form: no MEMRA_ prefix; PP_STAGES (= the device count), PP_SHARD=1 and PEER_PROBE=1 left
    implicit (the plan printed first has every door in full)."""
    implied = {"MEMRA_PP_SHARD": "1", "MEMRA_PEER_PROBE": "1"}
    parts = [f"{k.removeprefix('MEMRA_')}={v}" for k, v in doors.items()
             if not (k == "MEMRA_PP_STAGES" and "MEMRA_PP_DEVICES" in doors) and implied.get(k) != v]
    return " ".join(parts) or "(defaults)"


def print_plan(plan: list[Run], gpus: int) -> None:
    print(f"plan for {gpus} GPU(s); every child also gets {doors_str(SAFETY_ENV)}")
    print(f"$BOOT = {BOOT!r}  (the primary made the current CUDA device, then memra's CLI)")
    for r in plan:
        state = "RUN" if gpus >= r.min_gpus else f"SKIP (needs {r.min_gpus} GPUs, {gpus} present)"
        print(f"[{state}] {r.title}  ({r.kind}, phase {r.phase}{f', limit {r.limit_s:.0f}s' if r.limit_s else ''})")
        for a in r.arms:
            print(f"    - {a.label}: {doors_str(a.doors)}")
            if a.argv:
                cmd = " ".join('"$BOOT"' if x == BOOT else x for x in a.argv)
                print(f"      $ {cmd}")


# ---------------------------------------------------------------------------------------------------
# Child processes: own session (a hang takes its workers down with it), own wall limit, clean doors.
# ---------------------------------------------------------------------------------------------------


@dataclass
class ChildResult:
    rc: int | None
    text: str
    timed_out: bool
    secs: float


def child_env(doors: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(DOOR_PREFIXES)}
    return {**env, **SAFETY_ENV, "PYTHONUNBUFFERED": "1", **doors}


def run_child(argv: list[str], doors: dict[str, str], limit_s: float, log: Path | None) -> ChildResult:
    t0 = time.time()
    proc = subprocess.Popen(argv, cwd=ROOT, env=child_env(doors), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    timed_out = False
    try:
        text, _ = proc.communicate(timeout=max(limit_s, 1))
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)  # this child's own process group: it and the ranks it spawned
        text, _ = proc.communicate()
    if log is not None:
        log.write_text(f"$ {' '.join(argv)}\n# doors: {doors_str(doors)}\n# rc={proc.returncode} "
                       f"timed_out={timed_out}\n{text}")
    return ChildResult(proc.returncode, text or "", timed_out, time.time() - t0)


PROBE_LINE = re.compile(r"\bprobe (PASS|PARTIAL|SKIP|BOUNCE)\b")  # the reference's "[pp] ... probe PASS: ..."
ARM_FAIL = re.compile(r"^\s*([\w-]+) \(.*\): FAIL\s*$")  # a Ledger verdict line of a failing arm


def child_verdict(res: ChildResult, limit_s: float) -> tuple[bool, str]:
    """-> (green, verdict) for a `memra gate` child: ALL GREEN / FAIL arms / refused / crash / timeout."""
    lines = res.text.splitlines()
    green = res.rc == 0 and any(ln.startswith("ALL GREEN") for ln in lines)
    last = next((ln.strip() for ln in reversed(lines) if ln.strip()), f"exit code {res.rc}")
    if res.timed_out:
        return False, f"TIMEOUT after {limit_s:.0f}s (last: {last[:120]})"
    if green:
        return True, f"ALL GREEN ({res.secs:.0f}s)"
    if "Traceback (most recent call last)" in res.text:
        return False, f"CRASH: {last[:200]}"
    if res.rc == 2:  # the CLI prints a MemraError (a PipelineError too) as one line and exits 2
        return False, f"REFUSED: {last[:200]}"
    arms = [m.group(1) for ln in lines if (m := ARM_FAIL.match(ln))]
    return False, f"FAIL arms {','.join(arms) or '?'} (rc {res.rc})"


def gate_verdict(res: ChildResult, limit_s: float) -> tuple[bool, str]:
    """child_verdict plus the boot probe's status lines: green needs ALL GREEN and every probe line PASS."""
    green, verdict = child_verdict(res, limit_s)
    probes = [m.group(1) for ln in res.text.splitlines() if (m := PROBE_LINE.search(ln))]
    if not probes:
        return False, verdict + "; probe ladder NOT LOGGED"
    return green and all(p == "PASS" for p in probes), verdict + f"; probe log {'/'.join(probes)}"


def dist_gate_verdict(res: ChildResult, limit_s: float) -> tuple[bool, str]:
    """ALL GREEN, over NCCL, with each rank on its own GPU (read from the gate's rank lines)."""
    green, verdict = child_verdict(res, limit_s)
    backend = next((m.group(1) for ln in res.text.splitlines() if (m := re.search(r"backend=(\w+)", ln))), "?")
    ranks = dict(RANK_LINE.findall(res.text))
    where = ", ".join(f"rank {r} {d}" for r, d in sorted(ranks.items())) or "rank devices not reported"
    own_gpus = len(ranks) >= 2 and len(set(ranks.values())) == len(ranks)
    return (green and backend == "nccl" and own_gpus,
            f"{verdict}; backend {backend}; {where}{'' if own_gpus else ' (NOT one GPU per rank)'}")


RANK_LINE = re.compile(r"rank (\d+): stage \d+, layers \[\d+, \d+\), (cuda(?::\d+)?|cpu)")


def section_argv(run: Run, args, deadline_s: float) -> list[str]:
    argv = [sys.executable, str(Path(__file__).resolve()), "--section", run.kind, "--deadline-s", f"{deadline_s:.0f}",
            "--bench-model", args.bench_model, "--peer-model", args.peer_model, "--bench-steps", str(args.bench_steps),
            "--dist-model", args.dist_model, "--dist-layers", str(args.dist_layers)]
    if args.bench_layers:
        argv += ["--bench-layers", str(args.bench_layers)]
    if run.placement:
        argv += ["--placement", dev_list(run.placement)]
    return argv


def section_rows(res: ChildResult, run: Run, budget_s: float) -> list[dict]:
    """The rows a section child emitted; plus one naming how it ended, if it did not end cleanly."""
    rows = []
    for ln in res.text.splitlines():
        if ln.startswith(ROW_TAG):
            rows.append(json.loads(ln[len(ROW_TAG):]))
    if res.timed_out or res.rc != 0:
        last = next((ln.strip() for ln in reversed(res.text.splitlines()) if ln.strip() and not ln.startswith(ROW_TAG)),
                    f"exit code {res.rc}")
        how = f"TIMEOUT after {budget_s:.0f}s" if res.timed_out else f"CRASH (rc {res.rc})"
        rows.append({"run": run.title, "doors": "", "ok": False, "verdict": f"{how}: {last[:200]}"})
    return rows


# ---------------------------------------------------------------------------------------------------
# The orchestrator
# ---------------------------------------------------------------------------------------------------


@dataclass
class Report:
    start: float
    budget: float
    log_dir: Path | None
    rows: list[dict] = field(default_factory=list)

    def deadline(self, phase: str) -> float:
        return self.start + self.budget * PHASE_SHARE[phase]

    def left(self, phase: str) -> float:
        return self.deadline(phase) - time.time()

    def log(self, key: str) -> Path | None:
        return self.log_dir / f"{key}.log" if self.log_dir else None

    def add(self, run: str, doors: str, ok: bool | None, verdict: str, order: int = 0) -> None:
        self.rows.append({"run": run, "doors": doors, "ok": ok, "verdict": verdict, "order": order})
        print(f"ROW {run} | {doors} | {verdict}", flush=True)


def run_one(rep: Report, run: Run, args) -> None:
    """One plan item: a gate child, or a section child whose rows are collected. Never raises: a problem
    of the report itself becomes a row, so the other runs and the table still come out."""
    try:
        _run_one(rep, run, args)
    except Exception as err:  # noqa: BLE001
        rep.add(run.title, short_doors(run.arms[0].doors), False, f"REPORT ERROR {type(err).__name__}: {err}", run.order)


def _run_one(rep: Report, run: Run, args) -> None:
    left = rep.left(run.phase)
    if left < 20:
        rep.add(run.title, short_doors(run.arms[0].doors), None, f"SKIPPED: budget spent ({run.phase} phase)", run.order)
        return
    limit = left if not run.limit_s else min(run.limit_s, left)
    if run.kind in ("gate", "dist-gate"):
        arm = run.arms[0]
        res = run_child(arm.argv, arm.doors, limit, rep.log(run.key))
        ok, verdict = (gate_verdict if run.kind == "gate" else dist_gate_verdict)(res, limit)
        print(f"== {run.title} [{short_doors(arm.doors)}]: {verdict}\n{_tail(res.text, ok)}", flush=True)
        rep.add(run.title, short_doors(arm.doors), ok, verdict, run.order)
        return
    res = run_child(section_argv(run, args, limit - 10), {}, limit, rep.log(run.key))
    print(f"== {run.title} ({res.secs:.0f}s)\n{_tail(res.text, False, keep=60)}", flush=True)
    for row in section_rows(res, run, limit):
        rep.add(row["run"], row["doors"], row["ok"], row["verdict"], run.order)


def _tail(text: str, ok: bool, keep: int = 15) -> str:
    """A green child's output is summarised by its verdict; a red one keeps its last lines for diagnosis."""
    lines = [ln for ln in text.splitlines() if not ln.startswith(ROW_TAG)]
    if ok:
        lines = [ln for ln in lines if ln.startswith(("ALL GREEN", "pp mode verdict", "ppspec mode verdict", "pp dist"))
                 or "probe" in ln]
    return "\n".join("    | " + ln for ln in lines[-keep:])


def orchestrate(args, gpus: int) -> int:
    rep = Report(time.time(), args.budget, Path(args.log_dir) if args.log_dir else None)
    if rep.log_dir:
        rep.log_dir.mkdir(parents=True, exist_ok=True)
    plan = build_plan(args)
    print_plan(plan, gpus)
    runnable = [r for r in plan if gpus >= r.min_gpus]
    for r in plan:
        if r not in runnable:
            rep.add(r.title, short_doors(r.arms[0].doors), None, f"SKIPPED: needs {r.min_gpus} GPUs, {gpus} present",
                    r.order)
    # Correctness runs (gates, in-process checks) share the GPUs: nothing in them is timed.
    checks = [r for r in runnable if r.phase == "check"]
    with ThreadPoolExecutor(max_workers=max(args.jobs, 1)) as pool:
        list(pool.map(lambda r: run_one(rep, r, args), checks))
    # Timed runs go one at a time, alone on the GPUs.
    for r in runnable:
        if r.phase != "check":
            run_one(rep, r, args)
    print_table(rep, gpus)
    return 0 if all(row["ok"] is not False for row in rep.rows) else 1


def print_table(rep: Report, gpus: int) -> None:
    """The table, last on stdout (and whole in LOG_DIR/table.txt: stdout may come back truncated)."""
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        _table(rep, gpus)
    print(buf.getvalue(), end="", flush=True)
    if rep.log_dir:
        (rep.log_dir / "table.txt").write_text(buf.getvalue())


def _table(rep: Report, gpus: int) -> None:
    import torch

    name = torch.cuda.get_device_name(0) if gpus else "no GPU"
    print(f"\n{gpus}x {name}, torch {torch.__version__}, {time.time() - rep.start:.0f}s of {rep.budget:.0f}s budget")
    print("doors: MEMRA_ dropped; PP_STAGES = the device count, PP_SHARD=1 and PEER_PROBE=1 unless shown; "
          "every door in full in the plan above")
    rows = sorted(rep.rows, key=lambda r: r["order"])  # stable: a section's rows keep their own order
    w = max([len(r["run"]) for r in rows] + [3])
    print(f"{'run':<{w}} | doors | verdict / number")
    for r in rows:
        mark = {True: "ok  ", False: "BAD ", None: "--  "}[r["ok"]]
        print(f"{r['run']:<{w}} | {r['doors'] or '-'} | {mark}{r['verdict'][:VERDICT_MAX]}")
    bad = sum(1 for r in rep.rows if r["ok"] is False)
    print(f"{len(rep.rows)} rows: {bad} not ok, {sum(1 for r in rep.rows if r['ok'] is None)} skipped or informational")


# ---------------------------------------------------------------------------------------------------
# Section children: in-process work (they print @@ROW lines the orchestrator collects)
# ---------------------------------------------------------------------------------------------------


def emit(run: str, doors: dict[str, str] | str, ok: bool | None, verdict: str) -> None:
    d = doors if isinstance(doors, str) else short_doors(doors)
    print(ROW_TAG + json.dumps({"run": run, "doors": d, "ok": ok, "verdict": verdict}), flush=True)


def sync_all() -> None:
    import torch

    for d in range(torch.cuda.device_count()):
        torch.cuda.synchronize(d)


def mem_per_device(devs) -> str:
    import torch

    return ", ".join(f"cuda:{d} {torch.cuda.memory_allocated(d) / 2**20:,.1f} MiB" for d in sorted(set(devs)))


def tensors_of(obj, seen: set[int] | None = None):
    """Every tensor reachable from obj through attributes, lists, tuples and dicts (a superset of what
    memra.pp.shard moves, so a tensor it forgets shows up as misplaced)."""
    import torch

    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
        return
    if isinstance(obj, dict):
        items = list(obj.values())
    elif isinstance(obj, (list, tuple)):
        items = list(obj)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        items = list(vars(obj).values())
    else:
        return
    for item in items:
        yield from tensors_of(item, seen)


def check_shard(model, rt) -> tuple[bool, str]:
    """Each stage's layer tensors on its device; embedding with stage 0; head, final norm, MTP with the last.
    -> (all placed, 'N tensors placed; weights cuda:0 X MiB, ...' or 'MISPLACED ...'). Prints the breakdown."""
    first, last = rt.stages[0].device, rt.stages[-1].device
    owners = [(f"stage {st.index} [{st.layers[0]},{st.layers[1]})", st.device, model.blocks[st.layers[0]:st.layers[1]])
              for st in rt.stages]
    owners += [("embed", first, [model.embed]), ("head+norm+mtp", last, [model.lm_head, model.final_norm, model.mtp])]
    misplaced, by_device, n = [], {}, 0
    for name, dev, objs in owners:
        ts = [t for o in objs for t in tensors_of(o)]
        n += len(ts)
        wrong = [t for t in ts if t.device != dev]
        if wrong:
            misplaced.append(f"{name}: {len(wrong)} tensor(s) on {sorted({str(t.device) for t in wrong})}, want {dev}")
        size = sum(t.numel() * t.element_size() for t in ts)
        by_device[str(dev)] = by_device.get(str(dev), 0) + size
        print(f"  {name}: {len(ts)} tensors, {size / 2**20:,.1f} MiB, want {dev}{', WRONG' if wrong else ''}", flush=True)
    if misplaced:
        return False, "MISPLACED " + "; ".join(misplaced)
    return True, f"{n} tensors placed; weights " + ", ".join(f"{d} {v / 2**20:,.0f} MiB" for d, v in sorted(by_device.items()))


def rerun_probe_ladder(rt) -> str:
    """The boot probe again, by hand (memra logs no ladder line): fixed pattern both ways + the ladder
    through the production slots of every cross-device boundary. -> PASS / BOUNCE / ..."""
    from memra.pp.probe import probe_boundary
    from memra.pp.probe_policy import ladder, probe_pass_status

    copies = mismatches = 0
    for bd in rt.boundaries:
        if bd.cross:
            decision = probe_boundary(rt, bd.index)
            copies += 2 + len(ladder(rt.model.cfg.hidden_size))
            mismatches += decision.mismatches
    return f"{probe_pass_status(copies, 0, mismatches)} ({copies} copies, {mismatches} mismatched bytes)"


def resolve_plan_unsplit(model) -> str:
    """Resolve (and memoize) the decode plan while the model is whole: its on-model check walks the unsplit
    model, which cannot run once weights are sharded across devices (memra.pp.dist does the same)."""
    from memra.decode_plan import decode_plan
    from memra.gate.pp_battery import env

    with env(MEMRA_PP_STAGES=None):
        return decode_plan(model)


def record_reference(model, batches, steps: int, plen: int):
    """Door shut, the never-sharded model: each width's prompts, prime logits, fed tokens and decode rows."""
    from memra.gate.battery import gate_prompts
    from memra.gate.pp_battery import record_reference as reference

    vocab = model.cfg.vocab_size
    return {b: reference(model, gate_prompts(b, plen, 0, vocab), plen + 5 * b + steps + 8, steps) for b in batches}


def replay_split(model, doors: dict[str, str], refs, peer: bool) -> tuple[bool, str]:
    """The same prompts and tokens through the split (stage-owned caches); every bit compared. Live only
    if split walks ran and the boundary bytes went the asked way (peer copies counted iff `peer`)."""
    from memra import counters
    from memra.gate.battery import bits_equal
    from memra.gate.pp_battery import env
    from memra.pp.walk import active_runtime

    bad, cells = [], 0
    before = counters.snapshot()
    with env(**doors):
        rt = active_runtime(model)
        transports = ",".join(bd.transport.kind.value for bd in rt.boundaries)
        for b, (prompts, primed, inputs, rows) in refs.items():
            caches = [rt.new_cache(len(p) + len(inputs) + 8) for p in prompts]
            for i, (p, c) in enumerate(zip(prompts, caches)):
                cells += 1
                if not bits_equal(model.prime(p, c).cpu(), primed[i]):
                    bad.append(f"B={b} prime {i}")
            for s, toks in enumerate(inputs):
                got = model.decode_step_batch(toks, caches).cpu()
                cells += 1
                if not bits_equal(got, rows[s]):
                    bad.append(f"B={b} step {s}")
    d = counters.delta(before)
    live = (f"transports {transports}; split walks +{d['pp_split_walks']}, peer copies +{d['pp_peer_boundary_copies']}, "
            f"dual overlaps +{d['dual_pp_overlaps']}")
    if bad:
        return False, f"BITS DIFFER in {len(bad)}/{cells} cells ({', '.join(bad[:4])}); {live}"
    live_ok = d["pp_split_walks"] > 0 and (d["pp_peer_boundary_copies"] > 0) == peer
    return live_ok, f"bit-identical, {cells} cells (prime logits + decode rows); {live}"


def expect_refusal(doors: dict[str, str], action, caches=()) -> tuple[bool, str]:
    """Run `action` under `doors`: it must raise PipelineError before any cache position moves."""
    from memra.gate.pp_battery import env
    from memra.pp.fence import PipelineError

    pos = [c.pos for c in caches]
    with env(**doors):
        try:
            action()
        except PipelineError as err:
            moved = [c.pos for c in caches] != pos
            return not moved, ("REFUSED" + (" BUT A CACHE MOVED" if moved else "") + f": {err}")
        except Exception as err:  # noqa: BLE001 - a refusal of the wrong kind is a finding, not a crash
            return False, f"raised {type(err).__name__} instead of PipelineError: {err}"
    return False, "did NOT refuse (ran)"


def section_inproc(args) -> None:
    """One placement: shard check, split == unsplit (peer, host bounce), the refusals."""
    import torch

    import memra
    from memra import counters
    from memra.gate.pp_battery import env
    from memra.pp.walk import active_runtime

    devs = tuple(int(d) for d in args.placement.split(","))
    tag, primary = dev_list(devs), devs[-1]
    arms = {a.label: a.doors for a in inproc_arms(devs)}
    torch.cuda.set_device(primary)
    ref = memra.load(GATE_MODEL, device=f"cuda:{primary}", dtype="bfloat16", tokenizer=False)
    model = memra.load(GATE_MODEL, device=f"cuda:{primary}", dtype="bfloat16", tokenizer=False)
    plan = resolve_plan_unsplit(model)
    print(f"in-process {tag}: demo bf16 on cuda:{primary} (primary = last stage), decode plan {plan}", flush=True)

    # ---- the shard, the memory, the probe ----
    doors = arms["shard + memory + probe ladder"]
    mem_before = mem_per_device(devs)
    with env(**doors):
        before = counters.snapshot()
        rt = active_runtime(model)
        probes = counters.delta(before)["pp_peer_probes"]
        ladder = rerun_probe_ladder(rt)
    placed, where = check_shard(model, rt)
    emit(f"shard {tag}", doors, placed, f"{where}; allocated {mem_per_device(devs)} (2 demo copies on cuda:{primary}; "
                                       f"before sharding: {mem_before})")
    cross = sum(bd.cross for bd in rt.boundaries)
    emit(f"probe ladder {tag}", doors, probes == cross and ladder.startswith("PASS"),
         f"boot probes {probes}/{cross} boundaries (counter; the gate rows read their log lines); re-run by hand: {ladder}")

    # ---- split == unsplit, to the bit ----
    refs = record_reference(ref, (1, 4), steps=4, plen=12)
    for label in ("split == unsplit, peer", "split == unsplit, host bounce"):
        ok, verdict = replay_split(model, arms[label], refs, peer=label.endswith("peer"))
        emit(f"{label.replace('split == unsplit', 'split==unsplit')} {tag}", arms[label], ok, verdict)

    # ---- the refusals (each must raise PipelineError; running anyway is a FAIL) ----
    refusals(model, arms, tag)


def refusals(model, arms: dict[str, dict[str, str]], tag: str) -> None:
    """The refusal arms on primed stage-owned caches, then the control (probe off + host bounce: accepted).
    One table row; every message is printed."""
    from memra import counters
    from memra.gate.pp_battery import env
    from memra.pp.probe_policy import PEER_PROBE_REQUIRED_REFUSAL
    from memra.pp.walk import active_runtime

    base = arms["split == unsplit, peer"]
    with env(**base):
        rt = active_runtime(model)
        caches = [rt.new_cache(48) for _ in range(2)]
        for i, c in enumerate(caches):
            model.prime([(11 + 7 * i + 3 * j) % model.cfg.vocab_size for j in range(10)], c)
    toks = [5, 6]
    cases = [
        ("refuse: unsplit batched walk", "batch", lambda: model.decode_step_batch(toks, caches)),
        ("refuse: unsplit walk under host bounce, override set", "bounce+allow", lambda: model.decode_step_batch(toks, caches)),
        ("refuse: unsplit verify", "verify", lambda: model.decode_step_t([5, 6], caches[0].pos, caches[0])),
        ("refuse: peer probe off without host bounce", "probe-off", lambda: model.decode_step_batch(toks, caches)),
    ]
    refused, missed, doors = [], [], []
    for label, short, action in cases:
        ok, msg = expect_refusal(arms[label], action, caches)
        if short == "probe-off" and ok and PEER_PROBE_REQUIRED_REFUSAL not in msg:
            msg += " (not the reference's exact text)"
        print(f"  {label} [{tag}]: {msg}", flush=True)
        (refused if ok else missed).append(short if ok else f"{short} ({msg[:60]})")
        doors.append(" ".join(f"{k.removeprefix('MEMRA_')}={v}" for k, v in arms[label].items() if base.get(k) != v))
    label = "accept: peer probe off with host bounce (control)"
    before = counters.snapshot()
    try:
        with env(**arms[label]):
            model.decode_step_batch(toks, caches)
        bypassed = counters.delta(before)["pp_peer_probe_bypassed"]
        control = f"control (PEER_PROBE=0 HOST_BOUNCE=1) accepted, bypass counted +{bypassed}"
        control_ok = bypassed == 1
    except Exception as err:  # noqa: BLE001 - the control must run; anything else is the finding
        control, control_ok = f"control (PEER_PROBE=0 HOST_BOUNCE=1) FAILED: {type(err).__name__}: {err}"[:120], False
    print(f"  {label} [{tag}]: {control}", flush=True)
    verdict = f"{len(refused)}/{len(cases)} refused ({', '.join(refused) or '-'})"
    if missed:
        verdict += f"; NOT refused: {'; '.join(missed)}"
    emit(f"refusals {tag}", " | ".join(doors), not missed and control_ok, f"{verdict}; {control}")


def decode_rate(model, batch: int, steps: int, doors: dict[str, str], home_cache: bool = False):
    """Decode tok/s of `batch` rows under `doors` (prime, one warm-up step, then `steps` timed steps, each
    read back as a serving loop would). home_cache: caches on the primary (the unsplit arm), not per stage.
    -> (tok/s, counter deltas of the timed steps)."""
    from memra import counters
    from memra.gate.pp_battery import env
    from memra.pp.walk import active_runtime

    plen = 16
    with env(**doors):
        rt = active_runtime(model)
        new = model.new_cache if home_cache or rt is None else rt.new_cache
        caches = [new(plen + steps + 8) for _ in range(batch)]
        for i, c in enumerate(caches):
            model.prime([(7 + 31 * i + j) % model.cfg.vocab_size for j in range(plen)], c)
        toks = model.decode_step_batch([1] * batch, caches).argmax(-1).tolist()
        sync_all()
        before, t0 = counters.snapshot(), time.perf_counter()
        for _ in range(steps):
            toks = model.decode_step_batch(toks, caches).argmax(-1).tolist()
        sync_all()
        secs = time.perf_counter() - t0
        delta = counters.delta(before)
        for c in caches:
            c.free()
    return batch * steps / secs, delta


def build_bench_model(name: str, layers: int | None):
    import torch

    from memra.random_model import random_model

    torch.cuda.set_device(BENCH_PLACEMENT[0])
    model = random_model(name, f"cuda:{BENCH_PLACEMENT[0]}", torch.bfloat16, n_layers=layers)
    plan = resolve_plan_unsplit(model)
    return model, f"{name}{f' ({layers} layers)' if layers else ''} bf16, plan {plan}"


def shard_row(model, what: str) -> None:
    from memra.gate.pp_battery import env
    from memra.pp.walk import active_runtime

    doors = bench_doors()["split"]
    before = mem_per_device(BENCH_PLACEMENT)
    with env(**doors):
        rt = active_runtime(model)
    placed, where = check_shard(model, rt)
    emit(f"shard {what}", doors, placed, f"{where}; allocated {mem_per_device(BENCH_PLACEMENT)} (before: {before})")


def section_bench(args) -> None:
    """Dual-active waves vs the serial walker, B = 1, 8, 16, 32; then the peer-read cost at B=1."""
    t_end = time.time() + args.deadline_s
    doors = bench_doors()
    model, what = build_bench_model(args.bench_model, args.bench_layers)
    print(f"bench: {what}", flush=True)
    shard_row(model, what)
    serial_b1 = None
    last = 0.0
    for b in BENCH_BATCHES:
        if time.time() + 2 * last + 15 > t_end:
            emit(f"B={b} dual vs serial", doors["dual"], None, "SKIPPED: budget spent")
            continue
        t0 = time.time()
        serial, _ = decode_rate(model, b, args.bench_steps, doors["serial"])
        dual, d = decode_rate(model, b, args.bench_steps, doors["dual"])
        last = time.time() - t0
        serial_b1 = serial if b == 1 else serial_b1
        waves = f"waves overlapped {d['dual_pp_overlaps']}x" if b > 1 else "one row: no second wave, same body"
        emit(f"B={b} dual vs serial tok/s", "DUAL_PP=1 OVERLAP=1 vs DUAL_PP=0", b == 1 or d["dual_pp_overlaps"] > 0,
             f"serial {serial:,.1f}  dual {dual:,.1f}  ({100 * (dual / serial - 1):+.1f}%); {waves}")
    peer_read_cost(args, model, what, serial_b1, t_end)


def peer_read_cost(args, model, what: str, split_b1: float | None, t_end: float) -> None:
    """B=1: the split walk vs the unsplit walk over sharded weights (what refuse_unsplit prevents). The
    unsplit walk runs every remote layer's weights over the peer path; if the model cannot run that way
    at all (torch refuses mixed-device operands) the fallback shape is measured instead."""
    doors = bench_doors()
    steps = max(args.bench_steps // 4, 3)
    for attempt in (0, 1):
        if time.time() + 30 > t_end:
            emit("peer-read cost B=1", doors["unsplit"], None, "SKIPPED: budget spent")
            return
        try:
            if split_b1 is None:
                split_b1, _ = decode_rate(model, 1, args.bench_steps, doors["serial"])
            unsplit, _ = decode_rate(model, 1, steps, doors["unsplit"], home_cache=True)
        except Exception as err:  # noqa: BLE001 - not a refusal (overridden): the walk itself could not run
            msg = str(err).splitlines()[0][:160]
            print(f"  unsplit walk over sharded weights failed on {what}: {type(err).__name__}: {msg}", flush=True)
            emit(f"peer-read cost B=1 ({what})", doors["unsplit"], False, f"unsplit walk crashed: {msg}")
            if attempt or args.peer_model == args.bench_model:
                return
            for rt in model.pp_runtimes.values():
                rt.close()
            # (the caller still holds the bench model's weights: an H200 has room for both shapes)
            model, what = build_bench_model(args.peer_model, args.bench_layers)
            shard_row(model, what)
            split_b1 = None
            continue
        emit(f"peer-read cost B=1 ({what})", doors["unsplit"], None,
             f"split {split_b1:,.2f} tok/s vs unsplit peer-read {unsplit:,.2f} tok/s = {split_b1 / unsplit:,.1f}x "
             f"(reference: 28x)")
        return


def section_dist_latency(args) -> None:
    """B=1 per-token latency: one process (graphs on, eager) vs 2 ranks over NCCL, rank r on cuda:r."""
    import torch

    from gpu_pp_dist_report import load, per_token_ms  # the one-GPU dist report's helpers
    from memra.errors import MemraError
    from memra.gate.pp_battery import env
    from memra.pp.dist import launch_local

    torch.cuda.set_device(0)
    spec = args.dist_model
    model = load(spec, "cuda:0", torch.bfloat16, args.dist_layers)
    what = f"{spec}{f' ({args.dist_layers} layers)' if spec.startswith('random:') else ''} bf16"
    prompt = [(7 + 31 * j) % model.cfg.vocab_size for j in range(16)]
    steps = args.bench_steps * 4
    with env(MEMRA_PP_STAGES=None):
        graphs_ms, want = per_token_ms(model, "cuda", prompt, steps)
        with env(MEMRA_CUDA_GRAPHS="0"):
            eager_ms, eager_toks = per_token_ms(model, "cuda", prompt, steps)
    emit(f"1 process B=1 ({what})", "(defaults) / CUDA_GRAPHS=0", None,
         f"graphs {graphs_ms:.3f} ms/token, eager {eager_ms:.3f} ms/token")
    try:
        with env(**DIST_DOORS):
            pipe = launch_local(model, 2)  # rank 1 spawned with LOCAL_RANK = 0 + 1 -> cuda:1
        try:
            print(pipe.description, flush=True)
            dist_ms, got = per_token_ms(pipe, "cuda", prompt, steps)
        finally:
            codes = pipe.shutdown()
    except MemraError as err:
        emit("2 ranks nccl B=1", DIST_DOORS, False, f"FAILED: {err}"[:200])
        return
    ranks = dict(RANK_LINE.findall(pipe.description))
    same = want == eager_toks == got
    emit(f"2 ranks nccl B=1 ({what})", DIST_DOORS, same and codes == {1: 0} and ranks.get("1") == "cuda:1",
         f"{dist_ms:.3f} ms/token ({100 * (dist_ms / eager_ms - 1):+.1f}% vs eager, "
         f"{100 * (dist_ms / graphs_ms - 1):+.1f}% vs graphs); tokens equal {'yes' if same else 'NO'}; "
         f"ranks {ranks}; workers exited {codes}")


SECTIONS = {"inproc": section_inproc, "bench": section_bench, "dist-latency": section_dist_latency}


# ---------------------------------------------------------------------------------------------------


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=float, default=540, help="seconds for the whole report (default 540)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan (every run and its doors); no CUDA")
    ap.add_argument("--gpus", type=int, default=None, help="GPU count to plan for (default: detected; dry run: 4)")
    ap.add_argument("--jobs", type=int, default=4, help="correctness children at once (default 4)")
    ap.add_argument("--only", default="", help="comma list of kinds to run: gate,inproc,bench,dist (default all)")
    ap.add_argument("--log-dir", default=os.environ.get("OUT"), help="full child logs (default $OUT when set)")
    ap.add_argument("--plain-cli", action="store_true",
                    help="run gates as plain `python -m memra gate` (no set_device of the primary first)")
    ap.add_argument("--gate-limit", type=float, default=150, help="wall limit of one in-process gate (default 150s)")
    ap.add_argument("--dist-limit", type=float, default=150, help="wall limit of the dist gate (default 150s)")
    ap.add_argument("--bench-model", default="qwen3.5-9b", help="random-weight shape for the benchmark")
    ap.add_argument("--bench-layers", type=int, default=None, help="layers of the bench shape (default: all)")
    ap.add_argument("--peer-model", default="llama-3-8b",
                    help="shape for the peer-read cost if the bench shape cannot run the unsplit walk")
    ap.add_argument("--bench-steps", type=int, default=16, help="timed decode steps per bench arm (default 16)")
    ap.add_argument("--dist-model", default="random:qwen3.5-9b", help="model of the dist latency (default random:qwen3.5-9b)")
    ap.add_argument("--dist-layers", type=int, default=8, help="layers of a random: dist model (default 8)")
    ap.add_argument("--section", choices=sorted(SECTIONS), help=argparse.SUPPRESS)
    ap.add_argument("--placement", default="", help=argparse.SUPPRESS)
    ap.add_argument("--deadline-s", type=float, default=300, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.only = {k.strip() for k in args.only.split(",") if k.strip()}
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.update(SAFETY_ENV)  # also for anything this process spawns itself (dist workers)
    if args.section:
        SECTIONS[args.section](args)
        return 0
    if args.dry_run:
        print_plan(build_plan(args), 4 if args.gpus is None else args.gpus)
        return 0
    import torch

    gpus = torch.cuda.device_count() if args.gpus is None else min(args.gpus, torch.cuda.device_count())
    if gpus < 2:
        print(f"{gpus} CUDA device(s): every run of this report needs >= 2 GPUs (0,1,2,3 runs need 4); skipped:")
        for r in build_plan(args):
            print(f"  SKIPPED {r.title}: needs {r.min_gpus} GPUs, {gpus} present")
        return 0
    return orchestrate(args, gpus)


if __name__ == "__main__":
    sys.exit(main())
