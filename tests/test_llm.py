"""memra.LLM and the engine under it, against the reference loop (memra.generate.generate_tokens: one
sequence, prime then decode_step, the host picking each token): a batch of prompts with every kind of
sampling gives each prompt the very tokens it gets alone, bit for bit — the same tokens `memra generate`
printed before it ran on the engine."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

import memra
from conftest import DEVICE
from cuda_marks import cuda_only
from memra.generate import GenerationStats, generate_tokens
from memra.sampling import SamplingParams

PROMPTS = ["ROMEO:", "JULIET:\nO Romeo, Romeo,", "First Citizen:\nBefore we proceed any further, hear me speak.",
           "KING LEAR:\nBlow, winds,", "HAMLET:\nTo be, or not to be"]
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=24),
    SamplingParams(max_tokens=30, temperature=0.8, seed=7),
    SamplingParams(max_tokens=20, temperature=1.1, top_k=40, top_p=0.9, seed=3),
    SamplingParams(max_tokens=28, temperature=0.7, min_p=0.05, seed=11, repetition_penalty=1.3,
                   presence_penalty=0.5, frequency_penalty=0.4, logit_bias={17: 3.0, 99: -100.0}),
    SamplingParams(temperature=0.0, max_tokens=16, repetition_penalty=0.8, logit_bias={5: 2.5}),
]


@pytest.fixture(scope="module")
def llm():
    return memra.LLM("demo", device=DEVICE, max_batch=8, max_ctx=256)  # GPU: MEMRA_TEST_DEVICE=cuda


def reference(model, prompt: str, p: SamplingParams) -> list[int]:
    ids = model.tokenizer.encode(prompt, add_special=True)
    return list(generate_tokens(model, ids, p, eos_ids=model.tokenizer.eos_ids))


def test_a_batch_gives_each_prompt_its_tokens_alone(llm):
    outs = llm.generate(PROMPTS, PARAMS)
    assert [o.prompt for o in outs] == PROMPTS
    for prompt, p, o in zip(PROMPTS, PARAMS, outs):
        want = reference(llm.model, prompt, p)
        got = o.outputs[0]
        assert got.token_ids == want, prompt
        assert got.text == llm.tokenizer.decode(want, skip_special=True)
        assert got.finish_reason == ("stop" if want[-1] in llm.tokenizer.eos_ids else "length")


def test_requests_held_to_start_together_keep_their_tokens(llm):
    """Holding requests so that several start in one prefill moves when each starts, not what it gets. In
    arrival order: longest first (memra.LLM's default) starts requests of one length together, and they
    finish together anyway, leaving the hold nothing to group here."""
    prompts, params = PROMPTS * 2, PARAMS * 2  # more than the batch: the rest wait for places
    model = llm.model.with_doors(MEMRA_ADMISSION_ORDER="fcfs")

    def run(wait_steps):  # -> the outputs' tokens, and how many steps started requests
        small = memra.LLM(model, max_batch=3, prefill_wait_steps=wait_steps, prefill_group=2)
        sched, starting = small.engine.scheduler, []
        schedule = sched.schedule
        sched.schedule = lambda: (plan := schedule(), starting.append(any(s == 0 for _, s, _ in plan.prefill)))[0]
        return [o.outputs[0].token_ids for o in small.generate(prompts, params)], sum(starting)

    held, held_starts = run(6)
    at_once, starts = run(0)
    assert held == at_once == [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert held_starts < starts  # the hold did group the starts


def test_choices_stops_logprobs_and_streaming(llm):
    p = SamplingParams(max_tokens=20, temperature=0.9, seed=5, n=3)
    out = llm.generate("ROMEO:", p).pop().outputs
    for i, choice in enumerate(out):
        assert choice.index == i
        assert choice.token_ids == reference(llm.model, "ROMEO:", SamplingParams(max_tokens=20, temperature=0.9,
                                                                                 seed=5 + i))
    whole = llm.generate("ROMEO:", SamplingParams(temperature=0.0, max_tokens=40)).pop().outputs[0].text
    stop = whole.strip()[4:9]
    cut = llm.generate("ROMEO:", SamplingParams(temperature=0.0, max_tokens=40, stop=(stop,))).pop().outputs[0]
    assert cut.finish_reason == "stop" and cut.text == whole[: whole.index(stop)]
    lp = llm.generate("ROMEO:", SamplingParams(temperature=0.0, max_tokens=6, logprobs=3)).pop().outputs[0]
    assert len(lp.logprobs) == len(lp.top_logprobs) == 6
    for tok, chosen, pos, top in zip(lp.token_ids, lp.token_logprobs, lp.logprobs, lp.top_logprobs):
        assert chosen <= 0 and len(top) == 3 and top[tok] == chosen  # greedy: the chosen one is the best
        assert len(pos) == 3 and pos[tok].rank == 1 and [e.rank for e in pos.values()] == [1, 2, 3]  # vLLM's dicts
    stats = GenerationStats()
    streamed = "".join(llm.stream("ROMEO:", SamplingParams(temperature=0.0, max_tokens=40), stats))
    assert streamed == whole and stats.generated_tokens == 40 and stats.finish_reason == "length"


def test_token_id_prompts_and_refusals(llm):
    ids = llm.tokenizer.encode("JULIET:", add_special=True)
    a = llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=8)).pop()
    b = llm.generate(["JULIET:"], SamplingParams(temperature=0.0, max_tokens=8)).pop()
    assert a.prompt is None and a.prompt_token_ids == ids and a.outputs[0].token_ids == b.outputs[0].token_ids
    with pytest.raises(memra.MemraError, match="maximum context length"):
        llm.generate(["ROMEO:", "x " * 300], SamplingParams(temperature=0.0, max_tokens=8))
    assert not llm.engine.busy()  # the refusal came before anything was queued
    with pytest.raises(memra.MemraError, match="SamplingParams"):
        llm.generate(PROMPTS, PARAMS[:2])


def test_the_engine_step_is_the_pooled_batch(llm):
    """The engine's caches come from one pool, so its decode rows run as one batch (graphed on CUDA)."""
    llm.generate(PROMPTS[:3], SamplingParams(temperature=0.0, max_tokens=4))
    backend = llm.engine.backend
    assert backend.kv is backend.pools.kv and isinstance(backend.kv.k[3], torch.Tensor)


def test_events_reach_the_reader_when_and_in_the_order_expected(llm):
    """A step's tokens are chosen on the device and land while the next step runs (memra.engine
    .inflight): stepped on the caller's thread, step k's token reaches the sink during step k + 1, and
    the last one in the step that finds nothing more to run. On the engine thread the same holds,
    and none is held back when the engine falls idle; each sequence's events keep their order."""
    engine, ids = llm.engine, llm.tokenizer.encode(PROMPTS[1], add_special=True)
    events = []
    engine.submit(ids, SamplingParams(temperature=0.0, max_tokens=3), events.append)
    for n in (0, 1, 2, 3):
        assert engine.step()
        assert [e.completion_tokens for e in events] == list(range(1, n + 1))
    assert events[-1].finish_reason == "length" and not engine.busy() and not engine.step()

    served = memra.LLM("demo", device=DEVICE, max_batch=4, max_ctx=256, warm_up=False)
    served.engine.start(warm_up=False)
    try:
        got: list = []
        done = threading.Event()
        served.engine.submit(ids, SamplingParams(temperature=0.0, max_tokens=5),
                             lambda ev: (got.append(ev), ev.finish_reason is not None and done.set()))
        assert done.wait(60), "the last event never arrived"
        assert [e.completion_tokens for e in got] == [1, 2, 3, 4, 5]
        assert got[-1].finish_reason == "length"
        assert [e.token_id for e in got] == llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=5))[0].outputs[0].token_ids
    finally:
        served.engine.shutdown(drain_timeout=1)


@cuda_only
def test_the_engine_step_never_waits_for_the_whole_stream(llm):
    """With torch's sync debug mode on, a batch with every kind of sampling (prefill waves, graphed
    decode, penalties, logprobs) runs without one stream-draining call in memra's code: the only wait
    is each step's event on its tokens' copy (memra.upload.start_download), which the mode does not
    flag. A `.tolist()` / `.item()` / pageable upload on the step path would wait for the next step
    too, and the overlap would be gone (the served rate fell by a quarter when one did)."""
    import warnings

    llm.generate(PROMPTS, PARAMS)  # compile, capture, warm every path first
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            llm.generate(PROMPTS, [dataclasses.replace(p, logprobs=2) for p in PARAMS])
        finally:
            torch.cuda.set_sync_debug_mode(0)
    waits = [f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message) and "/memra/" in w.filename]
    assert not waits, f"stream-draining calls on the engine's step: {sorted(set(waits))}"


def test_decode_ids_take_each_rows_last_token_from_where_it_is():
    """memra.engine.inflight.decode_ids: a row whose last token is still in flight gets it from the
    device tensor, any other row its host record, in the batch's order."""
    from memra.engine.inflight import InFlight, decode_ids
    from memra.engine.sampler import PendingPick
    from memra.engine.seq_state import SeqState

    def seq(last: int) -> SeqState:
        return SeqState(f"s{last}", 0, [1], SamplingParams(temperature=0.0, max_tokens=128), None, frozenset(), lambda ev: None, out=[last])

    a, b, c, d = seq(10), seq(11), seq(12), seq(13)
    flight = InFlight([a, b, c], PendingPick(torch.tensor([20, 21, 22]), [], None))
    assert decode_ids([a, b, d], None, "cpu") == [10, 11, 13]  # nothing in flight: the host's record
    assert decode_ids([a, b, c], flight, "cpu") is flight.pick.tokens  # the usual step: as they are
    assert decode_ids([c, a], flight, "cpu").tolist() == [22, 20]  # a sequence ended: the others, gathered
    assert decode_ids([d, c, a], flight, "cpu").tolist() == [13, 22, 20]  # one swapped back in: its record
