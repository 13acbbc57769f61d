"""The floor of `memra bench throughput`'s synthetic workload for named model shapes, at a given matmul peak and
read bandwidth, computed on any machine (the models are built on the meta device: shapes, no weights):

    python tools/workload_floor.py [--models llama-3-8b,qwen3.5-9b] [--num-prompts 1000] [--seed 0] \
        [--peak 784e12] [--bandwidth 3.07e12]

`memra bench throughput` prints the same floor after each run with the device's own probes
(memra.bench.workload_floor); this gives it for a device's figures without one, e.g. to set a target against it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from memra.bench.roofline import cache_parts  # noqa: E402
from memra.bench.throughput import ThroughputConfig, synthetic_workload  # noqa: E402
from memra.bench.workload_floor import decode_keys, meta_model, workload_floor  # noqa: E402
from memra.random_model import SHAPES  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="llama-3-8b,qwen3.5-9b")
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--peak", type=float, default=784e12, help="matmul FLOP/s (default: an H100's probe)")
    ap.add_argument("--bandwidth", type=float, default=3.07e12, help="read bytes/s (default: an H100's probe)")
    args = ap.parse_args()
    for name in args.models.split(","):
        model = meta_model(SHAPES[name](None))
        reqs = synthetic_workload(ThroughputConfig(num_prompts=args.num_prompts, seed=args.seed),
                                  model.cfg.vocab_size, model.cfg.max_position)
        lengths = [(len(r.prompt), r.output_len) for r in reqs]
        floor = workload_floor(model, lengths, args.peak, args.bandwidth)
        output = sum(o for _, o in lengths)
        kv = cache_parts(model.cfg, model.dtype, 1)[0] * sum(decode_keys(p, o) for p, o in lengths)
        print(f"{name}: {sum(p for p, _ in lengths)} prompt + {output} output tokens")
        print(f"  floor at these figures: {floor.describe(output)}")
        print(f"  cache traffic: KV {kv / 1e12:.2f} TB, GDN state read and written {(floor.cache_bytes - kv) / 1e12:.2f} "
              f"TB; matmuls {floor.matmul_flops / args.peak:.2f} s, cache {floor.cache_bytes / args.bandwidth:.2f} s")


if __name__ == "__main__":
    main()
