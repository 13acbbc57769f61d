"""`memra bench model --gguf FILE`: one GGUF file on this machine's CPU, memra beside llama.cpp.

Each engine runs in a process of its own (`python -m memra.bench.gguf_file ENGINE FILE ...`, which
prints one JSON line), so the memory it reports is its own:
- `rss`: resident memory after load minus resident memory before it (the interpreter and imports: memra's
  engine modules are imported first, as llama.cpp's run imports llama_cpp first);
- `peak`: the process's high-water mark (VmHWM), imports included; `peak - base`: that mark less the
  resident memory before load (what loading and decoding the model took at their worst).
Decode is one sequence (B=1; `--batch B` adds B rows at once: memra.bench.gguf_batched), greedy, `tokens` new tokens after the same 16-token prompt of ids
10..25 (valid in any vocabulary, so both engines read the same tokens without sharing a tokenizer).
It is timed from the first generated token to the last:
- memra: memra.LLM.stream, the loop `memra generate` runs, with the loader's default packing (Q8_0
  stays packed on CPU: memra.kernels.quant);
- llama.cpp: llama_cpp.Llama.generate with top_k=1, on the same thread count, no GPU layers.
Both engines' processes get the same OMP_WAIT_POLICY (`--omp-wait`, default passive): both thread through
OpenMP (torch's libgomp and memra's C kernels; llama.cpp's CPU backend), and on cores shared with other
work the default (spinning waits) collapsed memra's 2-thread step 20x (a 300M Q8_0 token 865 ms against
37 passive, load 6 on 2 cores): a waiting thread burns the slice the thread it waits for needs.
The peer runs only where llama_cpp is importable (pip install llama-cpp-python); otherwise its row
says so. Linux only for the memory columns (/proc/self/status); elsewhere they are blank.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from memra.errors import MemraError

ENGINES = ("memra", "llama.cpp")
PROMPT = list(range(10, 26))
MIB = 2**20


@dataclass(frozen=True)
class GgufRun:
    """One engine's numbers on the file, or why there are none."""

    engine: str
    threads: int = 1
    batch: int = 1
    load_s: float | None = None
    rss_bytes: int | None = None
    base_bytes: int | None = None  # resident before load (the interpreter and imports)
    peak_bytes: int | None = None
    tok_s: float | None = None
    row0: tuple[int, ...] | None = None  # the first row's tokens (the B=1 prompt's)
    error: str | None = None
    low: float | None = None  # with repeats: the slowest run's tok/s (tok_s is the fastest's)


def _status_bytes(field: str) -> int | None:
    """A VmRSS / VmHWM line of /proc/self/status in bytes, or None off Linux."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _memra(path: str, tokens: int, threads: int, batch: int = 1) -> dict:
    import torch

    import memra

    torch.set_num_threads(threads)
    if batch > 1:
        from memra.bench.gguf_batched import memra_batch

        return memra_batch(path, tokens, batch)
    # memra's package imports its modules on first use (PEP 562): resolve memra.LLM now, so that the baseline
    # holds the engine's imports (10 MiB: gguf and tokenizers among them) as llama.cpp's holds `import llama_cpp`
    # (27 MiB); the modules memra.LLM imports when it loads (the loaders, the model's) are still counted
    LLM = memra.LLM
    before, t0 = _status_bytes("VmRSS"), time.perf_counter()
    llm = LLM(path, device="cpu", max_batch=1, max_ctx=len(PROMPT) + tokens + 1)
    load_s, after = time.perf_counter() - t0, _status_bytes("VmRSS")
    times: list[float] = []  # when each token reached its reader; no end token, as llama.cpp's generate
    row0: list[int] = []
    llm.engine.submit(PROMPT, memra.SamplingParams(max_tokens=tokens, temperature=0.0),
                      lambda ev: ev.token_id is not None and (times.append(time.perf_counter()), row0.append(ev.token_id)))
    llm.engine.run_until_idle()
    return dict(load_s=load_s, rss_bytes=_delta(before, after), base_bytes=before, tok_s=_rate(times), row0=row0)


def _llama_cpp(path: str, tokens: int, threads: int, batch: int = 1) -> dict:
    import llama_cpp

    if batch > 1:
        from memra.bench.gguf_batched import llama_cpp_batch

        return llama_cpp_batch(path, tokens, batch, threads)

    before, t0 = _status_bytes("VmRSS"), time.perf_counter()
    llm = llama_cpp.Llama(path, n_ctx=len(PROMPT) + tokens + 8, n_threads=threads, n_threads_batch=threads, n_gpu_layers=0, verbose=False)
    load_s, after = time.perf_counter() - t0, _status_bytes("VmRSS")
    times: list[float] = []
    row0: list[int] = []
    for tok in llm.generate(PROMPT, top_k=1, temp=0.0):
        times.append(time.perf_counter())
        row0.append(int(tok))
        if len(times) == tokens:
            break
    return dict(load_s=load_s, rss_bytes=_delta(before, after), base_bytes=before, tok_s=_rate(times), row0=row0)


def _rate(times: list[float]) -> float | None:
    """Decode tokens/s from the times tokens arrived: the first one ends the prefill."""
    return (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 and times[-1] > times[0] else None


def _delta(before: int | None, after: int | None) -> int | None:
    return after - before if before is not None and after is not None else None


def measure(engine: str, path: str, tokens: int, threads: int, batch: int = 1, omp_wait: str = "passive",
            timeout_s: float = 1800.0) -> GgufRun:
    """One engine on the file, in a process of its own (OMP_WAIT_POLICY=omp_wait; "default": the inherited)."""
    from memra.settings import process_env

    env = dict(process_env())
    if omp_wait != "default":
        env["OMP_WAIT_POLICY"] = omp_wait.upper()
    cmd = [sys.executable, "-m", "memra.bench.gguf_file", engine, path, "--tokens", str(tokens),
           "--threads", str(threads), "--batch", str(batch)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return GgufRun(engine, threads, batch, error=f"no result within {timeout_s:.0f} s")
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        why = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        return GgufRun(engine, threads, batch, error=why)
    got = json.loads(lines[-1])
    got["row0"] = tuple(got.get("row0") or ()) or None
    return GgufRun(engine, threads, batch, **got)


def run_gguf_bench(path: str, tokens: int, threads: int | tuple[int, ...] | None = None, batch: int = 1,
                   log=lambda line: None, omp_wait: str = "passive", repeats: int = 1) -> list[GgufRun]:
    """memra, then llama.cpp (where importable), on the GGUF at `path`: B=1 at each thread count, then B=batch
    (where batch > 1) at each; each pair `repeats` times, alternating, the fastest of each engine kept (on
    shared cores a run's rate is the share of the machine it got; the spread is reported)."""
    if not Path(path).is_file():
        raise MemraError(f"--gguf {path}: no such file")
    if tokens < 2:
        raise MemraError(f"--steps must be at least 2 to time decode (the first token ends the prefill), got {tokens}")
    counts = (threads,) if isinstance(threads, int) else tuple(threads or (_default_threads(),))
    runs = []
    for b in (1, batch) if batch > 1 else (1,):
        for t in counts:
            tries = []
            for i in range(repeats):
                for engine in ENGINES:
                    log(f"[bench gguf] {engine}: {Path(path).name}, B={b}, {tokens} tokens a row on {t} threads"
                        f" ({i + 1} of {repeats})")
                    tries.append(measure(engine, path, tokens, t, b, omp_wait))
            runs += [_fastest([r for r in tries if r.engine == engine]) for engine in ENGINES]
    return runs


def _fastest(tries: list[GgufRun]) -> GgufRun:
    """The fastest of one engine's runs of a cell, with the slowest rate beside it."""
    ok = [r for r in tries if r.tok_s]
    if not ok:
        return tries[0]
    best = max(ok, key=lambda r: r.tok_s)
    return replace(best, low=min(r.tok_s for r in ok)) if len(ok) > 1 else best


def _default_threads() -> int:
    import torch

    return torch.get_num_threads()


def gguf_table(path: str, runs: list[GgufRun]) -> str:
    """The report: one row per engine, thread count and batch; memory in MiB and as a multiple of the file's
    size; the rate against llama.cpp's at the same threads and batch; for a B > 1 row, whether its first
    row's tokens are the engine's B=1 tokens at the same threads."""
    size = Path(path).stat().st_size
    peer = {(r.threads, r.batch): r.tok_s for r in runs if r.engine == "llama.cpp" and r.tok_s}
    solo = {(r.engine, r.threads): r.row0 for r in runs if r.batch == 1 and r.row0}
    head = (f"{'engine':10s}  {'thr':>3s}  {'B':>3s}  {'load s':>7s}  {'RSS after load':>14s}  {'x file':>6s}  "
            f"{'peak - base':>11s}  {'x file':>6s}  {'decode tok/s':>12s}  {'(slowest)':>9s}  {'vs llama.cpp':>12s}  "
            f"{'row 0 = B=1':>11s}")
    lines = [f"{Path(path).name}: {size / MIB:.1f} MiB, CPU, greedy", head]
    for r in runs:
        if r.error:
            lines.append(f"{r.engine:10s}  {r.threads:3d}  {r.batch:3d}  not run: {r.error}")
            continue
        rss = f"{r.rss_bytes / MIB:.0f} MiB" if r.rss_bytes is not None else "-"
        ratio = f"{r.rss_bytes / size:.2f}" if r.rss_bytes is not None else "-"
        grew = _delta(r.base_bytes, r.peak_bytes)
        grew_s, grew_x = (f"{grew / MIB:.0f} MiB", f"{grew / size:.2f}") if grew is not None else ("-", "-")
        ref = peer.get((r.threads, r.batch))
        vs = f"{r.tok_s / ref:.2f}" if ref and r.tok_s else "-"
        same = "-" if r.batch == 1 or not solo.get((r.engine, r.threads)) else (
            "yes" if r.row0 == solo[(r.engine, r.threads)] else "no")
        load = f"{r.load_s:7.2f}" if r.load_s is not None else f"{'-':>7s}"
        low = f"{r.low:.1f}" if r.low is not None else "-"
        lines.append(f"{r.engine:10s}  {r.threads:3d}  {r.batch:3d}  {load}  {rss:>14s}  {ratio:>6s}  {grew_s:>11s}  "
                     f"{grew_x:>6s}  {r.tok_s or 0:12.1f}  {low:>9s}  {vs:>12s}  {same:>11s}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m memra.bench.gguf_file", description="one engine's run (see module doc)")
    p.add_argument("engine", choices=ENGINES)
    p.add_argument("path")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--batch", type=int, default=1)
    args = p.parse_args(argv)
    if args.engine == "llama.cpp":
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            print("llama_cpp is not importable here (pip install llama-cpp-python)", file=sys.stderr)
            return 2
    run = (_memra if args.engine == "memra" else _llama_cpp)(args.path, args.tokens, args.threads, args.batch)
    run["peak_bytes"] = _status_bytes("VmHWM")
    print(json.dumps(run))
    return 0


if __name__ == "__main__":
    sys.exit(main())
