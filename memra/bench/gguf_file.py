"""`memra bench model --gguf FILE`: one GGUF file on this machine's CPU, memra beside llama.cpp.

Each engine runs in a process of its own (`python -m memra.bench.gguf_file ENGINE FILE ...`, which
prints one JSON line), so the memory it reports is its own:
- `rss`: resident memory after load minus resident memory before it (the interpreter and imports);
- `peak`: the process's high-water mark (VmHWM), imports included; `peak - base`: that mark less the
  resident memory before load (what loading and decoding the model took at their worst).
Decode is one sequence (B=1), greedy, `tokens` new tokens after the same 16-token prompt of ids
10..25 (valid in any vocabulary, so both engines read the same tokens without sharing a tokenizer).
It is timed from the first generated token to the last:
- memra: memra.LLM.stream, the loop `memra generate` runs, with the loader's default packing (Q8_0
  stays packed on CPU: memra.kernels.quant);
- llama.cpp: llama_cpp.Llama.generate with top_k=1, on the same thread count, no GPU layers.
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
from dataclasses import dataclass
from pathlib import Path

from memra.errors import MemraError

ENGINES = ("memra", "llama.cpp")
PROMPT = list(range(10, 26))
MIB = 2**20


@dataclass(frozen=True)
class GgufRun:
    """One engine's numbers on the file, or why there are none."""

    engine: str
    load_s: float | None = None
    rss_bytes: int | None = None
    base_bytes: int | None = None  # resident before load (the interpreter and imports)
    peak_bytes: int | None = None
    tok_s: float | None = None
    error: str | None = None


def _status_bytes(field: str) -> int | None:
    """A VmRSS / VmHWM line of /proc/self/status in bytes, or None off Linux."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _memra(path: str, tokens: int, threads: int) -> dict:
    import torch

    import memra

    torch.set_num_threads(threads)
    before, t0 = _status_bytes("VmRSS"), time.perf_counter()
    llm = memra.LLM(path, device="cpu", max_batch=1, max_ctx=len(PROMPT) + tokens + 1)
    load_s, after = time.perf_counter() - t0, _status_bytes("VmRSS")
    times: list[float] = []  # when each token reached its reader; no end token, as llama.cpp's generate
    llm.engine.submit(PROMPT, memra.SamplingParams(max_tokens=tokens, temperature=0.0),
                      lambda ev: ev.token_id is not None and times.append(time.perf_counter()))
    llm.engine.run_until_idle()
    return dict(load_s=load_s, rss_bytes=_delta(before, after), base_bytes=before, tok_s=_rate(times))


def _llama_cpp(path: str, tokens: int, threads: int) -> dict:
    import llama_cpp

    before, t0 = _status_bytes("VmRSS"), time.perf_counter()
    llm = llama_cpp.Llama(path, n_ctx=len(PROMPT) + tokens + 8, n_threads=threads, n_threads_batch=threads, n_gpu_layers=0, verbose=False)
    load_s, after = time.perf_counter() - t0, _status_bytes("VmRSS")
    times: list[float] = []
    for _ in llm.generate(PROMPT, top_k=1, temp=0.0):
        times.append(time.perf_counter())
        if len(times) == tokens:
            break
    return dict(load_s=load_s, rss_bytes=_delta(before, after), base_bytes=before, tok_s=_rate(times))


def _rate(times: list[float]) -> float | None:
    """Decode tokens/s from the times tokens arrived: the first one ends the prefill."""
    return (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 and times[-1] > times[0] else None


def _delta(before: int | None, after: int | None) -> int | None:
    return after - before if before is not None and after is not None else None


def measure(engine: str, path: str, tokens: int, threads: int, timeout_s: float = 1800.0) -> GgufRun:
    """One engine on the file, in a process of its own."""
    cmd = [sys.executable, "-m", "memra.bench.gguf_file", engine, path, "--tokens", str(tokens),
           "--threads", str(threads)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return GgufRun(engine, error=f"no result within {timeout_s:.0f} s")
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        why = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        return GgufRun(engine, error=why)
    return GgufRun(engine, **json.loads(lines[-1]))


def run_gguf_bench(path: str, tokens: int, threads: int | None = None, log=lambda line: None) -> list[GgufRun]:
    """memra, then llama.cpp (where importable), on the GGUF at `path`."""
    if not Path(path).is_file():
        raise MemraError(f"--gguf {path}: no such file")
    if tokens < 2:
        raise MemraError(f"--steps must be at least 2 to time decode (the first token ends the prefill), got {tokens}")
    threads = threads or _default_threads()
    runs = []
    for engine in ENGINES:
        log(f"[bench gguf] {engine}: loading {Path(path).name} and decoding {tokens} tokens on {threads} threads")
        runs.append(measure(engine, path, tokens, threads))
    return runs


def _default_threads() -> int:
    import torch

    return torch.get_num_threads()


def gguf_table(path: str, runs: list[GgufRun]) -> str:
    """The report: one row per engine, memory in MiB and as a multiple of the file's size."""
    size = Path(path).stat().st_size
    peer = next((r.tok_s for r in runs if r.engine == "llama.cpp" and r.tok_s), None)
    head = (f"{'engine':10s}  {'load s':>7s}  {'RSS after load':>14s}  {'x file':>6s}  {'peak RSS':>9s}  "
            f"{'peak - base':>11s}  {'x file':>6s}  {'decode tok/s':>12s}  {'vs llama.cpp':>12s}")
    lines = [f"{Path(path).name}: {size / MIB:.1f} MiB, CPU, B=1, greedy", head]
    for r in runs:
        if r.error:
            lines.append(f"{r.engine:10s}  not run: {r.error}")
            continue
        rss = f"{r.rss_bytes / MIB:.0f} MiB" if r.rss_bytes is not None else "-"
        ratio = f"{r.rss_bytes / size:.2f}" if r.rss_bytes is not None else "-"
        peak = f"{r.peak_bytes / MIB:.0f} MiB" if r.peak_bytes is not None else "-"
        grew = _delta(r.base_bytes, r.peak_bytes)
        grew_s, grew_x = (f"{grew / MIB:.0f} MiB", f"{grew / size:.2f}") if grew is not None else ("-", "-")
        vs = f"{r.tok_s / peer:.2f}" if peer and r.tok_s else "-"
        lines.append(f"{r.engine:10s}  {r.load_s:7.2f}  {rss:>14s}  {ratio:>6s}  {peak:>9s}  {grew_s:>11s}  {grew_x:>6s}  "
                     f"{r.tok_s or 0:12.1f}  {vs:>12s}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m memra.bench.gguf_file", description="one engine's run (see module doc)")
    p.add_argument("engine", choices=ENGINES)
    p.add_argument("path")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = p.parse_args(argv)
    if args.engine == "llama.cpp":
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            print("llama_cpp is not importable here (pip install llama-cpp-python)", file=sys.stderr)
            return 2
    run = (_memra if args.engine == "memra" else _llama_cpp)(args.path, args.tokens, args.threads)
    run["peak_bytes"] = _status_bytes("VmHWM")
    print(json.dumps(run))
    return 0


if __name__ == "__main__":
    sys.exit(main())
