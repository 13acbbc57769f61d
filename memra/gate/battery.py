"""The decode_step_batch exactness battery (`memra gate --mode config|strict`).

    gate1  B=1 eager (decode_step) vs the batched body at B=1, fed its own greedy tokens.
           strict: logits bit-identical every step (one prompt draw).
           config: argmax agreement over 6 prompt draws; FAIL iff >= 4 draws diverge before step 3
           (a plumbing bug - wrong token, misindexed KV - diverges early on every draw; a legitimate
           numeric near-tie would not). Our B=1 is the batched body itself, so bits are checked too.
    gate2  B=N per-sequence logits vs isolated B=1 runs, every step, every row: bit strength.
    gate3  device sampling: (a) greedy device token == host argmax of the returned row;
           (b) a seeded sampled stream at B=N == the same stream run alone;
           (c) lean mode with mixed rows (greedy device / seeded device / host): same tokens as the
           full mode, parked device logits bit-identical to the full row, host rows unchanged.
    gate4  the speculative verify's columns == decode_step, across rollbacks (E4).
    prime-batch  several prompts primed in shared forwards == each primed alone, logits and cache bits
           (memra.gate.prime_batch_arm; skipped where prime batching is not live).
    liveness  the process counters prove the batched, device-sampled and lean paths actually ran.

MEMRA_GATE_SEED varies the prompts; MEMRA_GATE_CANARY=1 feeds the batched lanes one wrong token at
step 1, and the battery must then FAIL (a gate that cannot fail is a defect).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from memra import counters
from memra.errors import MemraError
from memra.gate.prime_batch_arm import PRIME_BATCH_LONG, prime_batch_prompts, run_prime_batch_arm
from memra.kernels.exact import platform_report
from memra.sampling import DevSamp

G1_DRAWS = 6
G1_EARLY_STEP = 3
G1_EARLY_K = 4


@dataclass
class Ledger:
    """Collects PASS/FAIL per gate and prints as it goes."""

    out: Callable[[str], None] = print
    failed: dict[str, int] = field(default_factory=dict)

    def fail(self, gate: str, msg: str) -> None:
        self.failed[gate] = self.failed.get(gate, 0) + 1
        if self.failed[gate] <= 6:
            self.out(f"{gate}: {msg} FAIL")

    def verdict(self, gate: str, what: str) -> None:
        self.out(f"{gate} ({what}): {'FAIL' if self.failed.get(gate) else 'PASS'}")


def gate_prompts(n: int, plen: int, seed: int, vocab: int) -> list[list[int]]:
    """Distinct, deliberately uneven prompts (lengths plen, plen+5, ...) so positions differ per row."""
    return [[(55 + seed * 13 + i * 97 + j * 31) % vocab for j in range(plen + 5 * i)] for i in range(n)]


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


def maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float().cpu() - b.float().cpu()).abs().max().item()


def _primed(model, prompt: list[int], ctx: int):
    c = model.new_cache(ctx)
    model.prime(prompt, c)
    return c


def _gate4_verify(model, prompt: list[int], steps: int, ctx: int, canary: bool, led: Ledger) -> bool:
    """decode_step_t over T = 2 and 5 consecutive tokens of decode's own greedy stream: every column
    must carry decode_step's bits at that position. Each round keeps T-1 tokens and rolls the last one
    back (GDN state from the trail), so the next round also proves the rollback left decode's state."""
    from memra.decode_plan import decode_plan
    from memra.state_trail import StateTrail

    if model.settings.exact and decode_plan(model) == "bucket":
        led.out("gate4 skipped: MEMRA_DECODE_PLAN=bucket has no verify body (speculation refuses it)")
        return False
    c = _primed(model, prompt, ctx)
    toks, ref = [prompt[-1]], []
    for _ in range(steps):
        ref.append(model.decode_step(toks[-1], c))
        toks.append(int(ref[-1].argmax()))
    for t in (2, 5):
        c, trail, s, rounds = _primed(model, prompt, ctx), StateTrail(), 0, 0
        while s + t <= steps:
            chunk = list(toks[s : s + t])
            if canary and rounds == 1:
                chunk[-1] = chunk[-1] - 1 if chunk[-1] else 1
            pos0 = c.pos
            logits, _ = model.decode_step_t(chunk, pos0, c, trail)
            for j in range(t):
                if not bits_equal(logits[j], ref[s + j]):
                    led.fail("gate4", f"T={t} round {rounds} column {j}: BIT-DIFF vs decode_step "
                                      f"(maxdiff {maxdiff(logits[j], ref[s + j]):.3e})")
            keep = max(t - 1, 1)
            if keep < t:
                c.rollback(pos0, keep, trail)
            s, rounds = s + keep, rounds + 1
    led.verdict("gate4", f"verify T=2,5 columns == decode_step over {steps} steps, with rollback, bit-checked")
    return True


def run_battery(model, steps: int = 32, batch: int = 4, mode: str = "config", plen: int = 20,
                out: Callable[[str], None] = print) -> bool:
    if mode not in ("config", "strict"):
        raise MemraError(f"unknown gate mode {mode!r}; use config or strict")
    strict = mode == "strict"
    seed, canary = model.settings.gate_seed, model.settings.gate_canary
    vocab = model.cfg.vocab_size
    b_n = max(batch, 1)
    prompts = gate_prompts(max(b_n, 2), plen, seed, vocab)
    ctx = plen + 5 * len(prompts) + steps + 8
    led = Ledger(out)
    live_before = counters.snapshot()
    state = f", GDN state {model.cfg.gdn.state_dtype}" if model.cfg.gdn is not None else ""
    out(f"memra gate --mode {mode}: {model.cfg.arch} {model.dtype}{state} on {model.device}, B={b_n}, {steps} steps, "
        f"plen {plen}, seed {seed}{', CANARY (must FAIL)' if canary else ''}")
    from memra.decode_plan import decode_plan

    out(f"decode plan: {decode_plan(model)} (MEMRA_DECODE_PLAN=auto|row|stacked|bucket)")
    broken = platform_report(model.dtype, model.device, model.ops.linear_family)
    out("platform self-test: " + ("every probe is position-invariant" if not broken else
                                  f"probes that change bits with position (informational; plans are checked on the "
                                  f"model itself): {', '.join(broken)}"))

    # ---- gate1: eager B=1 vs the batched body at B=1 ----
    early = 0
    draws = 1 if strict else G1_DRAWS
    for d in range(draws):
        p0 = [(55 + (seed + d) * 13 + j * 31) % vocab for j in range(plen)]
        c_ref, c_bat = _primed(model, p0, ctx), _primed(model, p0, ctx)
        t_ref = t_bat = p0[-1]
        diverged = None
        for s in range(steps):
            if canary and s == 1:
                t_bat = t_bat - 1 if t_bat else 1
            l_ref = model.decode_step(t_ref, c_ref)
            l_bat = model.decode_step_batch([t_bat], [c_bat])[0]
            if not bits_equal(l_ref, l_bat):
                led.fail("gate1", f"draw {d} step {s}: BIT-DIFF (maxdiff {maxdiff(l_ref, l_bat):.3e})")
            t_ref, t_bat = int(l_ref.argmax()), int(l_bat.argmax())
            if t_ref != t_bat:
                diverged = s
                break
        if diverged is None:
            out(f"gate1 draw {d}: agreement all {steps} steps")
        elif strict:
            led.fail("gate1", f"draw {d} step {diverged}: token diverged")
        elif diverged < G1_EARLY_STEP:
            early += 1
            out(f"gate1 draw {d} step {diverged}: token diverged EARLY")
        else:
            out(f"gate1 draw {d} step {diverged}: token diverged late (near-tie drift; WARN)")
    if not strict:
        out(f"gate1 early divergences (step < {G1_EARLY_STEP}): {early}/{draws} (FAIL at >= {G1_EARLY_K})")
        if early >= G1_EARLY_K:
            led.fail("gate1", f"{early}/{draws} draws diverged early: plumbing, not numerics")
    led.verdict("gate1", f"B=1 eager vs batched body, {steps} steps, {draws} draw(s)")

    # ---- gate2: B=N vs isolated B=1 ----
    ref_tokens, ref_logits = [], []
    for p in prompts[:b_n]:
        c = _primed(model, p, ctx)
        t, toks, ls = p[-1], [], []
        for _ in range(steps):
            l = model.decode_step(t, c) if strict else model.decode_step_batch([t], [c])[0]
            t = int(l.argmax())
            toks.append(t)
            ls.append(l)
        ref_tokens.append(toks)
        ref_logits.append(ls)
    caches = [_primed(model, p, ctx) for p in prompts[:b_n]]
    toks = [p[-1] for p in prompts[:b_n]]
    for s in range(steps):
        if canary and s == 1:
            toks[0] = toks[0] - 1 if toks[0] else 1
        rows = model.decode_step_batch(toks, caches)
        for i, l in enumerate(rows):
            toks[i] = int(l.argmax())
            if toks[i] != ref_tokens[i][s]:
                led.fail("gate2", f"seq {i}: token DIVERGED from isolated at step {s}")
            elif not bits_equal(l, ref_logits[i][s]):
                led.fail("gate2", f"seq {i} step {s}: LOGIT BIT-DIFF vs isolated (maxdiff {maxdiff(l, ref_logits[i][s]):.3e})")
    led.verdict("gate2", f"B={b_n} vs isolated {'decode_step' if strict else 'batched B=1'}, {steps} steps, bit-checked")

    # ---- gate3a: greedy device token == host argmax ----
    n3 = min(steps, 16)
    caches = [_primed(model, p, ctx) for p in prompts[:b_n]]
    toks = [p[-1] for p in prompts[:b_n]]
    greedy = [DevSamp(0.0, 0, 0)] * b_n
    for _ in range(n3):
        rows, nxt = model.decode_step_batch_sampled(toks, caches, greedy)
        for i, l in enumerate(rows):
            host = int(l.argmax())
            if nxt[i] != host:
                led.fail("gate3", f"3a seq {i}: device argmax {nxt[i]} != host argmax {host}")
            toks[i] = host

    # ---- gate3b: seeded sampled streams, B=N vs alone ----
    def spec(i: int, s: int) -> DevSamp:
        return DevSamp(0.7, i + 1 + seed, s, top_k=0, top_p=0.95, min_p=0.0)

    alone = []
    for i, p in enumerate(prompts[:b_n]):
        c, t, stream = _primed(model, p, ctx), p[-1], []
        for s in range(n3):
            t = model.decode_step_batch_sampled([t], [c], [spec(i, s)])[1][0]
            stream.append(t)
        alone.append(stream)
    caches = [_primed(model, p, ctx) for p in prompts[:b_n]]
    toks = [p[-1] for p in prompts[:b_n]]
    together = [[] for _ in range(b_n)]
    for s in range(n3):
        toks = model.decode_step_batch_sampled(toks, caches, [spec(i, s) for i in range(b_n)])[1]
        for i in range(b_n):
            together[i].append(toks[i])
    for i in range(b_n):
        if together[i] != alone[i]:
            first = next(s for s in range(n3) if together[i][s] != alone[i][s])
            led.fail("gate3", f"3b seq {i}: sampled stream DIVERGED batched vs alone at step {first}")

    # ---- gate3c: lean parking with mixed rows ----
    caches_full = [_primed(model, p, ctx) for p in prompts[:b_n]]
    caches_lean = [_primed(model, p, ctx) for p in prompts[:b_n]]
    toks = [p[-1] for p in prompts[:b_n]]
    for s in range(min(steps, 8)):
        metas = [(DevSamp(0.0, 0, 0) if i % 3 == 0 else spec(i, s) if i % 3 == 1 else None) for i in range(b_n)]
        rows_f, next_f = model.decode_step_batch_sampled(toks, caches_full, metas, lean=False)
        rows_l, next_l = model.decode_step_batch_sampled(toks, caches_lean, metas, lean=True)
        for i, m in enumerate(metas):
            if m is None:
                if rows_l[i] is None or not bits_equal(rows_l[i], rows_f[i]):
                    led.fail("gate3", f"3c seq {i}: host row differs between lean and full")
                toks[i] = int(rows_f[i].argmax())
                continue
            if next_l[i] != next_f[i]:
                led.fail("gate3", f"3c seq {i}: lean token {next_l[i]} != full token {next_f[i]}")
            if rows_l[i] is not None:
                led.fail("gate3", f"3c seq {i}: lean device row was returned to the host")
            parked = caches_lean[i].last_logits_dev
            if parked is None or not bits_equal(parked.cpu(), rows_f[i]):
                led.fail("gate3", f"3c seq {i}: parked device logits != full host row")
            toks[i] = next_f[i]
    led.verdict("gate3", "device sampling: greedy == host argmax, sampled B=N == alone, lean park == full row")

    # ---- gate4: the speculative verify's columns == decode_step, across rollbacks (E4) ----
    verified = _gate4_verify(model, prompts[0], steps, ctx, canary, led)

    # ---- prime-batch: each prompt's prime in shared forwards == alone (cross-request prefill) ----
    run_prime_batch_arm(model, prime_batch_prompts(plen, seed, vocab), plen + PRIME_BATCH_LONG + 8, canary, led)

    # ---- liveness: the paths under test ran ----
    live = counters.delta(live_before)
    names = ("decode_batch_rows", "device_sampled_rows", "lean_parked_rows") + (("spec_verify_columns",) if verified else ())
    for name in names:
        if live[name] <= 0:
            led.fail("liveness", f"{name} did not advance")
    led.verdict("liveness", ", ".join(f"{k} +{live[k]}" for k in names))

    ok = not led.failed
    out("ALL GREEN: decode_step_batch exactness battery" if ok else f"FAILED: {', '.join(sorted(led.failed))}")
    return ok
