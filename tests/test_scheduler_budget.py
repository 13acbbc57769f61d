"""The scheduler's split budget (SchedulerConfig.prefill_budget, off by default): with it, a step prefills
up to its own budget of prompt tokens however many rows decode, never more, and places freed by
finished requests are refilled in the next step; without it, decode rows eat the shared budget first.
The engine with it gives every request the tokens it gets with the default rule and alone, bit for bit."""

from __future__ import annotations

import pytest

import memra
from conftest import DEVICE
from memra.engine.scheduler import Scheduler, SchedulerConfig
from memra.engine.types import EngineConfig
from memra.errors import MemraError
from memra.sampling import SamplingParams
from test_scheduler import report, step


def wide(prefill_budget: int | None, rows: int = 40, budget: int = 64) -> Scheduler:
    """`rows` sequences decoding (1-token prompts, long outputs) under a token budget of `budget`."""
    sched = Scheduler(SchedulerConfig(max_running=rows + 8, token_budget=budget, prefill_align=16, total_blocks=4096,
                                      max_waiting=64, prefill_budget=prefill_budget))
    for i in range(rows):
        sched.add(f"d{i}", 1, 1000)
    while len(step(sched).decode) < rows:  # every row started and decodes
        pass
    return sched


@pytest.mark.parametrize("kwargs", [{"prefill_budget": 0}, {"prefill_budget": 8, "prefill_align": 16},
                                    {"prefill_budget": 2.5}, {"prefill_budget": True}])
def test_config_refuses_a_bad_prefill_budget(kwargs):
    with pytest.raises(ValueError, match="SchedulerConfig"):
        SchedulerConfig(**kwargs)


@pytest.mark.parametrize("bad", [-64, 32, 64.0])
def test_the_engine_config_refuses_a_bad_prefill_budget(bad):
    with pytest.raises(MemraError, match="prefill_budget"):
        EngineConfig(prefill_budget=bad)


def test_the_default_budget_is_split_only_where_mixed_steps_are_captured():
    """EngineConfig.split_budget: None (the default) is the largest captured mixed step's prompt bucket for a
    wide batch whose mixed steps are graphs (512, or what MEMRA_MIXED_TOKENS raises it to), else shared; 0 is
    shared everywhere; a number is itself."""
    wide, narrow = EngineConfig(max_batch=256), EngineConfig(max_batch=128)
    assert wide.split_budget(512) == 512 and wide.split_budget(2048) == 2048 and wide.split_budget(0) is None
    assert narrow.split_budget(512) is None
    assert EngineConfig(max_batch=256, prefill_budget=0).split_budget(512) is None
    assert EngineConfig(prefill_budget=128).split_budget(0) == 128


def test_a_step_takes_at_most_max_pieces_prefill_chunks_and_the_rest_wait_their_turn():
    """max_pieces (a captured mixed step's piece entries less its padding piece): a step prefills at most that
    many chunks; the others wait in order (nobody younger starts first) and every request still finishes."""
    with pytest.raises(ValueError, match="max_pieces"):
        SchedulerConfig(max_pieces=0)
    sched = Scheduler(SchedulerConfig(max_running=40, token_budget=4096, prefill_align=16, total_blocks=4096,
                                      max_waiting=64, prefill_budget=2048, max_pieces=3))
    for i in range(10):
        sched.add(f"r{i}", 40 if i % 2 else 20, 3)
    first = step(sched)
    assert [rid for rid, _, _ in first.prefill] == ["r0", "r1", "r2"]
    second = step(sched)
    assert [rid for rid, _, _ in second.prefill] == ["r3", "r4", "r5"] and second.decode == ["r0", "r1", "r2"]
    for _ in range(20):
        plan = step(sched)
        assert len(plan.prefill) <= 3
        if plan.empty:
            break
    assert sched.num_waiting() == 0 and sched.schedule().empty  # everyone finished


def test_shared_budget_starves_prefill_under_wide_decode_and_the_split_one_does_not():
    shared, split = wide(None), wide(48)
    for sched in (shared, split):
        sched.add("p", 100, 4)
    a, b = step(shared), step(split)
    assert len(a.decode) == len(b.decode) == 40
    assert a.prefill == [("p", 0, 16)]  # 64 - 40 decode rows = 24, cut down to the 16-token grid
    assert b.prefill == [("p", 0, 48)]  # its own 48 tokens, whatever the decode rows took


def test_split_budget_caps_prefill_even_with_few_rows_and_caps_decode_rows_by_token_budget():
    sched = Scheduler(SchedulerConfig(max_running=80, token_budget=64, prefill_align=16, total_blocks=4096,
                                      max_waiting=128, prefill_budget=32))
    for i in range(70):
        sched.add(f"r{i}", 20, 3)
    for _ in range(200):
        plan = sched.schedule()
        if plan.empty:
            break
        assert sum(n for _, _, n in plan.prefill) <= 32
        assert len(plan.decode) <= 64
        report(sched, plan)
    assert sched.num_waiting() == 0 and sched.schedule().empty  # everyone finished


def test_places_freed_by_finished_requests_are_refilled_in_the_next_step():
    """A decode row that reaches max_tokens frees its place at step_done; the next step admits the
    waiting request in its place (no hold: the default grouping holds nothing)."""
    sched = Scheduler(SchedulerConfig(max_running=4, token_budget=64, prefill_align=16, total_blocks=256,
                                      prefill_budget=64))
    for i, out in enumerate((2, 5, 5, 5)):
        sched.add(f"r{i}", 8, out)
    sched.add("w", 8, 3)
    first = step(sched)
    assert {rid for rid, _, _ in first.prefill} == {"r0", "r1", "r2", "r3"}
    assert step(sched).decode == ["r0", "r1", "r2", "r3"]  # r0's second and last token: it ends here
    third = step(sched)
    assert third.prefill == [("w", 0, 8)] and third.decode == ["r1", "r2", "r3"]


def test_the_engine_with_a_split_budget_gives_every_request_its_tokens():
    """Split budget on and off, and each request alone: the same tokens (scheduling moves when a row
    runs, never what it computes). A 64-token prefill budget cuts the longer prompts into several chunks
    while the others decode."""
    prompts = ["ROMEO:", "JULIET:\nO Romeo, Romeo, wherefore art thou Romeo? Deny thy father and refuse thy name",
               "First Citizen:\n" + "Before we proceed any further, hear me speak. You are all resolved rather to die. " * 4,
               "KING LEAR:\nBlow, winds,", "HAMLET:\nTo be, or not to be"] * 2
    params = [SamplingParams(temperature=0.0 if i % 3 == 0 else 0.9, seed=i, max_tokens=10 + 3 * (i % 4))
              for i in range(len(prompts))]
    default = memra.LLM("demo", device=DEVICE, max_batch=4, max_ctx=256, warm_up=False)
    split = memra.LLM(default.model, max_batch=4, max_ctx=256, warm_up=False, prefill_budget=64)
    assert split.engine.scheduler.cfg.prefill_budget == 64 and default.engine.scheduler.cfg.prefill_budget is None
    plans = []
    schedule = split.engine.scheduler.schedule
    split.engine.scheduler.schedule = lambda: (plan := schedule(), plans.append(plan))[0]
    got = [o.outputs[0].token_ids for o in split.generate(prompts, params, use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in default.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert all(sum(n for _, _, n in p.prefill) <= 64 for p in plans)
    assert any(p.prefill and p.decode for p in plans)  # the rule was live: prefill ran beside decode rows
    assert any(start > 0 for p in plans for _, start, _ in p.prefill)  # and cut a prompt into chunks
    alone = [default.generate([p], [sp], use_tqdm=False)[0].outputs[0].token_ids for p, sp in zip(prompts[:3], params)]
    assert alone == got[:3]
