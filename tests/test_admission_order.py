"""The waiting queue's order (MEMRA_ADMISSION_ORDER; memra.engine.admission.enqueue): first come first served,
or longest output first. The order decides when a request starts, never what it produces."""

from __future__ import annotations

import random
from collections import deque

import pytest

import memra
from memra.engine.admission import enqueue
from memra.engine.engine import Engine, EngineConfig
from memra.engine.scheduler import Scheduler, SchedulerConfig
from memra.errors import MemraError
from memra.sampling import SamplingParams
from memra.settings import Settings
from test_scheduler import step


def starts(longest_first: bool, asks: dict[str, int], late: dict[str, int] | None = None) -> list[str]:
    """The rids in the order they start, one running at a time; `late` ones are added after the first step."""
    sched = Scheduler(SchedulerConfig(max_running=1, token_budget=256, prefill_align=16, total_blocks=64,
                                      longest_first=longest_first))
    for rid, n in asks.items():
        sched.add(rid, 20, n)
    order = []
    while sched.num_running() or sched.num_waiting():
        order += [rid for rid, start, _ in step(sched).prefill if start == 0]
        for rid, n in (late or {}).items():
            sched.add(rid, 20, n)
        late = None
    return order


def test_longest_output_first_starts_the_largest_max_tokens_first_and_equal_ones_in_arrival_order():
    asks = {"a": 3, "b": 40, "c": 10, "d": 40, "e": 1}
    assert starts(False, asks) == ["a", "b", "c", "d", "e"]
    assert starts(True, asks) == ["b", "d", "c", "a", "e"]
    # one that comes later passes the waiting ones that ask for fewer tokens, not the one already running
    assert starts(True, asks, late={"f": 20}) == ["b", "d", "f", "c", "a", "e"]
    assert starts(False, asks, late={"f": 20}) == ["a", "b", "c", "d", "e", "f"]


def test_the_queue_is_a_stable_sort_by_max_tokens_and_fcfs_is_arrival_order():
    rng = random.Random(5)
    asks = {f"r{i}": rng.choice((1, 2, 16, 160, 1024)) for i in range(2000)}
    for longest_first in (False, True):
        waiting: deque[str] = deque()
        for rid in asks:
            enqueue(waiting, rid, asks.__getitem__, longest_first)
        arrival = list(asks)
        assert list(waiting) == (sorted(arrival, key=lambda r: -asks[r]) if longest_first else arrival)


def test_the_door_takes_auto_fcfs_or_lof_and_refuses_anything_else_by_name():
    assert Settings.from_env({}).admission_order == "auto"
    assert Settings.from_env({"MEMRA_ADMISSION_ORDER": " LOF "}).as_env()["MEMRA_ADMISSION_ORDER"] == "lof"
    with pytest.raises(MemraError, match="MEMRA_ADMISSION_ORDER='sjf' is not one of auto, fcfs, lof"):
        Settings.from_env({"MEMRA_ADMISSION_ORDER": "sjf"})


def test_auto_is_longest_first_in_llm_and_first_come_in_a_served_engine():
    """auto resolves by the engine's kind: memra.LLM takes a whole run at once (lof), the server's engine a
    stream (fcfs); a named order holds in both."""
    for order, offline, want in [("auto", True, True), ("auto", False, False), ("fcfs", True, False),
                                 ("lof", False, True)]:
        assert EngineConfig(offline=offline).longest_first(order) is want, (order, offline)
    model = memra.load("demo", device="cpu")
    with memra.LLM(model, max_batch=2, max_ctx=64, warm_up=False) as llm:
        assert llm.engine.scheduler.cfg.longest_first
    engine = Engine(model, EngineConfig(max_batch=2, max_ctx=64))
    try:
        assert not engine.scheduler.cfg.longest_first
    finally:
        engine.shutdown(drain_timeout=0.0)


def test_an_engine_started_longest_first_gives_every_request_the_same_tokens():
    """Six prompts through two running places: with lof the two requests asking for the most tokens start first,
    and every request's tokens and logprobs equal the fcfs run's (beside other batchmates, at other steps)."""
    model = memra.load("demo", device="cpu")
    prompts = ["ROMEO:", "JULIET:", "Enter", "What", "O", "My lord,"]
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=n, logprobs=1)
              for i, n in enumerate((4, 9, 2, 12, 6, 3))]
    runs = {}
    for order in ("fcfs", "lof"):
        with memra.LLM(model.with_doors(MEMRA_ADMISSION_ORDER=order), max_batch=2, max_ctx=128) as llm:
            assert llm.engine.scheduler.cfg.longest_first is (order == "lof")
            runs[order] = llm.generate(prompts, params, use_tqdm=False)
    # the liveness of the door: the two that start first (together) are the first two, or the two longest
    first = {order: set(sorted(range(6), key=lambda i: out[i].metrics.first_token_time)[:2]) for order, out in runs.items()}
    assert first == {"fcfs": {0, 1}, "lof": {3, 1}}
    for a, b in zip(runs["fcfs"], runs["lof"]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [{t: lp.logprob for t, lp in d.items()} for d in a.outputs[0].logprobs] == \
            [{t: lp.logprob for t, lp in d.items()} for d in b.outputs[0].logprobs]
