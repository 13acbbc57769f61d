"""The throughput workload through memra's own scheduler on CPU, each step priced by a cost model: how the step
mix, and so the rate, follows the scheduler's settings before a GPU run measures them.

    python tools/schedule_model.py [--num-prompts 1000] [--max-batch 768] [--orders fcfs,lof] [--budgets 512,1024]

The requests are `memra bench throughput`'s (synthetic_workload, same seed); the scheduler is the engine's
(memra.engine.scheduler, with the engine's split budget and piece bound). Every request runs to its output
length, as random weights with no stop token do. A step costs

    max(weights / read rate, padded rows x FLOP a token / matmul rate) + KV read / attention rate
    + a fixed per-step rest + prompt tokens x a per-token rest

with rows padded to the decode graph's bucket plus the mixed graph's token bucket. The defaults are Llama-3-8B
on one H100, fitted to the profile and step times of docs/PERFORMANCE.md. With them fcfs at a 512-token budget
models 1,018 decode and 474 mixed steps and 9,642 output tok/s, where the engine ran 1,018 and 473 and measured
9,451 (MEMRA_LINEAR_CUBLAS=1). A model of step counts, not a benchmark: `memra bench throughput` gives the rates.
Its known miss: it prices a mixed step's decode attention as a decode step's. lof, which moves long contexts
into mixed steps, modelled 10,666; on one H100 it measured 9,644 against fcfs's 9,610 while the decode rows read
the prompt piece's wide table, and 10,383 against 9,413 (one call) with their own width, the default now
(docs/PERFORMANCE.md, admission order).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from memra.bench.throughput import ThroughputConfig, synthetic_workload  # noqa: E402
from memra.cache import BLOCK_SIZE  # noqa: E402
from memra.engine.types import EngineConfig  # noqa: E402
from memra.engine.scheduler import Scheduler, SchedulerConfig  # noqa: E402
from memra.graphs import bucket_for  # noqa: E402
from memra.mixed_graphs import PIECES, token_bucket  # noqa: E402
from memra.step import EXACT_PIECE  # noqa: E402


def run(reqs, args, order: str, budget: int) -> dict:
    # the engine's scheduler as Engine builds it on a GPU with captured mixed steps (a pool that holds every request)
    sched = Scheduler(SchedulerConfig(max_running=args.max_batch, token_budget=EngineConfig().token_budget,
                                      prefill_align=EXACT_PIECE, max_waiting=1 << 30, block_size=BLOCK_SIZE,
                                      total_blocks=1 << 24, prefill_budget=budget, max_pieces=PIECES - 1,
                                      longest_first=order == "lof"))
    for i, r in enumerate(reqs):
        sched.add(str(i), len(r.prompt), r.output_len)
    seconds, steps, rows, bound = 0.0, {"decode": 0, "mixed": 0}, 0, 0
    while sched.num_running() or sched.num_waiting():
        plan = sched.schedule()
        tokens = sum(n for _, _, n in plan.prefill)
        padded = (bucket_for(len(plan.decode)) or len(plan.decode)) + (token_bucket(tokens, budget) or tokens)
        kv = sum(sched.get(rid).prompt_len + sched.get(rid).generated for rid in plan.decode) * args.kv_bytes
        if args.ideal:  # the schedule's own floor: no padding, every kernel at the probes' rates, nothing else
            padded, rest = tokens + len(plan.decode), 0.0
        else:
            rest = args.step_rest + tokens * args.token_rest
        weights, matmuls = args.weight_bytes / args.read_rate, padded * args.token_flop / args.matmul_rate
        seconds += max(weights, matmuls) + kv / (args.read_rate if args.ideal else args.attention_rate) + rest
        bound += weights > matmuls
        steps["mixed" if tokens else "decode"] += 1
        rows += len(plan.decode)
        sampled = [rid for rid, start, n in plan.prefill if start + n == sched.get(rid).prompt_len] + list(plan.decode)
        done = [rid for rid in sampled if sched.get(rid).generated + 1 >= sched.get(rid).max_tokens]
        sched.step_done({rid: n for rid, _, n in plan.prefill}, sampled, done)
    return {"seconds": seconds, "steps": steps, "rows": rows / sum(steps.values()), "bound": bound}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--max-batch", type=int, default=768)
    ap.add_argument("--orders", default="fcfs,lof")
    ap.add_argument("--budgets", default="512,1024", help="prompt tokens a step (MEMRA_MIXED_TOKENS's buckets)")
    ap.add_argument("--weight-bytes", type=float, default=16.06e9)
    ap.add_argument("--read-rate", type=float, default=3.0e12)
    ap.add_argument("--token-flop", type=float, default=14.0e9)
    ap.add_argument("--matmul-rate", type=float, default=580e12)
    ap.add_argument("--kv-bytes", type=float, default=131072, help="KV bytes a position (all layers)")
    ap.add_argument("--attention-rate", type=float, default=2.4e12)
    ap.add_argument("--step-rest", type=float, default=1.7e-3, help="seconds a step outside linears and attention")
    ap.add_argument("--token-rest", type=float, default=1.2e-6, help="seconds a prompt token outside the linears")
    ap.add_argument("--ideal", action="store_true",
                    help="price each step at its floor: unpadded, the matmuls at --matmul-rate and the weights and KV at "
                         "--read-rate, nothing else (with --matmul-rate 784e12 --read-rate 3.07e12: an H100's probes)")
    args = ap.parse_args()
    reqs = synthetic_workload(ThroughputConfig(model="model", num_prompts=args.num_prompts), 1000, 8192)
    out = sum(r.output_len for r in reqs)
    print("| order | prompt tokens a step | modelled s | output tok/s | decode steps | mixed steps | rows a step | "
          "steps bound by the weights |")
    print("|---|---|---|---|---|---|---|---|")
    for order in args.orders.split(","):
        for budget in map(int, args.budgets.split(",")):
            r = run(reqs, args, order, budget)
            print(f"| {order} | {budget} | {r['seconds']:.2f} | {out / r['seconds']:,.0f} | {r['steps']['decode']:,} "
                  f"| {r['steps']['mixed']:,} | {r['rows']:.0f} | {r['bound']:,} |")


if __name__ == "__main__":
    main()
