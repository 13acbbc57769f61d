"""Scoring equals sampling (promise E9, memra.engine.scoring): the score gate on every fixture
architecture and the demo (its canary FAILs), memra.LLM.score against generate's logprobs, and
SamplingParams(prompt_logprobs=k) against a one-shot prime."""

from __future__ import annotations

import pytest
import torch

import memra
from conftest import HF_ARCHS, hf_dir
from memra.engine.scoring import ScoreJob
from memra.errors import MemraError
from memra.gate.score_arm import run_score_battery


@pytest.mark.parametrize("arch", HF_ARCHS)
def test_score_gate_all_green(load_model, arch):
    lines: list[str] = []
    assert run_score_battery(load_model(hf_dir(arch)), steps=8, out=lines.append), "\n".join(lines)
    assert lines[-1].startswith("ALL GREEN: score")
    assert any(line.startswith("liveness (") and "PASS" in line and not line.startswith("liveness (0 ")
               for line in lines)


@pytest.mark.parametrize("arch", ["llama", "qwen3_5"])
def test_score_gate_canary_fails(load_model, arch):
    lines: list[str] = []
    model = load_model(hf_dir(arch)).with_doors(MEMRA_GATE_CANARY="1")
    assert not run_score_battery(model, steps=8, out=lines.append)
    assert any(line.startswith("score (") and line.endswith("FAIL") for line in lines)
    assert any(line.startswith("score: ") and " token 0:" not in line for line in lines)  # past the first token


@pytest.fixture(scope="module")
def llm():
    return memra.LLM("demo", max_batch=4, warm_up=False)


def test_llm_score_equals_generate_logprobs(llm):
    prompt = llm.tokenizer.encode("KING LEAR:\nBlow, winds, and crack your cheeks!", True)
    for params in (memra.SamplingParams(temperature=0.0, max_tokens=30, logprobs=3, ignore_eos=True),
                   memra.SamplingParams(max_tokens=30, logprobs=3, temperature=1.0, top_k=40, seed=9, n=2,
                                        ignore_eos=True)):
        outs = llm.generate([prompt], params)[0].outputs
        scored = llm.score([prompt] * len(outs), [o.token_ids for o in outs], top_logprobs=3)
        for o, s in zip(outs, scored):
            assert s.token_ids == o.token_ids and s.prompt_token_ids == prompt
            assert s.logprobs == o.token_logprobs and s.top_logprobs == o.top_logprobs


def test_prompt_logprobs_in_generate(llm):
    prompt = llm.tokenizer.encode("HAMLET:\nTo be, or not to be, that is the question.", True)
    out = llm.generate([prompt], memra.SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1))[0]
    plp = out.prompt_logprobs
    assert plp[0] is None and len(plp) == len(prompt)
    cache = llm.model.new_cache(len(prompt))
    rows = llm.model.prime(prompt, cache, all_logits=True)
    cache.free()
    for i in range(1, len(prompt)):
        logp = torch.log_softmax(rows[i - 1].float(), -1)
        own = plp[i][prompt[i]]  # vLLM's Logprob: the value, its rank, its text
        assert own.logprob == float(logp[prompt[i]].double())
        assert own.rank == 1 + int((logp > logp[prompt[i]]).sum()) and own.decoded_token == llm.tokenizer.decode([prompt[i]])
        top = int(logp.argmax())
        assert top in plp[i] and plp[i][top].rank == 1


@pytest.mark.parametrize("start", [None, 70, 130])
def test_values_only_scores_are_the_scores_logprobs(load_model, start):
    """score(values_only=True), the trainer's values (memra.train.exact): each position's logprob as a float,
    the very value of the full TokenScore, bit for bit, across the prime chunks, the row at start - 1 and the
    continuation's verify columns (130 tokens past one 64-token chunk, 70 inside the second)."""
    from memra.engine.scoring import score

    model = load_model(hf_dir("qwen3_5"))
    ids = tuple(int(t) for t in torch.randint(0, model.cfg.vocab_size, (200,), generator=torch.Generator().manual_seed(3)))
    got = []
    for values_only in (False, True):
        cache = model.new_cache(len(ids))
        got.append(score(model, ScoreJob(ids, start), cache, values_only=values_only))
        cache.free()
    full, values = got
    assert values[0] is None and all(type(v) is float for v in values[1:])
    assert [s.logprob for s in full[1:]] == values[1:]


def test_score_refusals(llm):
    with pytest.raises(MemraError, match="continuation_start"):
        llm.engine.score_jobs.submit(ScoreJob((1, 2, 3), 4))
    with pytest.raises(MemraError, match="empty"):
        llm.score([[5, 6]], [[]])
    with pytest.raises(MemraError, match="prompt_logprobs"):
        memra.SamplingParams(temperature=0.0, max_tokens=128, prompt_logprobs=-1)
