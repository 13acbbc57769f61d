"""One GPU's report on pipeline stages across processes (run through the device tool):

    python tools/gpu_pp_dist_report.py [--device cuda|cpu] [--model PATH|random:SHAPE] [--layers 8]
                                       [--steps 64] [--gate-model demo] [--budget 480]

1. `memra gate GATE_MODEL --mode pp --transport dist --stages 2` with BOTH ranks on one device (cuda:0):
   NCCL first (MEMRA_PP_DIST_SHARE_GPUS=1 lets its two ranks share the GPU), in a child process with a
   wall limit; when NCCL refuses the shared device (a start-up error or a hang, not a FAIL verdict),
   the same gate again over gloo. Prints which backend ran and ALL GREEN / FAIL.
2. Per-token decode latency at B=1, greedy, after a warm-up: the single-process model (CUDA graphs
   on, and eager with MEMRA_CUDA_GRAPHS=0) vs the 2-rank pipeline on the backend step 1 used (both
   ranks on the same device, so the difference is the process boundary: the wire, the hand-offs, the
   scheduling of two processes). The greedy tokens of every arm must agree.
   MODEL (default: random:qwen3.5-9b with --layers 8 on CUDA, the demo on CPU) is a checkpoint path,
   or random:SHAPE for a random-weight model of a named shape (memra.random_model), which rank 1
   rebuilds from the same recipe.
Prints a short table last. `--device cpu` runs the whole report on a CPU box (gloo only).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import memra  # noqa: E402
from memra.errors import MemraError  # noqa: E402
from memra.gate.pp_battery import env  # noqa: E402


def one_device_env(device: str) -> dict[str, str]:
    """Children see only the GPU this process calls cuda:0, so every rank lands on it (rank r asks for
    cuda:r; with one visible GPU that is cuda:0 for all)."""
    if device != "cuda":
        return {}
    return {"CUDA_VISIBLE_DEVICES": (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0].strip()}


def backend_doors(backend: str) -> dict[str, str]:
    return {"MEMRA_PP_DIST_BACKEND": backend, "MEMRA_PP_DIST_SHARE_GPUS": "1" if backend == "nccl" else "0"}


def run_gate(model: str, device: str, backend: str, limit_s: float) -> tuple[str, str]:
    """The dist gate in a child process. -> (outcome, detail): outcome "green" | "fail" (the battery ran
    and failed: no fallback) | "refused" (the backend could not start: error, crash or timeout)."""
    cmd = [sys.executable, "-m", "memra", "gate", model, "--device", device, "--mode", "pp", "--transport", "dist",
           "--stages", "2"]
    if device == "cuda":
        cmd += ["--dtype", "bfloat16"]
    child_env = {**os.environ, **one_device_env(device), **backend_doors(backend), "PYTHONUNBUFFERED": "1",
                 "MEMRA_PP_DIST_START_TIMEOUT_S": str(int(max(limit_s - 10, 30)))}
    t0 = time.time()
    # Its own process group: on a hang the gate's workers (its children) go down with it, GPU freed.
    proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        text, _ = proc.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        text, _ = proc.communicate()
        tail = " | ".join((text or "").strip().splitlines()[-3:])
        return "refused", f"no verdict within {limit_s:.0f}s (hung?): {tail[:300]}"
    lines = text.splitlines()
    for line in lines:
        print(f"    [{backend}] {line}", flush=True)
    verdict = next((ln for ln in reversed(lines) if ln.startswith(("ALL GREEN", "FAIL"))), "")
    took = f"{time.time() - t0:.0f}s"
    if proc.returncode == 0 and verdict.startswith("ALL GREEN"):
        return "green", took
    if proc.returncode == 1 and verdict:
        return "fail", f"{verdict}, {took}"
    last = next((ln for ln in reversed(lines) if ln.strip()), f"exit code {proc.returncode}")
    return "refused", last[:300]


def load(spec: str, device: str, dtype: torch.dtype, layers: int):
    if spec.startswith("random:"):
        from memra.random_model import random_model

        return random_model(spec.removeprefix("random:"), device, dtype, n_layers=layers)
    return memra.load(spec, device=device, dtype=dtype, tokenizer=False)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def per_token_ms(m, device: str, prompt: list[int], steps: int, warm: int = 8) -> tuple[float, list[int]]:
    """B=1 greedy decode through m (a model or a DistPipeline): ms per token over `steps` timed steps
    (each step reads its token back to the host, as a serving loop does), and the tokens."""
    c = m.new_cache(len(prompt) + warm + steps + 2)
    try:
        tok = int(m.prime(prompt, c).argmax())
        for _ in range(warm):
            tok = int(m.decode_step(tok, c).argmax())
        sync(device)
        out, t0 = [], time.perf_counter()
        for _ in range(steps):
            tok = int(m.decode_step(tok, c).argmax())
            out.append(tok)
        sync(device)
        return 1000 * (time.perf_counter() - t0) / steps, out
    finally:
        c.free()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--model", default=None, help="checkpoint path or random:SHAPE (default: random:qwen3.5-9b on "
                                                  "CUDA, demo on CPU)")
    ap.add_argument("--layers", type=int, default=8, help="layers of a random:SHAPE model (default 8)")
    ap.add_argument("--steps", type=int, default=64, help="timed decode steps per arm (default 64)")
    ap.add_argument("--gate-model", default="demo", help="the gate's model (default: the bundled demo)")
    ap.add_argument("--budget", type=float, default=480, help="seconds for the whole report (default 480)")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise MemraError("--device cuda but this machine has no CUDA device; use --device cpu")
    start = time.time()
    left = lambda: args.budget - (time.time() - start)
    dev = args.device
    table: list[tuple[str, str]] = []

    # ---- 1. the gate, both ranks on one device: NCCL if it takes a shared GPU, else gloo ----
    backend, gate_note = "gloo", ""
    if dev == "cuda":
        print("gate over nccl (both ranks on cuda:0):", flush=True)
        outcome, detail = run_gate(args.gate_model, dev, "nccl", min(240.0, left() * 0.45))
        if outcome == "refused":
            gate_note = f" (NCCL refused a shared GPU: {detail})"
            print(f"  nccl refused: {detail}\ngate over gloo (both ranks on cuda:0):", flush=True)
            outcome, detail = run_gate(args.gate_model, dev, "gloo", min(240.0, left() * 0.5))
        else:
            backend = "nccl"
    else:
        print("gate over gloo (both ranks on cpu):", flush=True)
        outcome, detail = run_gate(args.gate_model, dev, "gloo", min(240.0, left() * 0.5))
    verdict = {"green": "ALL GREEN", "fail": "FAIL", "refused": "FAIL (could not start)"}[outcome]
    table.append((f"pp dist gate, 2 ranks on one {dev}", f"{verdict} via {backend} ({detail}){gate_note}"))

    # ---- 2. B=1 decode latency: one process vs two ranks on the same device ----
    spec = args.model or ("random:qwen3.5-9b" if dev == "cuda" else "demo")
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    if outcome != "green" or left() < 60:
        table.append(("B=1 decode latency", "skipped (" + ("the gate did not pass" if outcome != "green"
                                                           else "out of time") + ")"))
    else:
        model = load(spec, dev, dtype, args.layers)
        shape = f" ({args.layers} layers)" if spec.startswith("random:") else ""
        name = f"{spec}{shape} {str(dtype).removeprefix('torch.')}"
        prompt = [(7 + 31 * j) % model.cfg.vocab_size for j in range(16)]
        with env(MEMRA_PP_STAGES=None):  # the single-process arms: no in-process split
            graphs_ms, want = per_token_ms(model, dev, prompt, args.steps)
            with env(MEMRA_CUDA_GRAPHS="0"):
                eager_ms, eager_toks = per_token_ms(model, dev, prompt, args.steps)
        from memra.pp.dist import launch_local

        table.append(("model", f"{name} on {dev}, {args.steps} timed steps after 8 warm-up, B=1 greedy"))
        table.append(("single process, graphs on", f"{graphs_ms:.3f} ms/token"))
        table.append(("single process, eager", f"{eager_ms:.3f} ms/token"))
        try:
            with env(**backend_doors(backend)):
                # rank 0 drops stage 1's layers here (the arms above are done); rank 1 sees only this GPU
                pipe = launch_local(model, 2, env=one_device_env(dev))
            try:
                print(pipe.description, flush=True)
                dist_ms, got = per_token_ms(pipe, dev, prompt, args.steps)
            finally:
                codes = pipe.shutdown()
        except MemraError as err:
            table.append((f"2 ranks ({backend}), same device", f"FAILED: {err}"))
            outcome = "fail"
        else:
            boundary = dist_ms - eager_ms
            table.append((f"2 ranks ({backend}), same device", f"{dist_ms:.3f} ms/token; workers exited {codes}"))
            table.append(("process boundary", f"{boundary:+.3f} ms/token ({100 * boundary / eager_ms:+.1f}% vs "
                                              f"eager, {100 * (dist_ms - graphs_ms) / graphs_ms:+.1f}% vs graphs on)"))
            same = want == eager_toks == got
            table.append(("greedy tokens equal (3 arms)", "yes" if same else "NO"))
            if not same or codes != {1: 0}:
                outcome = "fail"

    where = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    nccl = ""
    if dev == "cuda":
        v = torch.cuda.nccl.version()
        nccl = f", NCCL {'.'.join(map(str, v)) if isinstance(v, tuple) else v}"
    print(f"\n{where}, torch {torch.__version__}{nccl}, {time.time() - start:.0f}s")
    for k, v in table:
        print(f"{k:<36} {v}")
    return 0 if outcome == "green" else 1


if __name__ == "__main__":
    sys.exit(main())
