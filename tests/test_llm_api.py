"""memra.LLM in vLLM's conventions: max_model_len, seed, sampling_params=, dict prompts, get_tokenizer(),
chat's template kwargs, SamplingParams(seed=None) drawing a seed the output reports (and LLM(seed=S)
repeating the draws); anything wrong is one MemraError naming the argument, never a TypeError."""

from __future__ import annotations

import shutil

import pytest

import memra
from conftest import DEVICE, hf_dir
from memra.errors import MemraError


@pytest.fixture(scope="module")
def llm():
    return memra.LLM("demo", device=DEVICE, max_batch=4, max_model_len=256, seed=5)


def test_vllm_names_and_prompt_forms(llm):
    assert llm.engine.max_len == 256
    assert llm.get_tokenizer() is llm.tokenizer
    sp = memra.SamplingParams(temperature=0.0, max_tokens=6)
    ids = llm.get_tokenizer().encode("ROMEO:", add_special=True)
    outs = llm.generate(["ROMEO:", {"prompt": "ROMEO:"}, {"prompt_token_ids": ids}, ids], sampling_params=sp)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1  # four spellings of one prompt
    assert outs[0].prompt == "ROMEO:" and outs[2].prompt is None and outs[2].prompt_token_ids == ids


@pytest.mark.parametrize("bad, names", [
    ([{"text": "x"}], "prompt 0"),
    (["ok", {"prompt": "a", "prompt_token_ids": [1]}], "prompt 1"),
    ([3.5], "prompt 0"),
    ([[1, "a"]], "prompt 0"),
])
def test_bad_prompts_are_one_error_naming_the_prompt(llm, bad, names):
    with pytest.raises(MemraError, match=names):
        llm.generate(bad, memra.SamplingParams(temperature=0.0, max_tokens=2))


def test_bad_arguments_name_themselves(llm):
    with pytest.raises(MemraError, match="sampling_params"):
        llm.generate("x", memra.SamplingParams(temperature=0.0, max_tokens=2), sampling_params=memra.SamplingParams(temperature=0.0, max_tokens=3))
    with pytest.raises(MemraError, match="sampling_params"):
        llm.generate("x", sampling_params={"max_tokens": 2})
    with pytest.raises(MemraError, match="max_model_len"):
        memra.LLM("demo", max_ctx=128, max_model_len=256)
    with pytest.raises(MemraError, match="seed"):
        memra.LLM("demo", seed=-1)
    with pytest.raises(MemraError, match="gpu_memory_utilization"):
        memra.LLM(llm.model, gpu_memory_utilization=0.5)
    with pytest.raises(MemraError, match="seed"):
        memra.SamplingParams(temperature=0.0, max_tokens=128, seed=-3)


def test_a_seed_left_to_llm_is_drawn_reported_and_repeatable(llm):
    sp = memra.SamplingParams(max_tokens=8, temperature=1.0, seed=None, n=2)
    first = llm.generate("JULIET:", sp)[0].outputs
    seeds = [c.seed for c in first]
    assert seeds[0] is not None and seeds[1] == seeds[0] + 1
    again = llm.generate("JULIET:", memra.SamplingParams(max_tokens=8, temperature=1.0, seed=seeds[0], n=2))[0].outputs
    assert [c.token_ids for c in again] == [c.token_ids for c in first]
    other = memra.LLM(llm.model, max_batch=4, max_model_len=256, seed=5, warm_up=False)
    fresh = memra.LLM(llm.model, max_batch=4, max_model_len=256, seed=5, warm_up=False)
    assert other.generate("JULIET:", sp)[0].outputs[0].seed == fresh.generate("JULIET:", sp)[0].outputs[0].seed


def test_chat_passes_template_kwargs_and_tools(tmp_path):
    d = tmp_path / "model"
    shutil.copytree(hf_dir("llama"), d)
    (d / "chat_template.jinja").write_text(
        "{% if flavour %}[{{ flavour }}]{% endif %}{% if tools %}TOOLS {{ tools | length }}|{% endif %}"
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}", encoding="utf-8")
    llm = memra.LLM(str(d), max_batch=2, max_model_len=128, warm_up=False)
    convo = [{"role": "user", "content": "Hello"}]
    sp = memra.SamplingParams(temperature=0.0, max_tokens=2)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    plain = llm.chat(convo, sampling_params=sp)[0].prompt_token_ids
    dressed = llm.chat([convo], sp, chat_template_kwargs={"flavour": "terse"}, tools=tools)[0].prompt_token_ids
    enc = llm.get_tokenizer().encode
    assert plain == enc("user: Hello\n") and dressed == enc("[terse]TOOLS 1|user: Hello\n")
