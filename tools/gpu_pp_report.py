"""One GPU session's pipeline report (run through the device tool):

    python tools/gpu_pp_report.py [--budget 420]

1. `memra gate --mode pp` on the bundled demo (bf16) with 2 and 4 stages on one GPU, each stage on
   its own CUDA stream (dual waves Auto for PP-2);
2. the same battery, PP-2, on a random-weight Qwen3.5-9B-shaped model (bf16, built in memory);
3. deferred readback on the last stage's readback stream == the immediate logits;
4. decode tokens/s at B=1 and B=16, unsplit vs PP-2 split (Auto: serial on one device), in the same
   run (the split must cost < 5%), and the dual-wave body forced on, for the record.
Prints a short table last.
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
from memra.gate.pp_battery import env, run_pp_battery  # noqa: E402
from memra.pp.walk import active_runtime  # noqa: E402
from memra.random_model import random_model  # noqa: E402


def rate(model, batch: int, stages: int | None, steps: int = 8, **doors) -> float:
    with env(MEMRA_PP_STAGES=str(stages) if stages else None, **doors):
        rt = active_runtime(model)
        caches = [(rt.new_cache(64) if rt else model.new_cache(64)) for _ in range(batch)]
        for i, c in enumerate(caches):
            model.prime([(7 + 31 * i + j) % model.cfg.vocab_size for j in range(16)], c)
        toks = [1] * batch
        model.decode_step_batch(toks, caches)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            toks = model.decode_step_batch(toks, caches).argmax(-1).tolist()
        torch.cuda.synchronize()
        return batch * steps / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=float, default=420)
    args = ap.parse_args()
    start = time.time()
    left = lambda: args.budget - (time.time() - start)
    table = []
    out = lambda line: print("  " + line, flush=True)
    demo = memra.load("demo", device="cuda", dtype="bfloat16", tokenizer=False)
    for stages in (2, 4):
        t0 = time.time()
        ok = run_pp_battery(demo, stages=stages, batches=(1, 4, 8), steps=8, reps=2, out=out)
        table.append((f"pp gate demo bf16 PP-{stages}", f"{'ALL GREEN' if ok else 'FAILED'} ({time.time() - t0:.0f}s)"))
    with env(MEMRA_PP_STAGES="2"):
        rt = active_runtime(demo)
        c = rt.new_cache(64)
        demo.prime([3, 4, 5, 6], c)
        snap = c.snapshot()
        now = demo.decode_step(7, c)
        demo.restore(c, snap)
        with rt.stages[-1].scope():
            pending = rt.defer(demo.decode_step(7, c))
        later = pending.wait()
        table.append(("deferred readback == immediate", "yes" if torch.equal(later, now.cpu()) else "NO"))
    big = random_model("qwen3.5-9b", "cuda", torch.bfloat16)
    if left() > 200:
        t0 = time.time()
        ok = run_pp_battery(big, stages=2, batches=(1, 4), steps=2, reps=1, plen=8, out=out)
        table.append(("pp gate 9B-shape PP-2", f"{'ALL GREEN' if ok else 'FAILED'} ({time.time() - t0:.0f}s)"))
    for b in (1, 16):
        if left() < 40:
            break
        unsplit, split = rate(big, b, None), rate(big, b, 2)
        waves = f"  dual forced {rate(big, b, 2, MEMRA_DUAL_PP='1', MEMRA_PP_OVERLAP='1'):.1f}" if b > 1 else ""
        table.append((f"decode tok/s 9B-shape B={b}", f"unsplit {unsplit:.1f}  PP-2 split {split:.1f}  "
                                                      f"({100 * (split / unsplit - 1):+.1f}%){waves}"))
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, {time.time() - start:.0f}s")
    for k, v in table:
        print(f"{k:<34} {v}")


if __name__ == "__main__":
    main()
