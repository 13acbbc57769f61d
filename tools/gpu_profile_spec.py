"""What speculative decoding buys on the GPU (run through the device tool):

    python tools/gpu_profile_spec.py [--budget 420] [--layers N] [--device cuda]

1. B=1 decode tokens/s, plain vs speculative, on the bundled demo (bf16; real acceptance: its MTP head
   is trained) — MTP at K = 1, 2, 4, dynamic K, snapshot+replay rollback, n-gram, seeded sampling at
   T=0.8 — with each run's acceptance and tokens per verify, and an oracle drafter that proposes the
   plain stream itself (100% acceptance: the ceiling);
2. on a random-weight Qwen3.5-9B-shaped model (bf16; its MTP head drafts noise): the verify forward's
   cost against T (one decode_step_t of T = 1, 2, 3, 5, 9 tokens vs one decode_step: the weights are
   read once per call), then plain vs MTP vs oracle tokens/s.
Stops starting new parts once --budget seconds have passed, and prints a table last. `--device cpu
--budget 0` is a smoke run (the demo only).

A profiler, not a check: that every speculative run emits the plain run's tokens, and the ppspec gate,
are tests/test_cuda_spec.py (MEMRA_TEST_DEVICE=cuda pytest -m cuda) and tests/test_spec.py.
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
from memra.generate import GenerationStats, generate_tokens  # noqa: E402
from memra.random_model import random_model  # noqa: E402
from memra.sampling import SamplingParams  # noqa: E402
from memra.spec import ReplayDrafter, SpecConfig  # noqa: E402


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run(model, device, ids, params, spec=None, oracle=None):
    """-> (tokens, decode tok/s, stats). Times the decode phase (prefill excluded), after a sync."""
    original = memra.spec.make_drafter
    if oracle is not None:
        memra.spec.make_drafter = lambda *a: ReplayDrafter(oracle)
    try:
        stats = GenerationStats()
        sync(device)
        toks = list(generate_tokens(model, ids, params, stats, speculative=spec))
        sync(device)
    finally:
        memra.spec.make_drafter = original
    return toks, stats.decode_tokens_per_second, stats


def compare(model, device, name, ids, params, specs, table, oracle_k=()):
    run(model, device, ids, SamplingParams(temperature=0.0, max_tokens=8))  # warm the kernels
    plain, plain_rate, _ = run(model, device, ids, params)
    table.append((f"{name} plain", f"{plain_rate:7.1f} tok/s"))
    cases = [(f"{s.method} K={s.k}{' dyn' if s.dynamic_k else ''}{' replay' if s.rollback == 'replay' else ''}", s, None)
             for s in specs] + [(f"oracle K={k}", SpecConfig("ngram", k=k), plain) for k in oracle_k]
    for label, spec, oracle in cases:
        _, rate, stats = run(model, device, ids, params, spec, oracle)
        s = stats.spec
        table.append((f"{name} {label}", f"{rate:7.1f} tok/s  x{rate / plain_rate:.2f}  accept {s.acceptance:6.1%}  "
                                         f"{s.tokens_per_verify:.2f} tok/verify"))


@torch.inference_mode()
def verify_cost(model, device, table, reps: int = 10):
    c = model.new_cache(512)
    model.prime([(7 + 31 * j) % model.cfg.vocab_size for j in range(32)], c)

    def timed(fn):
        fn()
        sync(device)
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        sync(device)
        return (time.perf_counter() - t0) / reps * 1e3

    def decode():
        p = c.pos
        model.decode_step(1, c)
        c.pos = p  # re-run at the same position (KV row overwritten; timing only)

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
    ap.add_argument("--layers", type=int, default=None, help="layers of the 9B shape (default: all 32)")
    ap.add_argument("--device", default="cuda", help="cuda (the profile); cpu for a smoke run with --budget 0")
    args = ap.parse_args()
    device = args.device
    start = time.time()
    left = lambda: args.budget - (time.time() - start)  # noqa: E731
    table: list[tuple[str, str]] = []

    demo = memra.load("demo", device=device, dtype="bfloat16" if device.startswith("cuda") else "float32")
    ids = demo.tokenizer.encode("ROMEO:\nBut soft, what light through yonder window breaks?\n", add_special=True)
    specs = [SpecConfig("mtp", k=1), SpecConfig("mtp", k=2), SpecConfig("mtp", k=4), SpecConfig("mtp", k=4, dynamic_k=True),
             SpecConfig("mtp", k=2, rollback="replay"), SpecConfig("ngram", k=4)]
    compare(demo, device, "demo", ids, SamplingParams(temperature=0.0, max_tokens=192), specs, table, oracle_k=(4,))
    compare(demo, device, "demo T=0.8", ids, SamplingParams(max_tokens=192, temperature=0.8, seed=5),
            [SpecConfig("mtp", k=2)], table)

    if left() > 120:
        big = random_model("qwen3.5-9b", device, torch.bfloat16, n_layers=args.layers)
        verify_cost(big, device, table)
        if left() > 60:
            compare(big, device, "9B-shape", [(7 + 31 * j) % big.cfg.vocab_size for j in range(32)],
                    SamplingParams(temperature=0.0, max_tokens=48), [SpecConfig("mtp", k=1), SpecConfig("mtp", k=2, rollback="replay")],
                    table, oracle_k=(2, 4))
    where = torch.cuda.get_device_name() if device.startswith("cuda") else device
    print(f"\n{where}, torch {torch.__version__}, {time.time() - start:.0f}s")
    for k, v in table:
        print(f"{k:<28} {v}")


if __name__ == "__main__":
    main()
