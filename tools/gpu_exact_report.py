"""One GPU session's exactness report (run through the device tool):

    python tools/gpu_exact_report.py [--budget 480]

1. the exact-path self-test on this GPU (bf16, fp32): which batched shortcuts would break bits here;
2. `memra gate` config + strict on the bundled demo model in bf16;
3. the gate on a random-weight Qwen3.5-9B-shaped model (bf16, built in memory) at B = 1, 4, 16, 64;
4. decode tokens/s at B = 1 and 64: the exact plan `auto` picks (stacked, on the Triton batch-invariant
   kernels), the exact row plan (one forward per sequence) and the stacked F.linear path (MEMRA_EXACT=0).
Stops starting new parts once --budget seconds have passed, and prints a short table last.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import memra  # noqa: E402
from memra.decode_plan import decode_plan  # noqa: E402
from memra.gate import run_battery  # noqa: E402
from memra.kernels.exact import self_test  # noqa: E402
from memra.random_model import random_model  # noqa: E402


def decode_rate(model, batch: int, exact: bool, steps: int = 4, plan: str = "auto") -> float:
    os.environ["MEMRA_EXACT"] = "1" if exact else "0"
    os.environ["MEMRA_DECODE_PLAN"] = plan
    caches = [model.new_cache(64) for _ in range(batch)]
    for i, c in enumerate(caches):
        model.prime([(7 + 31 * i + j) % model.cfg.vocab_size for j in range(16)], c)
    toks = [1] * batch
    model.decode_step_batch(toks, caches)  # warm-up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        toks = model.decode_step_batch(toks, caches).argmax(-1).tolist()
    torch.cuda.synchronize()
    os.environ["MEMRA_EXACT"] = "1"
    os.environ["MEMRA_DECODE_PLAN"] = "auto"
    return batch * steps / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=float, default=480)
    args = ap.parse_args()
    start = time.time()
    table = []
    left = lambda: args.budget - (time.time() - start)

    for dt in (torch.bfloat16, torch.float32):
        failed = self_test(dt, "cuda")
        print(f"self-test cuda {dt}: {'all invariant' if not failed else 'breaks: ' + ', '.join(failed)}", flush=True)
        table.append((f"self-test {dt}", "ok" if not [f for f in failed if "repeat" in f] else "NONDETERMINISTIC"))

    demo = memra.load("demo", device="cuda", dtype="bfloat16", tokenizer=False)
    for mode in ("config", "strict"):
        t0 = time.time()
        ok = run_battery(demo, steps=16, batch=4, mode=mode, out=lambda l: print("  " + l, flush=True))
        table.append((f"gate {mode} demo bf16 B=4", f"{'ALL GREEN' if ok else 'FAILED'} ({time.time() - t0:.0f}s)"))

    t0 = time.time()
    big = random_model("qwen3.5-9b", "cuda", torch.bfloat16)
    print(f"built random Qwen3.5-9B shape in {time.time() - t0:.0f}s ({torch.cuda.memory_allocated() / 2**30:.1f} GiB)", flush=True)
    for b in (1, 4, 16, 64):
        if left() < 60:
            table.append((f"gate 9B-shape B={b}", "skipped (budget)"))
            continue
        t0 = time.time()
        lines = []
        ok = run_battery(big, steps=2, batch=b, mode="config", plen=8, out=lines.append)
        print("\n".join("  " + l for l in lines if "PASS" in l or "FAIL" in l or "GREEN" in l), flush=True)
        table.append((f"gate 9B-shape B={b}", f"{'ALL GREEN' if ok else 'FAILED'} ({time.time() - t0:.0f}s)"))
    table.append(("decode plan (auto) 9B-shape", decode_plan(big)))
    for b in (1, 64):
        if left() < 30:
            break
        stacked, fast = decode_rate(big, b, True), decode_rate(big, b, False, steps=8)
        row = f"  exact row {decode_rate(big, b, True, plan='row', steps=1 if b > 1 else 4):.1f}" if left() > 60 else ""
        table.append((f"decode tok/s 9B-shape B={b}", f"exact auto {stacked:.1f}{row}  stacked F.linear {fast:.1f}"))
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, {time.time() - start:.0f}s")
    for k, v in table:
        print(f"{k:<32} {v}")


if __name__ == "__main__":
    main()
