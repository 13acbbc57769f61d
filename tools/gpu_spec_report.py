"""One GPU session's speculative-decoding report (run through the device tool):

    python tools/gpu_spec_report.py [--budget 420]

1. `memra gate --mode ppspec` on the bundled demo (bf16), PP-2 on one GPU (a stream per stage);
2. the verify forward's cost against T on a random-weight Qwen3.5-9B-shaped model (bf16): one
   decode_step_t of T = 1, 2, 3, 5, 9 tokens vs one decode_step (the weights are read once per call);
3. B=1 tokens/s, plain vs speculative, on the demo (real acceptance: its MTP head is trained) and on
   the 9B shape (random weights: the MTP head's drafts are noise), with the acceptance of each run;
   plus an oracle drafter that proposes the plain stream itself (100% acceptance: the ceiling), and
   trail rollback vs snapshot+replay rollback.
Every speculative run is checked token-identical to the plain run. Prints a short table last.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import memra  # noqa: E402
import memra.spec  # noqa: E402
from memra.gate.ppspec_battery import run_ppspec_battery  # noqa: E402
from memra.generate import GenerationStats, generate_tokens  # noqa: E402
from memra.random_model import random_model  # noqa: E402
from memra.sampling import SamplingParams  # noqa: E402
from memra.spec import SpecConfig  # noqa: E402


DEVICE = "cuda"


def sync() -> None:
    if DEVICE.startswith("cuda"):
        torch.cuda.synchronize()


class OracleDrafter:
    """Proposes the plain stream's own next tokens: every draft is accepted (the speed ceiling)."""

    def __init__(self, stream: list[int]):
        self.stream = stream

    def start(self, prompt, hidden, first) -> None:
        pass

    def propose(self, k: int, ctr: int) -> list[int]:
        return self.stream[ctr : ctr + k]

    def advance(self, kept, h_seed, nxt) -> None:
        pass


def run(model, ids, params, spec=None, oracle=None):
    """-> (tokens, decode tok/s, stats). Times the decode phase (prefill excluded), after a sync."""
    original = memra.spec.make_drafter
    if oracle is not None:
        memra.spec.make_drafter = lambda *a: OracleDrafter(oracle)
    try:
        stats = GenerationStats()
        sync()
        toks = list(generate_tokens(model, ids, params, stats, speculative=spec))
        sync()
    finally:
        memra.spec.make_drafter = original
    return toks, stats.decode_tokens_per_second, stats


def compare(model, name, ids, params, specs, table, oracle_k=()):
    run(model, ids, SamplingParams(max_tokens=8))  # warm the kernels
    plain, plain_rate, _ = run(model, ids, params)
    table.append((f"{name} plain", f"{plain_rate:7.1f} tok/s"))
    cases = [(f"{s.method} K={s.k}{' dyn' if s.dynamic_k else ''}{' replay' if s.rollback == 'replay' else ''}", s, None)
             for s in specs] + [(f"oracle K={k}", SpecConfig("ngram", k=k), plain) for k in oracle_k]
    for label, spec, oracle in cases:
        toks, rate, stats = run(model, ids, params, spec, oracle)
        same = "same tokens" if toks == plain else "TOKENS DIFFER"
        s = stats.spec
        table.append((f"{name} {label}", f"{rate:7.1f} tok/s  x{rate / plain_rate:.2f}  accept {s.acceptance:6.1%}  "
                                         f"{s.tokens_per_verify:.2f} tok/verify  {same}"))


@torch.inference_mode()
def verify_cost(model, table, reps: int = 10):
    c = model.new_cache(512)
    model.prime([(7 + 31 * j) % model.cfg.vocab_size for j in range(32)], c)

    def timed(fn):
        fn()
        sync()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        sync()
        return (time.perf_counter() - t0) / reps * 1e3

    def decode():
        snap_pos = c.pos
        model.decode_step(1, c)
        c.pos = snap_pos  # re-run at the same position (KV row overwritten; timing only)

    base = timed(decode)
    row = [f"decode {base:.1f} ms"]
    for t in (1, 2, 3, 5, 9):
        def verify(t=t):
            p = c.pos
            model.decode_step_t([1] * t, p, c)
            c.pos = p
        ms = timed(verify)
        row.append(f"T={t} {ms:.1f} ms (x{ms / base:.2f})")
    table.append(("9B-shape verify cost", "  ".join(row)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=float, default=420)
    ap.add_argument("--device", default="cuda", help="cuda (the report); cpu for a smoke run with --budget 0")
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    start = time.time()
    left = lambda: args.budget - (time.time() - start)
    table = []
    out = lambda line: print("  " + line, flush=True)

    demo = memra.load("demo", device=DEVICE, dtype="bfloat16" if DEVICE.startswith("cuda") else "float32")
    t0 = time.time()
    ok = run_ppspec_battery(demo, stages=2, ts=(2, 5, 9), rounds=6, reps=2, out=out)
    table.append(("ppspec gate demo bf16 PP-2", f"{'ALL GREEN' if ok else 'FAILED'} ({time.time() - t0:.0f}s)"))

    ids = demo.tokenizer.encode("ROMEO:\nBut soft, what light through yonder window breaks?\n", add_special=True)
    specs = [SpecConfig("mtp", k=1), SpecConfig("mtp", k=2), SpecConfig("mtp", k=4), SpecConfig("mtp", k=4, dynamic_k=True),
             SpecConfig("mtp", k=2, rollback="replay"), SpecConfig("ngram", k=4)]
    compare(demo, "demo", ids, SamplingParams(max_tokens=192), specs, table, oracle_k=(4,))
    compare(demo, "demo T=0.8", ids, SamplingParams(max_tokens=192, temperature=0.8, seed=5),
            [SpecConfig("mtp", k=2)], table)

    if left() > 120:
        big = random_model("qwen3.5-9b", DEVICE, torch.bfloat16)
        verify_cost(big, table)
        if left() > 60:
            compare(big, "9B-shape", [(7 + 31 * j) % big.cfg.vocab_size for j in range(32)], SamplingParams(max_tokens=48),
                    [SpecConfig("mtp", k=1), SpecConfig("mtp", k=2, rollback="replay")], table, oracle_k=(2, 4))
    print(f"\n{torch.cuda.get_device_name() if DEVICE.startswith('cuda') else DEVICE}, torch {torch.__version__}, {time.time() - start:.0f}s")
    for k, v in table:
        print(f"{k:<28} {v}")


if __name__ == "__main__":
    main()
