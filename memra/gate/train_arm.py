"""The training battery (`memra gate MODEL --mode train`): the training forward equals the sampler (promise E11).

    sample   prompts around the 64-grid's edges decoded by the engine together, greedy and seeded, each
             generated token with its logprob.
    e11      every prompt + completion packed into one row of tokens (memra.train.Trainer): each generated
             position's logprob must equal the sampled one bit for bit (Python floats from the same fp32: `==`).
    packing  the same sequences reversed, shuffled and each alone: every position's logprob equal, bit for bit,
             to the first packing's (prompt positions included).
    backward the packing's loss reaches every parameter: a finite gradient on each.
    liveness train_forwards, train_exact_tokens and train_grad_tokens advanced by exactly what was run.

MEMRA_GATE_CANARY=1 builds the trainer on the plain forward (its values from the differentiable walk: matmuls
over every row of the packing, as a PyTorch trainer computes them): the e11 arm must then FAIL.
"""

from __future__ import annotations

import random
from typing import Callable

import torch

from memra import counters
from memra.engine.engine import Engine
from memra.engine.types import EngineConfig
from memra.gate.battery import Ledger
from memra.gate.score_arm import score_prompts
from memra.sampling import SamplingParams


def _sample(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> list[tuple[list[int], list[float]]]:
    events: list[list] = [[] for _ in prompts]
    for i, p in enumerate(prompts):
        engine.submit(p, params, lambda ev, i=i: events[i].append(ev) if ev.token_id is not None else None, logprobs=0)
    engine.run_until_idle()
    return [([e.token_id for e in evs], [e.logprob for e in evs]) for evs in events]


def _pack(seqs, order):
    ids = torch.tensor([t for k in order for t in seqs[k][0]])
    return ids, [len(seqs[k][0]) for k in order], [seqs[k][1] for k in order]


def _unpack(lp: torch.Tensor, seqs, order) -> dict[int, list[float]]:
    out, at = {}, 0
    for k in order:
        n = len(seqs[k][0])
        out[k] = lp[at : at + n].tolist()
        at += n
    return out


def run_train_battery(model, steps: int = 16, plen: int = 20, out: Callable[[str], None] = print) -> bool:
    from memra.train import Trainer

    led = Ledger(out)
    canary = model.settings.gate_canary
    prompts = [p for p in score_prompts(plen, model.cfg.vocab_size) if len(p) < 128]
    ctx = max(len(p) for p in prompts) + steps + 1
    out(f"memra gate --mode train: {model.cfg.arch} {model.dtype} on {model.device}, {len(prompts)} prompts "
        f"({', '.join(str(len(p)) for p in prompts)} tokens) x {steps} generated, greedy and seeded")
    engine = Engine(model, EngineConfig(max_batch=len(prompts), max_ctx=ctx, max_waiting=64))
    seqs = []  # (prompt + completion, prompt length, sampled logprobs)
    for params in (SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True),
                   SamplingParams(max_tokens=steps, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True)):
        for p, (gen, lps) in zip(prompts, _sample(engine, prompts, params)):
            seqs.append((p + gen, len(p), lps))
    engine.shutdown(0)
    trainer = Trainer(model, canary=canary)
    before = counters.snapshot()
    order = list(range(len(seqs)))
    lp = trainer(*_pack(seqs, order))
    first = _unpack(lp, seqs, order)
    for k, (ids, s, want) in enumerate(seqs):
        got = first[k][s - 1 : len(ids) - 1]
        if got != want:
            j = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
            led.fail("e11", f"sequence {k} (prompt {s}) token {j}: trainer {got[j]!r} sampled {want[j]!r}")
    led.verdict("e11", "trainer logprobs == sampled logprobs, greedy and seeded, bit for bit")
    (lp * torch.linspace(-1, 1, lp.numel(), device=lp.device)).sum().backward()
    bad = [n for n, p in trainer.named_weights().items() if p.grad is None or not bool(torch.isfinite(p.grad).all())]
    if bad:
        led.fail("backward", f"{len(bad)} parameters without a finite gradient, e.g. {bad[0]}")
    led.verdict("backward", f"a finite gradient on all {len(trainer.params)} parameters")
    rng = random.Random(model.settings.gate_seed)
    orders = [order[::-1], rng.sample(order, len(order))] + [[k] for k in order]
    with torch.no_grad():
        for o in orders:
            for k, got in _unpack(trainer(*_pack(seqs, o)), seqs, o).items():
                if got != first[k]:
                    led.fail("packing", f"sequence {k} in packing {o}: its logprobs changed")
    led.verdict("packing", f"{len(orders)} other packings (reversed, shuffled, each alone) == the first, bit for bit")
    moved = counters.delta(before)
    n_tok = sum(len(s[0]) for s in seqs)
    want = {"train_forwards": 1 + len(orders), "train_grad_tokens": 0 if canary else n_tok,
            "train_exact_tokens": 0 if canary else (n_tok - len(seqs)) * 4}  # first, reversed, shuffled, alone
    for name, n in want.items():
        if moved[name] < n or (name == "train_forwards" and moved[name] != n):
            led.fail("liveness", f"{name} moved {moved[name]}, expected {n}")
    led.verdict("liveness", ", ".join(f"{k} +{moved[k]}" for k in want))
    ok = not led.failed
    out(f"{'ALL GREEN' if ok else 'FAILED'}: train ({', '.join(sorted(led.failed)) or 'every arm passed'})"
        f"{' [canary]' if canary else ''}")
    return ok
