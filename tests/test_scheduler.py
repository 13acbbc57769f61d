"""The serving scheduler, without a model: budgets, alignment, order, preemption, cancels, liveness.

A fake engine executes each plan against its own record of where every sequence's state lives
(device, host, nowhere) and how many tokens it holds, so the block and slot bounds are checked
against what an engine would really hold, not only against the scheduler's own counters.
"""

from __future__ import annotations

import random

import pytest

from memra.engine.admission import PrefillGrouping
from memra.engine.scheduler import QueueFull, Scheduler, SchedulerConfig, Status, StepPlan
from memra.errors import MemraError


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def report(sched: Scheduler, plan: StepPlan, finish: set[str] = frozenset()) -> None:
    """Execute `plan` faithfully: every chunk written, every completed prompt and decode sampled."""
    prefilled = {rid: n for rid, _, n in plan.prefill}
    sampled = [rid for rid, start, n in plan.prefill if start + n == sched.get(rid).prompt_len] + list(plan.decode)
    done = [rid for rid in sampled if rid in finish or sched.get(rid).generated + 1 >= sched.get(rid).max_tokens]
    sched.step_done(prefilled, sampled, done)


def step(sched: Scheduler, finish: set[str] = frozenset()) -> StepPlan:
    plan = sched.schedule()
    report(sched, plan, finish)
    return plan


# --- config ---
@pytest.mark.parametrize("kwargs", [
    {"max_running": 0}, {"token_budget": -1}, {"prefill_align": 0}, {"max_waiting": 0}, {"block_size": 0},
    {"total_blocks": 0}, {"total_slots": 0}, {"token_budget": 32, "prefill_align": 64}, {"max_running": 2.5},
])
def test_config_rejects_bad_values(kwargs):
    with pytest.raises(ValueError, match="SchedulerConfig"):
        SchedulerConfig(**kwargs)


# --- prefill chunks ---
def test_chunk_cuts_land_on_aligned_positions():
    sched = Scheduler(SchedulerConfig(token_budget=100, prefill_align=64, total_blocks=64))
    sched.add("a", 300, 4)
    chunks = []
    while not sched.get("a").prefill_done:
        plan = step(sched)
        chunks += plan.prefill
    # 100 tokens of budget round down to the next multiple of 64; the last chunk ends at the prompt end.
    assert chunks == [("a", 0, 64), ("a", 64, 64), ("a", 128, 64), ("a", 192, 64), ("a", 256, 44)]
    assert sched.get("a").generated == 1  # the last chunk sampled the first token
    assert step(sched).decode == ["a"]


def test_budget_is_shared_and_an_unalignable_remainder_waits():
    sched = Scheduler(SchedulerConfig(token_budget=128, prefill_align=32, total_blocks=64))
    sched.add("a", 100, 8)
    sched.add("b", 100, 8)
    plan = step(sched)
    # a takes its whole prompt (the prompt end needs no alignment); b's 28 tokens would end at 28: not aligned.
    assert plan.prefill == [("a", 0, 100)]
    plan = step(sched)
    assert plan.decode == ["a"] and plan.prefill == [("b", 0, 100)]


def test_chunk_shrinks_to_the_free_blocks():
    sched = Scheduler(SchedulerConfig(token_budget=256, prefill_align=16, block_size=16, total_blocks=10))
    sched.add("a", 100, 50)  # 7 blocks after its prompt
    step(sched)
    sched.add("b", 100, 50)
    plan = step(sched)
    assert plan.decode == ["a"]  # 101 tokens: still 7 blocks
    assert plan.prefill == [("b", 0, 48)]  # the 3 free blocks, not the 255 tokens of budget left
    assert sched.free_blocks() == 0


# --- order ---
def test_waiting_requests_are_admitted_first_come_first_served():
    sched = Scheduler(SchedulerConfig(max_running=2, token_budget=256, prefill_align=16, total_blocks=64))
    for rid in "abcd":
        sched.add(rid, 20, 3)
    assert [rid for rid, _, _ in step(sched).prefill] == ["a", "b"]
    plan = step(sched, finish={"a"})
    assert plan.decode == ["a", "b"] and not plan.prefill
    assert [rid for rid, _, _ in step(sched).prefill] == ["c"]  # not d: c came first


def test_nobody_jumps_the_queue_when_the_head_cannot_start():
    # a decodes (1 token), leaving 63: b's 200-token prompt cannot cut at 63, so it waits — and the short
    # c behind it, which would fit, waits too.
    sched = Scheduler(SchedulerConfig(token_budget=64, prefill_align=64, block_size=16, total_blocks=64))
    sched.add("a", 10, 5)
    step(sched)
    sched.add("b", 200, 5)
    sched.add("c", 10, 5)
    order = []
    for _ in range(20):
        plan = step(sched)
        order += [rid for rid, start, _ in plan.prefill if start == 0]
        if sched.num_running() == 0 and sched.num_waiting() == 0:
            break
        assert not (status(sched, "c") is Status.RUNNING and status(sched, "b") is Status.WAITING)
    assert order == ["b", "c"]


def status(sched: Scheduler, rid: str) -> Status:
    try:
        return sched.get(rid).status
    except KeyError:  # finished sequences are forgotten
        return Status.FINISHED


def test_a_stuck_running_prefiller_holds_back_new_admissions():
    # d's decodes hold the blocks; p (running) needs a 64-aligned cut and has room for only 16 tokens.
    # The short w would fit those 16, but admitting it would take what p waits for: w waits too.
    sched = Scheduler(SchedulerConfig(token_budget=256, prefill_align=64, block_size=16, total_blocks=10))
    sched.add("d", 64, 60)
    sched.add("p", 100, 4)
    assert step(sched).prefill == [("d", 0, 64), ("p", 0, 64)]
    sched.add("w", 10, 2)
    plan = step(sched)
    assert plan.decode == ["d"] and plan.prefill == [] and sched.free_blocks() == 1
    while status(sched, "d") is not Status.FINISHED:
        plan = step(sched)
        assert "w" not in [rid for rid, _, _ in plan.prefill]
    assert [rid for rid, _, _ in step(sched).prefill] == ["p", "w"]


def preempted_pair(total_slots: int | None = None) -> Scheduler:
    """a and b decode in a 6-block pool of 4-token blocks until a needs a block: b (the latest) is swapped."""
    sched = Scheduler(SchedulerConfig(max_running=4, token_budget=64, prefill_align=4, block_size=4, total_blocks=6,
                                      total_slots=total_slots))
    sched.add("a", 8, 12)
    sched.add("b", 8, 12)
    for _ in range(20):
        plan = step(sched)
        if plan.swap_out:
            assert plan.swap_out == ["b"] and plan.decode == ["a"]
            return sched
    raise AssertionError("no preemption happened")


def test_swapped_sequences_resume_before_waiting_ones_are_admitted():
    sched = preempted_pair()
    sched.add("c", 4, 2)  # small enough to fit beside a: it must still wait for b
    resumed_at = admitted_at = None
    for i in range(40):
        plan = sched.schedule()
        if "b" in plan.swap_in:
            resumed_at = i
            assert "b" in plan.decode  # a resumed sequence runs in the step that swaps it in
        if any(rid == "c" for rid, _, _ in plan.prefill):
            admitted_at = i
            assert status(sched, "b") is not Status.SWAPPED
        report(sched, plan)
        if sched.num_running() + sched.num_waiting() == 0:
            break
    assert resumed_at is not None and admitted_at is not None and resumed_at <= admitted_at


def test_preemption_swaps_out_the_latest_arrival_not_the_sequence_in_need():
    sched = Scheduler(SchedulerConfig(token_budget=64, prefill_align=4, block_size=4, total_blocks=5))
    sched.add("a", 4, 8)  # 1 block, full: its next token needs a second
    sched.add("b", 6, 8)  # 2 blocks with room
    sched.add("c", 6, 8)  # 2 blocks with room
    step(sched)
    assert sched.free_blocks() == 0
    plan = step(sched)
    assert plan.swap_out == ["c"] and plan.decode == ["a", "b"]
    assert sched.get("c").status is Status.SWAPPED and sched.get("c").blocks == 0


def test_the_latest_arrival_preempts_itself_when_it_is_the_one_in_need():
    sched = Scheduler(SchedulerConfig(token_budget=64, prefill_align=4, block_size=4, total_blocks=5))
    sched.add("a", 6, 8)
    sched.add("b", 6, 8)
    sched.add("c", 4, 8)  # the one that needs a block, and the latest
    step(sched)
    plan = step(sched)
    assert plan.swap_out == ["c"] and plan.decode == ["a", "b"]


def test_prefillers_holding_every_block_do_not_deadlock():
    # Two prompts each hold half the pool mid-prefill and no block is free: neither could go on. FCFS
    # chunking rarely builds this state (it needs decoders that finished or were skipped for budget), so
    # it is set up directly. The older one swaps the younger out and proceeds.
    sched = Scheduler(SchedulerConfig(max_running=2, token_budget=128, prefill_align=64, block_size=16, total_blocks=8))
    for rid in "ab":
        sched.add(rid, 120, 8)
        s = sched.get(rid)
        s.status, s.prefilled, s.blocks = Status.RUNNING, 64, 4
    sched._waiting.clear()
    sched._free = 0
    plan = step(sched)
    assert plan.swap_out == ["b"] and plan.prefill == [("a", 64, 56)] and not plan.swap_in
    plan = step(sched)
    assert plan.decode == ["a"] and not plan.swap_in  # b (8 blocks once resumed) waits for a to finish


# --- bounds and refusals ---
def test_queue_full_at_max_waiting():
    sched = Scheduler(SchedulerConfig(max_running=1, max_waiting=3, total_blocks=64))
    for i in range(3):
        sched.add(f"r{i}", 10, 2)
    with pytest.raises(QueueFull):
        sched.add("r3", 10, 2)
    step(sched)  # r0 admitted: the queue has room again
    sched.add("r3", 10, 2)
    assert sched.num_waiting() == 3 and sched.num_running() == 1


def test_add_refuses_what_could_never_fit_and_duplicates():
    sched = Scheduler(SchedulerConfig(max_waiting=1, block_size=16, total_blocks=4))
    with pytest.raises(ValueError, match="KV blocks"):
        sched.add("x", 60, 5)  # 65 tokens -> 5 blocks of 16 > 4
    sched.add("y", 60, 4)  # exactly 64
    with pytest.raises(ValueError, match="already"):
        sched.add("y", 1, 1)
    with pytest.raises(ValueError):
        sched.add("z", 0, 1)
    with pytest.raises(ValueError, match="KV blocks"):  # a bad request is refused as such even when full
        sched.add("x", 60, 5)
    with pytest.raises(QueueFull):
        sched.add("w", 1, 1)


def test_kv_usage_follows_blocks():
    sched = Scheduler(SchedulerConfig(block_size=16, total_blocks=8, token_budget=64, prefill_align=16))
    assert sched.kv_usage == 0.0
    sched.add("a", 32, 4)
    plan = sched.schedule()
    assert sched.kv_usage == 2 / 8  # reserved for the step
    report(sched, plan)
    assert sched.kv_usage == 2 / 8 and sched.get("a").in_cache == 32
    step(sched)  # the decode writes token 33: a third block
    assert sched.kv_usage == 3 / 8
    sched.cancel("a")
    assert sched.kv_usage == 0.0


# --- cancel ---
def test_cancel_from_every_state_frees_its_resources():
    sched = preempted_pair(total_slots=4)
    sched.add("w", 4, 2)  # WAITING (b is swapped, so w is not admitted)
    assert [sched.get(r).status for r in "abw"] == [Status.RUNNING, Status.SWAPPED, Status.WAITING]
    for rid in ("w", "b"):
        held = sched.free_blocks()
        assert sched.cancel(rid) and not sched.cancel(rid)
        assert sched.free_blocks() == held  # neither holds blocks
        with pytest.raises(KeyError):
            sched.get(rid)
    assert sched.num_waiting() == 0 and sched.free_slots() == 3
    assert sched.cancel("a")  # RUNNING (decoding)
    assert sched.free_blocks() == 6 and sched.free_slots() == 4 and sched.num_running() == 0

    # RUNNING mid-prefill with its step in flight: the reservation comes back, the late report is ignored.
    sched = Scheduler(SchedulerConfig(token_budget=64, prefill_align=16, block_size=16, total_blocks=16, total_slots=2))
    sched.add("p", 200, 4)
    sched.add("q", 40, 4)
    step(sched)
    assert sched.get("p").prefilled == 64 and sched.get("p").status is Status.RUNNING
    plan = sched.schedule()
    assert sched.cancel("p") and sched.cancel("q")
    report_blind(sched, plan)
    assert sched.free_blocks() == 16 and sched.free_slots() == 2 and sched.schedule().empty


def report_blind(sched: Scheduler, plan: StepPlan) -> None:
    """Report a plan without asking the scheduler (its sequences may be gone)."""
    sched.step_done({rid: n for rid, _, n in plan.prefill}, list(plan.decode), [])


# --- the report ---
def test_step_done_checks_the_report_before_changing_anything():
    sched = Scheduler(SchedulerConfig(token_budget=64, prefill_align=16, total_blocks=64))
    sched.add("a", 100, 4)
    sched.add("b", 10, 4)
    plan = sched.schedule()
    assert plan.prefill == [("a", 0, 64)]
    with pytest.raises(RuntimeError):
        sched.schedule()  # the plan in flight was not reported
    with pytest.raises(ValueError, match="plan said"):
        sched.step_done({"a": 63}, [], [])
    with pytest.raises(ValueError, match="neither decoded"):
        sched.step_done({"a": 64}, ["a"], [])
    assert sched.get("a").prefilled == 0 and sched.get("a").generated == 0
    sched.step_done({}, [], [])  # the engine left a out: no progress, and its reservation comes back
    assert sched.get("a").prefilled == 0 and sched.free_blocks() == 64
    assert sched.schedule().prefill == [("a", 0, 64)]
    sched.step_done({"a": 64}, [], [])
    plan = sched.schedule()
    assert plan.prefill == [("a", 64, 36), ("b", 0, 10)]
    with pytest.raises(ValueError, match="no first token"):
        sched.step_done({rid: n for rid, _, n in plan.prefill}, [], [])
    report(sched, plan)


def test_a_sequence_at_max_tokens_is_finished_even_unreported():
    sched = Scheduler(SchedulerConfig(token_budget=64, prefill_align=16, total_blocks=8))
    sched.add("a", 5, 3)
    for _ in range(3):
        plan = sched.schedule()
        sched.step_done({rid: n for rid, _, n in plan.prefill}, [r for r, _, _ in plan.prefill] + plan.decode, [])
    with pytest.raises(KeyError):
        sched.get("a")
    assert sched.free_blocks() == 8 and sched.schedule().empty


# --- randomized simulation ---
CONFIGS = {
    "tight-blocks": SchedulerConfig(max_running=6, token_budget=96, prefill_align=32, max_waiting=8, block_size=16,
                                    total_blocks=24),
    "few-slots": SchedulerConfig(max_running=8, token_budget=128, prefill_align=16, max_waiting=5, block_size=8,
                                 total_blocks=40, total_slots=3),
    "budget-below-running": SchedulerConfig(max_running=10, token_budget=8, prefill_align=4, max_waiting=16,
                                            block_size=4, total_blocks=30),
    "many-short": SchedulerConfig(max_running=12, token_budget=8, prefill_align=4, max_waiting=16, block_size=4,
                                  total_blocks=40),
    "roomy": SchedulerConfig(max_running=16, token_budget=256, prefill_align=64, max_waiting=32, block_size=16,
                             total_blocks=128, total_slots=12),
    # the split budget (prefill_budget): prompt tokens charged apart from the decode rows
    "split-tight": SchedulerConfig(max_running=20, token_budget=16, prefill_align=16, max_waiting=8, block_size=16,
                                   total_blocks=24, prefill_budget=32),
    "split-slots": SchedulerConfig(max_running=10, token_budget=6, prefill_align=4, max_waiting=16, block_size=4,
                                   total_blocks=40, total_slots=5, prefill_budget=12),
}


class FakeEngine:
    """Where each sequence's state is and how many tokens it holds, as an engine would see it."""

    def __init__(self, cfg: SchedulerConfig):
        self.cfg = cfg
        self.where: dict[str, str] = {}  # rid -> "device" | "host" (absent: no state yet)
        self.pos: dict[str, int] = {}  # tokens in its cache

    def execute(self, sched: Scheduler, plan: StepPlan) -> None:
        for rid in plan.swap_out:
            assert self.where.get(rid) == "device", f"{rid}: swapped out but not on the device"
            self.where[rid] = "host"
        for rid in plan.swap_in:
            assert self.where.get(rid) == "host", f"{rid}: swapped in but not on the host"
            self.where[rid] = "device"
        for rid, start, n in plan.prefill:
            if rid not in self.where:  # a new admission
                assert start == 0 and rid not in plan.swap_in
                self.where[rid], self.pos[rid] = "device", 0
            assert self.where[rid] == "device" and self.pos[rid] == start
        for rid in plan.decode:
            assert self.where.get(rid) == "device"
        # What the device really holds during the step: blocks and slots within the pool.
        writes = {rid: n for rid, _, n in plan.prefill} | {rid: 1 for rid in plan.decode}
        on_device = [rid for rid, w in self.where.items() if w == "device"]
        held = sum(ceil_div(self.pos[r] + writes.get(r, 0), self.cfg.block_size) for r in on_device)
        assert held <= self.cfg.total_blocks
        assert len(on_device) <= self.cfg.max_admitted
        for rid, n in writes.items():
            self.pos[rid] += n

    def forget(self, rid: str) -> None:
        self.where.pop(rid, None)
        self.pos.pop(rid, None)


def check_plan(sched: Scheduler, plan: StepPlan, before: dict[str, Status]) -> None:
    """`before`: each live rid's status before schedule()."""
    cfg = sched.cfg
    runs = [rid for rid, _, _ in plan.prefill] + plan.decode
    assert len(runs) == len(set(runs)), "a sequence is scheduled twice"
    if cfg.prefill_budget is None:
        assert sum(n for _, _, n in plan.prefill) + len(plan.decode) <= cfg.token_budget
    else:
        assert sum(n for _, _, n in plan.prefill) <= cfg.prefill_budget and len(plan.decode) <= cfg.token_budget
    assert all(rid in before for rid in runs + plan.swap_out + plan.swap_in), "a finished sequence is in the plan"
    assert not set(plan.swap_out) & set(runs) and not set(plan.swap_out) & set(plan.swap_in)
    assert set(plan.swap_in) <= set(runs), "a resumed sequence runs in the step that swaps it in"
    for rid, start, n in plan.prefill:
        s = sched.get(rid)
        assert s.status is Status.RUNNING and start == s.prefilled and n > 0
        assert start + n <= s.prompt_len
        assert (start + n) % cfg.prefill_align == 0 or start + n == s.prompt_len, f"unaligned cut {rid} {start}+{n}"
        assert s.blocks >= ceil_div(s.in_cache + n, cfg.block_size)
    for rid in plan.decode:
        s = sched.get(rid)
        assert s.status is Status.RUNNING and s.prefill_done and 1 <= s.generated < s.max_tokens
        assert s.blocks >= ceil_div(s.in_cache + 1, cfg.block_size)
    for rid in plan.swap_out:
        assert before[rid] is Status.RUNNING and sched.get(rid).status is Status.SWAPPED
        # Victims are the latest arrivals: whatever younger is still running runs in this step (or holds no block).
        victim = sched.get(rid)
        for r in before:
            s = sched.get(r)
            if s.status is Status.RUNNING and s.arrival > victim.arrival:
                assert r in runs or s.blocks == 0, f"{rid} was preempted while the younger {r} sat idle"
    # Order: swapped resume oldest first, then waiting FCFS, and never while anything was preempted.
    def oldest_first(status: Status) -> list[str]:
        return sorted((r for r, st in before.items() if st is status), key=lambda r: sched.get(r).arrival)

    admitted = [rid for rid in runs if before[rid] is Status.WAITING]
    if plan.swap_out:
        assert not plan.swap_in and not admitted
    assert plan.swap_in == oldest_first(Status.SWAPPED)[:len(plan.swap_in)]
    assert sorted(admitted, key=lambda r: sched.get(r).arrival) == oldest_first(Status.WAITING)[:len(admitted)]
    if admitted:
        assert not any(sched.get(r).status is Status.SWAPPED for r in before), "admitted past a swapped sequence"


def check_state(sched: Scheduler, live: set[str]) -> None:
    cfg = sched.cfg
    seqs = [sched.get(rid) for rid in live]
    running = [s for s in seqs if s.status is Status.RUNNING]
    swapped = [s for s in seqs if s.status is Status.SWAPPED]
    assert all(s.status is not Status.FINISHED for s in seqs)
    assert sum(s.blocks for s in running) + sched.free_blocks() == cfg.total_blocks
    assert sched.free_blocks() >= 0 and all(s.blocks == 0 for s in seqs if s.status is not Status.RUNNING)
    assert all(s.blocks >= ceil_div(s.in_cache, cfg.block_size) for s in running)
    assert sched.num_running() == len(running) <= cfg.max_admitted
    assert len(running) + len(swapped) <= cfg.max_admitted  # admission waits for every swapped sequence
    assert sched.num_waiting() == len(seqs) - len(running)
    if cfg.total_slots is not None:
        assert sched.free_slots() == cfg.total_slots - len(running) >= 0
    assert sched.kv_usage == (cfg.total_blocks - sched.free_blocks()) / cfg.total_blocks


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("name", list(CONFIGS))
def test_randomized_simulation_keeps_every_bound_and_finishes_everyone(name, seed):
    cfg = CONFIGS[name]
    rng = random.Random(f"{name}-{seed}")
    capacity = cfg.total_blocks * cfg.block_size
    arrivals = []
    longest = 24 if name == "many-short" else capacity * 2 // 3  # many-short: more decoders than budget
    for i in range(80):
        prompt = rng.randint(1, longest)
        arrivals.append((f"r{i}", prompt, rng.randint(1, min(40, capacity - prompt))))
    work = sum(p + m for _, p, m in arrivals)  # every busy step moves at least one of these tokens
    sched, engine = Scheduler(cfg), FakeEngine(cfg)
    live: set[str] = set()
    ended: list[str] = []

    def end(rid: str) -> None:
        live.discard(rid)
        ended.append(rid)
        engine.forget(rid)

    preemptions = busy_steps = 0
    for _ in range(100_000):
        if not arrivals and not live:
            break
        while arrivals and rng.random() < 0.5:  # bursts of arrivals; a full queue pushes back
            rid, prompt, max_tokens = arrivals[0]
            try:
                sched.add(rid, prompt, max_tokens)
            except QueueFull:
                assert sum(sched.get(r).status is Status.WAITING for r in live) == cfg.max_waiting
                break
            arrivals.pop(0)
            live.add(rid)
        if live and rng.random() < 0.03:  # a client goes away, whatever state its request is in
            rid = rng.choice(sorted(live))
            assert sched.cancel(rid)
            end(rid)
        check_state(sched, live)
        before = {rid: sched.get(rid).status for rid in live}
        plan = sched.schedule()
        if live:
            busy_steps += 1
            assert plan.prefill or plan.decode, "a step with live requests made no progress"
        check_plan(sched, plan, before)
        check_state(sched, live)
        preemptions += len(plan.swap_out)
        engine.execute(sched, plan)
        if plan.prefill and rng.random() < 0.05:  # a cancel races with the step in flight
            rid = rng.choice(sorted(r for r, _, _ in plan.prefill))
            assert sched.cancel(rid)
            end(rid)
        prefilled = {rid: n for rid, _, n in plan.prefill}  # reports about the cancelled one are ignored
        sampled = [rid for rid, start, n in plan.prefill if rid in live and start + n == sched.get(rid).prompt_len]
        sampled += [rid for rid in plan.decode if rid in live]
        finished = [rid for rid in sampled  # EOS or a stop string at random; max_tokens for certain
                    if rng.random() < 0.04 or sched.get(rid).generated + 1 == sched.get(rid).max_tokens]
        sched.step_done(prefilled, sampled, finished)
        for rid in finished:
            end(rid)
        check_state(sched, live)
        for rid in live:
            if rid in engine.pos:
                assert sched.get(rid).in_cache == engine.pos[rid]
    assert not live and not arrivals, "the simulation did not finish: starvation or livelock"
    assert sorted(ended) == sorted(f"r{i}" for i in range(80))
    assert busy_steps <= work
    assert sched.free_blocks() == cfg.total_blocks and sched.num_waiting() == 0 and sched.schedule().empty
    if name == "tight-blocks":
        assert preemptions > 0, "the tight pool should force preemption"


# --- prefill grouping (memra.engine.admission) ---
def grouped(wait_steps: int, group: int, **kw) -> Scheduler:
    return Scheduler(SchedulerConfig(token_budget=512, prefill_align=16, total_blocks=256, max_running=4,
                                     grouping=PrefillGrouping(wait_steps, group), **kw))


def started(plan: StepPlan) -> list[str]:
    return [rid for rid, start, _ in plan.prefill if start == 0]


@pytest.mark.parametrize("kwargs", [{"wait_steps": -1}, {"group": 0}, {"wait_steps": 1.5}, {"group": True}])
def test_grouping_rejects_bad_values(kwargs):
    with pytest.raises(MemraError, match="--prefill-(wait-steps|group) must be an integer"):
        PrefillGrouping(**kwargs)


@pytest.mark.parametrize("kwargs", [{"prefill_wait_steps": -1}, {"prefill_group": 0}])
def test_the_engine_config_refuses_bad_hold_settings_with_the_flag_named(kwargs):
    from memra.engine.types import EngineConfig

    with pytest.raises(MemraError, match="--prefill-(wait-steps|group) must be an integer >= "):
        EngineConfig(**kwargs)


def test_the_hold_is_off_by_default_where_a_mixed_step_is_a_graph():
    """A step that starts requests costs about a decode step once it is a captured graph (memra.mixed_graphs):
    holding them then saves nothing and leaves places empty. Elsewhere the measured default, 8 steps."""
    from memra.engine.types import EngineConfig

    assert EngineConfig(max_batch=64).grouping(True) == PrefillGrouping(0, 8)
    assert EngineConfig(max_batch=64).grouping(False) == PrefillGrouping(8, 8)
    assert EngineConfig(prefill_wait_steps=3).grouping(True).wait_steps == 3  # a value given is kept


def test_an_idle_engine_starts_a_request_at_once():
    sched = grouped(wait_steps=5, group=3)
    sched.add("a", 20, 50)
    assert started(step(sched)) == ["a"]  # nothing decodes: holding would only idle the device


def test_a_lone_request_is_held_at_most_wait_steps_while_others_decode():
    sched = grouped(wait_steps=3, group=2)
    sched.add("a", 20, 50)
    step(sched)
    sched.add("b", 20, 50)
    plans = [step(sched) for _ in range(4)]
    assert [started(p) for p in plans] == [[], [], [], ["b"]]
    assert all(p.decode == ["a"] for p in plans)  # the decode never waits for it


def test_a_group_starts_together_as_soon_as_it_is_complete():
    sched = grouped(wait_steps=8, group=2)
    sched.add("a", 20, 50)
    step(sched)
    sched.add("b", 20, 50)
    assert started(step(sched)) == []
    sched.add("c", 20, 50)
    assert started(step(sched)) == ["b", "c"]  # one prefill step for both


def test_a_step_that_prefills_anyway_lets_a_held_request_join():
    sched = Scheduler(SchedulerConfig(token_budget=128, prefill_align=16, total_blocks=256, max_running=4,
                                      grouping=PrefillGrouping(wait_steps=8, group=2)))
    sched.add("a", 20, 50)
    step(sched)
    sched.add("long", 200, 50)
    sched.add("b", 20, 50)
    assert step(sched).prefill == [("long", 0, 112)]  # b does not fit the budget's rest
    plan = step(sched)  # one startable (b) is below the group, but long's chunk makes this a prefill step
    assert plan.decode == ["a"] and plan.prefill == [("long", 112, 88), ("b", 0, 20)]


def test_held_steps_count_only_while_a_place_is_free():
    sched = grouped(wait_steps=2, group=2)
    sched.add("a", 20, 3)
    for rid in "bcde":
        sched.add(rid, 20, 50)
    assert started(step(sched)) == ["a", "b", "c", "d"]  # nothing was decoding; e finds the batch full
    plans = [step(sched) for _ in range(5)]  # a ends with the second of these; then e is held two steps
    assert [started(p) for p in plans] == [[], [], [], [], ["e"]]


def test_grouping_off_starts_every_request_at_once():
    sched = grouped(wait_steps=0, group=8)
    sched.add("a", 20, 50)
    step(sched)
    sched.add("b", 20, 50)
    assert started(step(sched)) == ["b"]
