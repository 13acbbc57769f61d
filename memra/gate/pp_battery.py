"""The stage-split exactness battery (`memra gate MODEL --mode pp`): split == unsplit, to the bit.

Method (the reference battery's): the reference is the unsplit batched body with the PP door SHUT,
fed its own greedy stream; its inputs are recorded, so a mismatch can never desync the comparison.
Then, per batch width B (uneven prompts, so rows sit at different positions):

    arm1  split            door open, stage-owned caches, the split body; repeated `reps` times (a
                           race between stages is a flake class: one green replay is no evidence)
    arm2  unsplit@ppcache  door open, stage-owned caches, but MEMRA_BATCH_PP=0 forces the unsplit
                           walk (MEMRA_PP_ALLOW_UNSPLIT_BATCH=1 passes its guard). Placement held,
                           walk varied: arm1 FAIL + arm2 PASS localises a bug to the split itself.
    arm3  epilogue         the last stage's epilogue: greedy device tokens == host argmax of the
                           returned row; lean-parked logits == the full row (mixed rows)
    arm4  B=1 path         decode_step (the B=1 body) under the split == the batched body at B=1
    dual negative cells    (dual routed) MEMRA_DUAL_PP=1 with MEMRA_PP_OVERLAP=0, and with
                           MEMRA_PP_HOST_BOUNCE=1: the exact refusal, every cache position unmoved
    prime-batch            several prompts primed in shared forwards through the split == each alone
                           (memra.gate.prime_batch_arm; PRIME_BATCHES and PRIME_BATCH_SPLITS advance)
    liveness               split walks ran; under dual, DUAL_PP_OVERLAPS advanced; prime pieces
                           crossed the split (PRIME_SPLIT_CHUNKS)

MEMRA_GATE_CANARY=1 feeds arm1 one wrong token; the battery must then FAIL.

`run_pp_dist_battery` (the last section; `--transport dist`) checks the same promise with every stage
in its own process (memra.pp.dist).
"""

from __future__ import annotations

from typing import Callable

import torch

from memra import counters
from memra.errors import MemraError
from memra.gate.battery import Ledger, bits_equal, gate_prompts, maxdiff
from memra.gate.prime_batch_arm import PRIME_BATCH_LONG, prime_batch_prompts, run_prime_batch_arm
from memra.pp import fence as pf
from memra.sampling import DevSamp


def with_doors(model, **doors: str | None):
    """`model` as an arm runs it with other doors (HybridModel.with_doors): never by changing the environment."""
    return model.with_doors(**doors)


def record_reference(model, prompts, ctx: int, steps: int):
    """Door shut, the unsplit batched body on ordinary caches: -> (prompts, each prompt's prime logits,
    each step's input tokens, each step's rows), all on the host. The reference every pp arm (in this
    process or across processes) is held to."""
    shut = with_doors(model, MEMRA_PP_STAGES=None)
    caches = [shut.new_cache(ctx) for _ in prompts]
    primed = [shut.prime(p, c).cpu() for p, c in zip(prompts, caches)]
    toks, inputs, rows = [p[-1] for p in prompts], [], []
    for _ in range(steps):
        inputs.append(list(toks))
        rows.append(shut.decode_step_batch(toks, caches).cpu())
        toks = rows[-1].argmax(-1).tolist()
    for c in caches:
        c.free()
    return prompts, primed, inputs, rows


def run_pp_battery(model, stages: int = 2, batches: tuple[int, ...] = (1, 4, 8), steps: int = 8, reps: int = 2,
                   plen: int = 20, out: Callable[[str], None] = print) -> bool:
    from memra.pp.walk import active_runtime

    if stages < 2:
        raise MemraError("--mode pp needs --stages >= 2")
    seed, canary = model.settings.gate_seed, model.settings.gate_canary
    ledger = Ledger(out)
    vocab = model.cfg.vocab_size
    ctx = plen + 5 * max(batches) + steps + 16
    # Every reference first: the runtime shards the weights onto the stage devices in place, after
    # which the door-shut unsplit body would meet remote weights on a cross-device placement.
    references = {b: record_reference(model, gate_prompts(b, plen, seed, vocab), ctx, steps) for b in batches}
    split = with_doors(model, MEMRA_PP_STAGES=str(stages))  # the model as the split arms run it
    rt = active_runtime(split)
    if rt is None:
        raise MemraError(f"pp mode: the PP door did not open for {stages} stages over {model.cfg.n_layers} layers "
                         "(check MEMRA_PP_SPLITS / MEMRA_PP_SPLIT)")
    pp_doors = pf.PpDoors.from_env(split.settings.pp_env)
    knobs = (f"stages={stages} fence={list(rt.fence.bounds)} transports="
             f"{','.join(bd.transport.kind.value for bd in rt.boundaries) or '-'} {pp_doors.summary()}")
    dual = pf.dual_pp_on(split.settings.pp_env)  # the dual body is asked for (its negative cells apply)
    peer = any(bd.transport.kind is pf.BoundaryTransport.PEER for bd in rt.boundaries)

    def routed(b: int) -> bool:  # ... and it runs at width b (Auto: only over a peer boundary)
        auto_ok = peer or pp_doors.dual_pp is not pf.DualPpMode.AUTO
        return auto_ok and pf.dual_pp_route(pp_doors.dual_pp, b, stages, pp_doors.overlap, pp_doors.host_bounce)
    out(f"pp mode: stage-split exactness battery over {model.cfg.n_layers} layers; {knobs}")
    out(f"pp mode: batches={list(batches)} steps={steps} reps={reps} seed={seed}{' CANARY (must FAIL)' if canary else ''}")

    def pp_caches(prompts):
        caches = [rt.new_cache(ctx) for _ in prompts]
        for p, c in zip(prompts, caches):
            split.prime(p, c)
        return caches

    if dual:
        _dual_negative_cells(split, pp_caches, plen, seed, vocab, ledger)

    for b in batches:
        prompts, _, inputs, ref = references[b]
        out(f"-- B={b}: reference recorded ({steps} steps x {b} rows, door shut)")

        # ---- arm1: the split, repeated ----
        for rep in range(max(reps, 1)):
            before = counters.snapshot()
            caches = pp_caches(prompts)
            primed = counters.delta(before)
            for s, toks in enumerate(inputs):
                feed = list(toks)
                if canary and s == 1:
                    feed[0] = (feed[0] + 1) % vocab
                rows = split.decode_step_batch(feed, caches).cpu()
                _check(ledger, "arm1", f"split B={b} rep{rep}", s, rows, ref[s])
            d = counters.delta(before)
            if d["pp_split_walks"] < steps or primed["prime_split_chunks"] < b:
                ledger.fail("liveness", f"B={b} rep{rep}: split walks +{d['pp_split_walks']}, "
                                        f"prime split chunks +{primed['prime_split_chunks']}")
            if routed(b):
                if d["dual_pp_overlaps"] == 0:
                    ledger.fail("liveness", f"B={b} rep{rep}: DUAL_PP_OVERLAPS did not advance")
                else:
                    out(f"dual pp liveness PASS [B={b} rep{rep}]: DUAL_PP_OVERLAPS +{d['dual_pp_overlaps']}")
        # ---- arm2: unsplit walk over the pipeline's cache placement ----
        caches = pp_caches(prompts)
        unsplit = with_doors(split, MEMRA_BATCH_PP="0", MEMRA_PP_ALLOW_UNSPLIT_BATCH="1")
        for s, toks in enumerate(inputs):
            _check(ledger, "arm2", f"unsplit@ppcache B={b}", s, unsplit.decode_step_batch(toks, caches).cpu(), ref[s])
        # ---- arm3: the last stage's epilogue ----
        caches = pp_caches(prompts)
        full_caches = pp_caches(prompts)
        for s, toks in enumerate(inputs[: min(steps, 3)]):
            greedy = [DevSamp(temperature=0.0, seed=0, ctr=s) for _ in toks]
            rows, picked = split.decode_step_batch_sampled(toks, full_caches, greedy, lean=False)
            mixed = [DevSamp(temperature=0.0, seed=0, ctr=s) if i % 2 == 0 else None for i in range(len(toks))]
            lean_rows, lean_picked = split.decode_step_batch_sampled(toks, caches, mixed, lean=True)
            for i in range(len(toks)):
                if picked[i] != int(rows[i].argmax()):
                    ledger.fail("arm3", f"B={b} step {s} row {i}: device greedy {picked[i]} != host argmax")
                parked = caches[i].last_logits_dev if mixed[i] is not None else lean_rows[i]
                if parked is None or not bits_equal(parked.cpu(), rows[i]):
                    ledger.fail("arm3", f"B={b} step {s} row {i}: lean row differs from the full row")
                if not bits_equal(rows[i], ref[s][i]):
                    ledger.fail("arm3", f"B={b} step {s} row {i}: epilogue row differs from the reference")
        # ---- arm4: the B=1 body under the split vs the batched body at B=1 ----
        c1, c2 = pp_caches(prompts[:1]) + pp_caches(prompts[:1])
        for s, toks in enumerate(inputs):
            a = split.decode_step(toks[0], c1).cpu()
            z = split.decode_step_batch([toks[0]], [c2])[0].cpu()
            if not (bits_equal(a, z) and bits_equal(a, ref[s][0])):
                ledger.fail("arm4", f"B={b} step {s}: B=1 body {maxdiff(a, ref[s][0]):.3g} from the reference")

    # ---- the cross-request prefill through the split: each prompt's prime == alone ----
    run_prime_batch_arm(split, prime_batch_prompts(plen, seed, vocab), ctx + PRIME_BATCH_LONG, canary, ledger, split=True)

    ledger.verdict("arm1", f"split == unsplit, batches {list(batches)} x {reps} reps, bit-checked")
    ledger.verdict("arm2", "unsplit walk over stage-owned caches == reference")
    ledger.verdict("arm3", "last-stage epilogue: greedy == argmax, lean park == full row")
    ledger.verdict("arm4", "B=1 body under the split == batched body")
    if dual:
        ledger.verdict("dual-negative", "single-slot and host-bounce cells refused, caches unmoved")
    ledger.verdict("liveness", "split walks, split prime pieces" + (", dual overlaps" if any(map(routed, batches)) else ""))
    fails = sum(1 for v in ledger.failed.values() if v)
    out(f"pp mode verdict: {fails} failing arm(s); {knobs}")
    if fails == 0:
        out(f"ALL GREEN: batched PP-{stages} stage-split exactness battery")
    return fails == 0


def _check(ledger: Ledger, arm: str, label: str, step: int, rows: torch.Tensor, ref: torch.Tensor) -> None:
    for i in range(ref.shape[0]):
        if not bits_equal(rows[i], ref[i]):
            ledger.fail(arm, f"{label} step {step} row {i}: max |d| {maxdiff(rows[i], ref[i]):.3g}")


def _dual_negative_cells(split, pp_caches, plen, seed, vocab, ledger: Ledger) -> None:
    """The dual body asked for where it cannot run must refuse with the exact text, before any
    token is produced or any cache position moves."""
    stages = active_runtime_stages(split)
    prompts = gate_prompts(2, plen, seed, vocab)
    toks = [p[-1] for p in prompts]
    cells = (
        ({"MEMRA_DUAL_PP": "1", "MEMRA_PP_OVERLAP": "0"}, pf.DUAL_PP_SINGLE_SLOT_REFUSAL if stages == 2 else pf.DUAL_PP_TWO_STAGES_REFUSAL),
        ({"MEMRA_DUAL_PP": "1", "MEMRA_PP_OVERLAP": "1", "MEMRA_PP_HOST_BOUNCE": "1"},
         pf.DUAL_PP_HOST_BOUNCE_REFUSAL if stages == 2 else pf.DUAL_PP_TWO_STAGES_REFUSAL),
    )
    for values, expected in cells:
        caches = pp_caches(prompts)
        before = [c.pos for c in caches]
        try:
            with_doors(split, **values).decode_step_batch(toks, caches)
            ledger.fail("dual-negative", f"{values}: produced rows instead of refusing")
        except pf.PipelineError as err:
            if str(err) != expected or [c.pos for c in caches] != before:
                ledger.fail("dual-negative", f"{values}: wrong refusal or cache moved: {err}")
            else:
                ledger.out(f"dual pp negative PASS: {err}")


def active_runtime_stages(model) -> int:
    from memra.pp.walk import active_runtime

    return active_runtime(model).n_stages


# ---------------------------------------------------------------------------------------------------
# --transport dist: the same promise with every stage in its own process (memra.pp.dist)
# ---------------------------------------------------------------------------------------------------


def run_pp_dist_battery(model, stages: int = 2, batches: tuple[int, ...] = (1, 4), steps: int = 8, reps: int = 2,
                        plen: int = 20, out: Callable[[str], None] = print, pipeline=None) -> bool:
    """Split across processes == unsplit single-process, bit for bit (`memra gate --mode pp --transport dist`).

        reference  this process, PP door shut, the unsplit model: each prompt's prime logits, then the
                   batched decode fed its own greedy stream (inputs recorded), per width B
        prime      pipeline.prime == the reference's prime logits, every prompt; all_logits for one
        decode     per width B, `reps` times on fresh sequences: pipeline.decode_step_batch rows == reference
        b1         pipeline.decode_step (the B=1 call) == the reference's B=1 rows
        verify     decode_step_t over T=2 and T=3 of the B=1 stream: every column == the decode row at its
                   position; each round drops its last token on every rank (trail rollback)
        liveness   rank 0 sent and received through the process group (PP_DIST_SENDS / PP_DIST_REPLIES);
                   every worker reports the rows and prime pieces it ran; no sequence is left on any rank
        shutdown   (own pipeline) SHUTDOWN reached every rank and every worker exited 0

    MEMRA_GATE_CANARY=1 makes the stage receiving decode step 1 (B = the first width, rep 0) flip one byte
    of its boundary payload — a real corruption on the real path; the battery must then FAIL.
    `pipeline`: a running DistPipeline whose rank 0 holds the full model (keep_full_model=True); by
    default one is launched here (ranks 1..stages-1 on this machine) and shut down at the end.
    """
    from memra.pp.dist import launch_local
    from memra.state_trail import StateTrail

    seed, canary = model.settings.gate_seed, model.settings.gate_canary
    ledger = Ledger(out)
    vocab = model.cfg.vocab_size
    ctx = plen + 5 * max(batches) + steps + 16
    widths = sorted(set(batches) | {1})  # the B=1 stream also feeds the b1 and verify arms

    # ---- reference: door shut, this process, the unsplit model ----
    ref = {b: record_reference(model, gate_prompts(b, plen, seed, vocab), ctx, steps) for b in widths}
    shut = with_doors(model, MEMRA_PP_STAGES=None)
    all_ref = shut.prime(ref[1][0][0], shut.new_cache(ctx), all_logits=True).cpu()

    pipe = pipeline if pipeline is not None else launch_local(model, stages, keep_full_model=True)
    if pipe.n_stages != stages:
        raise MemraError(f"the pipeline has {pipe.n_stages} stages, the battery was asked for {stages}")
    out(f"pp dist mode: {stages} processes over {model.cfg.n_layers} layers, fence={list(pipe.fence.bounds)}, "
        f"backend={pipe.dist_cfg.backend}, timeout={pipe.dist_cfg.timeout_s:g}s")
    for line in pipe.description.splitlines():
        out(f"  {line}")
    out(f"pp dist mode: batches={list(batches)} steps={steps} reps={reps} seed={seed}"
        f"{' CANARY (must FAIL)' if canary else ''}")
    before = counters.snapshot()
    decode_calls = 0
    try:
        worker_before = pipe.stats()[1:]
        # ---- prime ----
        for b in batches:
            prompts, primed = ref[b][0], ref[b][1]
            for i, p in enumerate(prompts):
                c = pipe.new_cache(ctx)
                got = pipe.prime(p, c).cpu()
                if not bits_equal(got, primed[i]):
                    ledger.fail("prime", f"B={b} prompt {i}: max |d| {maxdiff(got, primed[i]):.3g}")
                c.free()
        c = pipe.new_cache(ctx)
        got = pipe.prime(ref[1][0][0], c, all_logits=True).cpu()
        if not bits_equal(got, all_ref):
            ledger.fail("prime", f"all_logits [T, V]: max |d| {maxdiff(got, all_ref):.3g}")
        c.free()
        # ---- decode: the batched call, repeated on fresh sequences ----
        for b in batches:
            prompts, _, inputs, rows = ref[b]
            for rep in range(max(reps, 1)):
                caches = [pipe.new_cache(ctx) for _ in prompts]
                for p, c in zip(prompts, caches):
                    pipe.prime(p, c)
                for s, toks in enumerate(inputs):
                    if canary and rep == 0 and s == 1 and b == batches[0]:
                        pipe.arm_canary()
                    _check(ledger, "decode", f"B={b} rep{rep}", s, pipe.decode_step_batch(toks, caches).cpu(), rows[s])
                    decode_calls += 1
                for c in caches:
                    c.free()
        # ---- b1: the B=1 call ----
        prompts, _, inputs, rows = ref[1]
        c = pipe.new_cache(ctx)
        pipe.prime(prompts[0], c)
        for s, toks in enumerate(inputs):
            got = pipe.decode_step(toks[0], c).cpu()
            decode_calls += 1
            if not bits_equal(got, rows[s][0]):
                ledger.fail("b1", f"step {s}: max |d| {maxdiff(got, rows[s][0]):.3g}")
        c.free()
        # ---- verify + rollback on every rank ----
        for t in (2, 3):
            c, trail, s, rounds = pipe.new_cache(ctx), StateTrail(), 0, 0
            pipe.prime(prompts[0], c)
            while s + t <= steps:
                pos0 = c.pos
                logits, _ = pipe.decode_step_t([inputs[s + j][0] for j in range(t)], pos0, c, trail)
                for j in range(t):
                    if not bits_equal(logits[j].cpu(), rows[s + j][0]):
                        ledger.fail("verify", f"T={t} round {rounds} column {j}: max |d| "
                                              f"{maxdiff(logits[j], rows[s + j][0]):.3g}")
                c.rollback(pos0, t - 1, trail)
                s, rounds = s + t - 1, rounds + 1
            c.free()
        # ---- liveness ----
        stats = pipe.stats()
        d = counters.delta(before)
        if d["pp_dist_sends"] <= 0 or d["pp_dist_replies"] < decode_calls:
            ledger.fail("liveness", f"rank 0 sent {d['pp_dist_sends']} messages and received {d['pp_dist_replies']} "
                                    f"replies for {decode_calls} decode calls")
        for w0, w in zip(worker_before, stats[1:]):
            rows_run, pieces = w["rows"] - w0["rows"], w["pieces"] - w0["pieces"]
            out(f"pp dist liveness: rank {w['rank']} ran {rows_run} decode rows, {pieces} prime pieces, "
                f"{w['verifies'] - w0['verifies']} verifies; {w['sequences']} sequences left")
            if rows_run <= 0 or pieces <= 0 or w["sequences"] != 0:
                ledger.fail("liveness", f"rank {w['rank']}: rows +{rows_run}, pieces +{pieces}, "
                                        f"{w['sequences']} sequences left")
            if canary and w["rank"] == 1 and w["canaries"] - w0["canaries"] != 1:
                ledger.fail("liveness", f"rank 1 applied {w['canaries'] - w0['canaries']} canaries, expected 1")
    except pf.PipelineError as err:
        ledger.fail("pipeline", str(err))
    finally:
        if pipeline is None:
            codes = pipe.shutdown()
            if any(code != 0 for code in codes.values()):
                ledger.fail("shutdown", f"worker exit codes {codes}")
            else:
                out(f"pp dist shutdown: workers exited {codes}")
    ledger.verdict("prime", "split prime logits == unsplit, every prompt, and all_logits")
    ledger.verdict("decode", f"split rows == unsplit, batches {list(batches)} x {reps} reps, bit-checked")
    ledger.verdict("b1", "decode_step across processes == unsplit B=1 rows")
    ledger.verdict("verify", "verify columns == decode rows, trail rollback on every rank")
    ledger.verdict("liveness", "process-group sends/replies, worker rows and pieces, no leaked sequences")
    if ledger.failed.get("pipeline"):
        ledger.verdict("pipeline", "the pipeline stayed up")
    if pipeline is None:
        ledger.verdict("shutdown", "orderly shutdown, every worker exited 0")
    fails = sum(1 for v in ledger.failed.values() if v)
    out(f"pp dist mode verdict: {fails} failing arm(s); fence={list(pipe.fence.bounds)}")
    if fails == 0:
        out(f"ALL GREEN: PP-{stages} across processes (dist transport) exactness battery")
    return fails == 0
