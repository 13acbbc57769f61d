"""The exact decode plan is settled when an engine is built, before its pools take the memory
(memra.decode_plan.settle_plan). Its on-model check draws BUCKET caches from the model's own pools, which
are sized from what is free when they are made: on an H100, a Qwen3.5-9B engine at max_batch 256 had left
them 35 recurrent slots, the check (run at the first decode) asked for 64, and the run stopped with "no free
recurrent-state slot"."""

from __future__ import annotations

import memra
from memra.engine.engine import Engine, EngineConfig


def test_the_engine_settles_the_plan_first_and_gives_the_checks_pools_back():
    model = memra.load("demo").with_doors(MEMRA_DECODE_PLAN="bucket")  # a plan whose on-model check runs on CPU
    assert not model.plan_verified and not model._pools
    engine = Engine(model, EngineConfig(max_batch=2, max_ctx=128))
    assert model.plan_verified == {("bucket", "cpu", model.ops.invariant): True}  # checked at build, not at a decode
    assert not model._pools  # the check's pools were dropped: the engine's own pools are all it holds
    engine.shutdown(drain_timeout=0.0)


def test_the_check_does_not_draw_on_a_budget_too_small_for_it():
    """A small --kv-memory (room for a few contexts and the engine's own slots) once stopped an engine at
    build on CUDA: the check's pools were made from that budget and held fewer recurrent slots than the
    check opens. Its pools are now sized for the check alone (memra.decode_plan.check_pools)."""
    from memra.cache import RecurrentPool, kv_pool
    from memra.pools import KvBudget

    probe = memra.load("demo")
    block = kv_pool(probe.cfg, 1, probe.dtype, "meta").block_bytes
    slot = RecurrentPool(probe.cfg, 1, probe.dtype, "meta").slot_bytes
    small = KvBudget(gib=(64 * block + 8 * slot) / (1 << 30))  # the engine's 2 rows fit; the check's 64 would not
    model = memra.load("demo", kv_budget=small).with_doors(MEMRA_DECODE_PLAN="bucket")
    engine = Engine(model, EngineConfig(max_batch=2, max_ctx=128))
    assert model.plan_verified == {("bucket", "cpu", model.ops.invariant): True}
    assert not model._pools
    engine.shutdown(drain_timeout=0.0)
