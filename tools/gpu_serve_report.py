"""One GPU session's server report (run through the device tool):

    python tools/gpu_serve_report.py [--total 570] [--device cuda]

The engine warms up before serving (plan check, kernel compilation), as `memra serve` does.
1. `memra bench serve`'s load test against memra's server in this process (demo model, bf16):
   200 requests at concurrency 32, mixed prompt lengths and max_tokens, 10% cancelled mid-stream;
   lost / duplicated / errors must be 0, every completed greedy text must equal offline generation,
   and the /metrics counters must match the client's totals. Throughput and TTFT p50/p99.
2. A soak for the rest of the time: rounds of 64 requests at concurrency 8 (same mix), recording
   GPU memory allocated and the process RSS after each round. Pass: no errors, nothing lost, and
   memory after the last round within the stated bound of the first round's.
Prints a short table last.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import memra  # noqa: E402
from memra.server.api import build_app  # noqa: E402
from memra.server.http import ServerThread  # noqa: E402
from memra.server.bench import (ServeBenchConfig, check_against_offline, check_metrics, memra_offline,  # noqa: E402
                                run_serve_bench, scrape_metrics)
from memra.engine.engine import Engine, EngineConfig  # noqa: E402
from memra.server.metrics import Metrics  # noqa: E402

GPU_GROWTH_BOUND = 64 << 20  # bytes of torch-allocated GPU memory the soak may add (caches are pooled up front)
RSS_GROWTH_BOUND = 256 << 20  # bytes of host RSS


def rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def gpu_bytes(device: str) -> int:
    return torch.cuda.memory_allocated() if device.startswith("cuda") else 0


def bench(url: str, cfg: ServeBenchConfig, offline=None) -> tuple[object, list[str]]:
    """One load round; the metrics check always, the offline comparison when `offline` is given."""
    before = scrape_metrics(url)
    report = asyncio.run(run_serve_bench(url, "demo", cfg))
    problems = check_metrics(before, scrape_metrics(url), report)
    if offline is not None:
        problems += check_against_offline(report, offline)
    return report, problems


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--total", type=float, default=570, help="seconds for the whole report")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--check-every", type=int, default=1, help="soak: compare with offline generation every Nth round")
    args = ap.parse_args()
    start = time.time()
    dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    model = memra.load("demo", device=args.device, dtype=dtype)
    metrics = Metrics("demo")
    engine = Engine(model, EngineConfig(max_batch=32, max_ctx=1024), metrics)
    server = ServerThread(build_app(engine, "demo", metrics=metrics)).start()
    offline = memra_offline(model)
    table = []
    try:
        load = ServeBenchConfig(requests=args.requests, concurrency=32, cancel_fraction=0.1, seed=1)
        report, problems = bench(server.url, load, offline)
        print(report.table(), flush=True)
        table.append((f"load {args.requests} req @32", f"lost {report.lost} dup {report.duplicated} errors {report.errors} "
                                                   f"cancelled {report.cancelled} checks {'PASS' if not problems else problems[:3]}"))
        table.append(("  throughput", f"{report.output_tokens_per_s:.0f} output tok/s over {report.wall_s:.1f}s"))
        table.append(("  TTFT", f"p50 {1e3 * report.ttft_p50:.0f} ms  p99 {1e3 * report.ttft_p99:.0f} ms"))

        rounds, errors, lost, dup, mismatches, completed = 0, 0, 0, 0, 0, 0
        soak_start = time.time()
        first_gpu = first_rss = None
        while time.time() - start < args.total - 45:
            cfg = ServeBenchConfig(requests=64, concurrency=8, cancel_fraction=0.1, seed=100 + rounds)
            report, problems = bench(server.url, cfg, offline if rounds % args.check_every == 0 else None)
            rounds += 1
            errors += report.errors
            lost += report.lost
            dup += report.duplicated
            mismatches += len(problems)
            completed += report.completed
            now_gpu, now_rss = gpu_bytes(args.device), rss()
            if first_gpu is None:
                first_gpu, first_rss = now_gpu, now_rss
            print(f"soak round {rounds}: {time.time() - soak_start:.0f}s completed {report.completed} "
                  f"errors {report.errors} lost {report.lost} gpu {now_gpu / 2**20:.1f} MiB rss {now_rss / 2**20:.1f} MiB "
                  f"checks {'ok' if not problems else problems[:2]}", flush=True)
        soak_s = time.time() - soak_start
        if rounds:
            growth_gpu, growth_rss = now_gpu - first_gpu, now_rss - first_rss
            ok = (errors == lost == dup == mismatches == 0 and growth_gpu <= GPU_GROWTH_BOUND
                  and growth_rss <= RSS_GROWTH_BOUND)
            table.append((f"soak @8, {soak_s / 60:.1f} min", f"{'PASS' if ok else 'FAIL'}: {rounds} rounds, {completed} completed, "
                                                         f"errors {errors} lost {lost} dup {dup} check failures {mismatches}"))
            table.append(("  memory growth", f"GPU {growth_gpu / 2**20:+.1f} MiB (bound {GPU_GROWTH_BOUND >> 20}), "
                                             f"RSS {growth_rss / 2**20:+.1f} MiB (bound {RSS_GROWTH_BOUND >> 20}) "
                                             f"after round 1 -> round {rounds}"))
    finally:
        server.stop()
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device
    print(f"\n{name}, torch {torch.__version__}, {time.time() - start:.0f}s")
    for k, v in table:
        print(f"{k:<24} {v}")


if __name__ == "__main__":
    main()
