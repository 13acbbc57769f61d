"""The verify stage-split battery (`memra gate MODEL --mode ppspec`): the T = K+1 verify forward
through the stage split == the unsplit verify, per logit column, per round, to the bit.

Why a battery of its own: the verify is not the batched decode body. It runs T columns of ONE
sequence, GDN token by token, attention over a prefix that grows inside the call, and it records a
state trail — more moving parts per stage than any decode, so the split gets its own proof.

Method (the reference battery's): the reference is the unsplit verify with the PP door SHUT over an
ordinary cache. Round 0 feeds the prompt's last token T times; each later round feeds the argmax of
every column of the previous round (every column steers the stream, so a perturbed interior column
changes what follows). Inputs are recorded and replayed, so the arms cannot desync. Per round:

    arm1  split             door open, stage-owned caches, MEMRA_SPEC_PP on; every logit column,
                            every h_seed column and cache.pos compared. Repeated `reps` times.
    arm2  unsplit@ppcache   door open, stage-owned caches, MEMRA_SPEC_PP=0 (the unsplit verify;
                            MEMRA_PP_ALLOW_UNSPLIT_BATCH=1 passes its guard). Placement held, walk
                            varied: arm1 FAIL + arm2 PASS localises a bug to the split itself.
    arm3  spec stream       a speculative generation (MTP drafter when the checkpoint has one, else
                            n-gram; K = T-1) under the split — verify, accept walk, rollback — emits
                            exactly the tokens plain greedy decoding emits with the door shut.
    liveness                split verifies ran in arm1 (SPEC_VERIFY_SPLIT_WALKS), none in arm2.

MEMRA_GATE_CANARY=1 feeds arm1 one wrong token; the battery must then FAIL.
"""

from __future__ import annotations

from typing import Callable

import torch

from memra import counters
from memra.errors import MemraError
from memra.gate.battery import Ledger, bits_equal, maxdiff
from memra.gate.pp_battery import with_doors
from memra.pp import fence as pf


def run_ppspec_battery(model, stages: int = 2, ts: tuple[int, ...] = (2, 5, 9), rounds: int = 6, reps: int = 2,
                       plen: int = 24, out: Callable[[str], None] = print) -> bool:
    from memra.generate import generate_tokens
    from memra.pp.walk import active_runtime
    from memra.sampling import SamplingParams
    from memra.spec import SpecConfig

    if stages < 2:
        raise MemraError("--mode ppspec needs --stages >= 2")
    if not ts or min(ts) < 1:
        raise MemraError(f"--ts takes verify widths >= 1, got {list(ts)}")
    seed, canary = model.settings.gate_seed, model.settings.gate_canary
    shut = with_doors(model, MEMRA_PP_STAGES=None)  # the reference: the unsplit model
    split = with_doors(model, MEMRA_PP_STAGES=str(stages))  # the model as the split arms run it
    ledger = Ledger(out)
    vocab = model.cfg.vocab_size
    prompt = [(55 + seed * 13 + j * 31) % vocab for j in range(plen)]

    def primed(m, new_cache, ctx):
        c = new_cache(ctx)
        m.prime(prompt, c)
        return c

    def reference(t: int):
        """Door shut, the unsplit verify on an ordinary cache, and plain greedy generation: -> (each
        round's (pos, input columns), logits, h_seed, pos after it, the plain greedy stream)."""
        inputs, ref_logits, ref_seed, ref_pos = [], [], [], []
        c = primed(shut, shut.new_cache, plen + rounds * t + 8)
        chunk = [prompt[-1]] * t
        for _ in range(rounds):
            inputs.append((c.pos, chunk))
            logits, h_seed = shut.decode_step_t(chunk, c.pos, c)
            ref_logits.append(logits.cpu())
            ref_seed.append(h_seed.cpu())
            ref_pos.append(c.pos)
            chunk = logits.argmax(-1).tolist()
        c.free()
        plain = list(generate_tokens(shut, prompt, SamplingParams(temperature=0.0, max_tokens=rounds * t + 4)))
        return inputs, ref_logits, ref_seed, ref_pos, plain

    # Every reference first: the runtime shards the weights onto the stage devices in place, after
    # which the door-shut unsplit body would meet remote weights on a cross-device placement.
    references = {t: reference(t) for t in ts}
    rt = active_runtime(split)
    if rt is None:
        raise MemraError(f"ppspec mode: the PP door did not open for {stages} stages over {model.cfg.n_layers} "
                         "layers (check MEMRA_PP_SPLITS / MEMRA_PP_SPLIT)")
    knobs = f"stages={stages} fence={list(rt.fence.bounds)} {pf.PpDoors.from_env(split.settings.pp_env).summary()}"
    out(f"ppspec mode: verify stage-split exactness battery over {model.cfg.n_layers} layers; {knobs}")
    out(f"ppspec mode: T={list(ts)} rounds={rounds} reps={reps} seed={seed}{' CANARY (must FAIL)' if canary else ''}")

    for t in ts:
        ctx = plen + rounds * t + 8
        inputs, ref_logits, ref_seed, ref_pos, plain = references[t]
        out(f"-- T={t}: reference recorded ({rounds} rounds x {t} columns x {vocab} logits + h_seed, door shut)")

        # ---- arm1: the split, repeated ----
        for rep in range(max(reps, 1)):
            c = primed(split, rt.new_cache, ctx)
            before = counters.snapshot()
            for r, (pos0, chunk) in enumerate(inputs):
                if c.pos != pos0:
                    ledger.fail("arm1", f"T={t} rep{rep} round {r}: cache at {c.pos}, reference at {pos0}")
                    break
                feed = list(chunk)
                if canary and r == 1:
                    feed[-1] = (feed[-1] + 1) % vocab
                logits, h_seed = split.decode_step_t(feed, pos0, c)
                _columns(ledger, "arm1", f"split T={t} rep{rep} round {r}", logits.cpu(), ref_logits[r])
                _columns(ledger, "arm1", f"split h_seed T={t} rep{rep} round {r}", h_seed.cpu(), ref_seed[r])
                if c.pos != ref_pos[r]:
                    ledger.fail("arm1", f"T={t} rep{rep} round {r}: the verify moved pos to {c.pos}, reference {ref_pos[r]}")
            d = counters.delta(before)
            if d["spec_verify_split_walks"] < rounds or d["pp_split_walks"] < rounds:
                ledger.fail("liveness", f"T={t} rep{rep}: split verifies +{d['spec_verify_split_walks']} "
                                        f"of {rounds}")
        # ---- arm2: the unsplit verify over the pipeline's cache placement ----
        c = primed(split, rt.new_cache, ctx)
        before = counters.snapshot()
        unsplit = with_doors(split, MEMRA_SPEC_PP="0", MEMRA_PP_ALLOW_UNSPLIT_BATCH="1")
        for r, (pos0, chunk) in enumerate(inputs):
            logits, _ = unsplit.decode_step_t(chunk, pos0, c)
            _columns(ledger, "arm2", f"unsplit@ppcache T={t} round {r}", logits.cpu(), ref_logits[r])
        if counters.delta(before)["spec_verify_split_walks"]:
            ledger.fail("liveness", f"T={t}: arm2 walked the split although MEMRA_SPEC_PP=0")

        # ---- arm3: a whole speculative stream under the split == plain greedy with the door shut ----
        spec = SpecConfig("mtp" if model.mtp else "ngram", k=max(t - 1, 1))
        params = SamplingParams(temperature=0.0, max_tokens=rounds * t + 4)
        before = counters.snapshot()
        spec_out = list(generate_tokens(split, prompt, params, speculative=spec))
        walks = counters.delta(before)["spec_verify_split_walks"]
        if spec_out != plain:
            first = next(i for i, (a, b) in enumerate(zip(spec_out + [-1], plain + [-2])) if a != b)
            ledger.fail("arm3", f"T={t} {spec.method} K={spec.k}: token {first} differs from plain greedy")
        elif walks == 0:
            ledger.fail("liveness", f"T={t}: the speculative stream ran no split verify")
        else:
            out(f"spec stream PASS [T={t} {spec.method} K={spec.k}]: {len(plain)} tokens == plain greedy, "
                f"{walks} split verifies")

    ledger.verdict("arm1", f"split verify == unsplit, T={list(ts)} x {reps} reps, every column + h_seed + pos")
    ledger.verdict("arm2", "unsplit verify over stage-owned caches == reference")
    ledger.verdict("arm3", "speculative stream under the split == plain greedy")
    ledger.verdict("liveness", "split verifies ran (and only where asked)")
    fails = sum(1 for v in ledger.failed.values() if v)
    out(f"ppspec mode verdict: {fails} failing arm(s); {knobs}")
    if fails == 0:
        out(f"ALL GREEN: spec-verify PP-{stages} stage-split exactness battery")
    return fails == 0


def _columns(ledger: Ledger, arm: str, label: str, got: torch.Tensor, ref: torch.Tensor) -> None:
    for j in range(ref.shape[0]):
        if not bits_equal(got[j], ref[j]):
            ledger.fail(arm, f"{label} column {j}: max |d| {maxdiff(got[j], ref[j]):.3g}")
