"""memra.LLM and SamplingParams under vLLM's arguments, defaults and output shapes (issue 46, docs/VLLM.md):
every vLLM argument works, is accepted (no effect), or is refused in one MemraError naming LLM(...) /
SamplingParams(...); unseeded samples differ, seeded ones repeat, LLM(seed=s) repeats a run; outputs carry
vLLM's fields (request_id, finished, metrics, cumulative_logprob, stop_reason, {id: Logprob} dicts)."""

from __future__ import annotations

import json
import shutil

import pytest

import memra
from conftest import DEVICE, hf_dir
from memra import LLM, Logprob, SamplingParams
from memra.engine import llm_args, llm as llm_module
from memra.errors import MemraError
from memra.sampling_vllm import REFUSED as SAMPLING_REFUSED


class _Other:
    """A value equal to no no-op value: what makes a refusable argument refused."""


@pytest.fixture(scope="module")
def llm():
    return LLM("demo", device=DEVICE, max_num_seqs=8, max_model_len=128)


def test_sampling_params_take_vllms_defaults():
    p = SamplingParams()
    assert (p.temperature, p.max_tokens, p.seed, p.top_k, p.top_p, p.n) == (1.0, 16, None, 0, 1.0, 1)
    q = SamplingParams(top_k=-1, stop=None, stop_token_ids=None, logit_bias=None, best_of=1, max_tokens=None,
                       output_kind=object(), stream_interval=4, skip_reading_prefix_cache=True)
    assert (q.top_k, q.stop, q.stop_token_ids, q.logit_bias, q.max_tokens) == (0, (), (), (), None)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")


@pytest.mark.parametrize("name", sorted(SAMPLING_REFUSED))
def test_each_unsupported_sampling_field_is_refused_by_name(name):
    with pytest.raises(MemraError, match=rf"^SamplingParams\({name}=\.\.\.\) is not supported: \w"):
        SamplingParams(**{name: _Other()})


@pytest.mark.parametrize("kw, named", [(dict(logprobs=-1), "logprobs=-1"), (dict(prompt_logprobs=-1), "prompt_logprobs=-1"),
                                       (dict(detokenize=False, stop=["x"]), "detokenize"),
                                       (dict(max_tokens=0), "max_tokens")])
def test_sampling_values_memra_cannot_give_are_refused(kw, named):
    with pytest.raises(MemraError, match=named):
        SamplingParams(**kw)


@pytest.mark.parametrize("name", sorted(llm_args.REFUSED))
def test_each_unsupported_llm_argument_is_refused_before_loading(name):
    with pytest.raises(MemraError, match=rf"^LLM\({name}=.*\) is not supported: \w"):
        LLM("demo", **{name: _Other()})


def test_llm_arguments_that_name_memra_things(llm, tmp_path):
    with pytest.raises(MemraError, match=r"LLM\(tokenizer='/nonexistent'\): no such file"):
        LLM("demo", tokenizer="/nonexistent")
    with pytest.raises(MemraError, match=r"LLM\(tokenizer=.*\) is not supported"):
        LLM("demo", tokenizer=str(tmp_path))
    with pytest.raises(MemraError, match="LLM got an unknown argument 'foo'"):
        LLM("demo", foo=1)
    with pytest.raises(MemraError, match=r"LLM\(max_logprobs=21\)"):
        LLM("demo", max_logprobs=21)
    with pytest.raises(MemraError, match=r"LLM\(speculative_config method 'eagle'\)"):
        LLM("demo", speculative_config={"method": "eagle", "num_speculative_tokens": 3})
    with pytest.raises(MemraError, match=r"LLM\(speculative_config=\{'model'"):
        LLM("demo", speculative_config={"method": "ngram", "model": "x"})
    with pytest.raises(MemraError, match=r"LLM\(enforce_eager=\.\.\.\) applies when LLM loads"):
        LLM(llm.model, enforce_eager=True)
    with pytest.raises(MemraError, match=r"LLM\(mamba_ssm_cache_dtype=\.\.\.\) applies when LLM loads"):
        LLM(llm.model, mamba_ssm_cache_dtype="bfloat16")
    with pytest.raises(MemraError, match=r"LLM\(mamba_ssm_cache_dtype=\.\.\.\) 'float16' is not supported"):
        LLM("demo", mamba_ssm_cache_dtype="float16")
    with pytest.raises(MemraError, match=r"LLM\(generation_config="):
        LLM("demo", generation_config=str(tmp_path))


def test_llm_arguments_that_work_or_cannot_matter(llm):
    m = llm.model
    same = LLM(m, warm_up=False, trust_remote_code=True, swap_space=4, max_seq_len_to_capture=8192,
               disable_log_stats=True, enable_chunked_prefill=True, tensor_parallel_size=1, pipeline_parallel_size=1,
               quantization=None, kv_cache_dtype="auto", block_size=16, tokenizer_mode="auto", hf_token=None,
               task="generate", max_num_seqs=3, max_num_batched_tokens=128,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})
    cfg = same.engine.cfg
    assert (cfg.max_batch, cfg.token_budget) == (3, 128)
    assert (cfg.speculative.method, cfg.speculative.k, cfg.speculative.ngram_max) == ("ngram", 3, 3)
    eager = LLM("demo", device=DEVICE, dtype="auto", tokenizer="demo", enforce_eager=True, warm_up=False)
    assert eager.model.settings.cuda_graphs is False and eager.model.dtype == m.dtype  # "auto": memra's default


def test_unseeded_samples_differ_seeded_repeat_and_llm_seed_repeats_a_run(llm):
    unseeded = llm.generate(["ROMEO:"] * 16, SamplingParams(max_tokens=6), use_tqdm=False)
    assert len({tuple(o.outputs[0].token_ids) for o in unseeded}) > 1
    assert len({o.outputs[0].seed for o in unseeded}) == 16  # each request drew its own seed
    seeded = llm.generate(["ROMEO:"] * 4, SamplingParams(max_tokens=6, seed=3), use_tqdm=False)
    assert len({tuple(o.outputs[0].token_ids) for o in seeded}) == 1

    def run(seed):
        fresh = LLM(llm.model, seed=seed, warm_up=False, max_model_len=128)
        return [(o.outputs[0].seed, o.outputs[0].token_ids) for o in fresh.generate(["JULIET:"] * 3, SamplingParams(
            max_tokens=6), use_tqdm=False)]

    assert run(11) == run(11) and run(0) == run(0)  # LLM(seed=...) repeats a whole run (0 is vLLM's default)
    assert run(11) != run(12)
    assert run(None)[0][0] != run(None)[0][0]  # seed=None: a fresh stream each time


def test_outputs_carry_vllms_fields_and_types(llm):
    [out] = llm.generate("HAMLET:", SamplingParams(temperature=0.7, seed=4, max_tokens=5, logprobs=2), use_tqdm=False)
    [again] = llm.generate("HAMLET:", SamplingParams(temperature=0.7, seed=4, max_tokens=5, logprobs=2), use_tqdm=False)
    assert isinstance(out.request_id, str) and out.request_id != again.request_id and out.finished is True
    m = out.metrics
    assert m.arrival_time <= m.first_token_time <= m.last_token_time <= m.finished_time
    c = out.outputs[0]
    assert c.finished() and c.finish_reason == "length" and c.stop_reason is None and c.lora_request is None
    assert len(c.logprobs) == len(c.token_ids) == 5
    for t, pos, top in zip(c.token_ids, c.logprobs, c.top_logprobs):
        assert all(isinstance(k, int) and isinstance(v, Logprob) for k, v in pos.items())
        assert pos[t].decoded_token == llm.tokenizer.decode([t]) and pos[t].rank >= 1
        for rank, (k, v) in enumerate(top.items(), 1):  # the top 2, ranked 1 and 2
            assert pos[k].logprob == v and pos[k].rank == rank
        assert len(pos) == (2 if t in top else 3) and (t in top or pos[t].rank > 2)
    assert c.cumulative_logprob == sum(c.token_logprobs)  # added in order, as vLLM does
    assert llm.generate("HAMLET:", SamplingParams(max_tokens=3), use_tqdm=False)[0].outputs[0].cumulative_logprob is None
    blind = llm.generate("HAMLET:", SamplingParams(temperature=0.7, seed=4, max_tokens=5, logprobs=2, detokenize=False),
                         use_tqdm=False)[0].outputs[0]
    assert blind.text == "" and blind.token_ids == c.token_ids and blind.logprobs[0][c.token_ids[0]].decoded_token is None


def test_stop_reason_names_the_stop_string_or_token(llm):
    whole = llm.generate("ROMEO:", SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0]
    stop = whole.text.strip()[2:5]
    by_string = llm.generate("ROMEO:", SamplingParams(temperature=0, max_tokens=12, stop=["zzz", stop]),
                             use_tqdm=False)[0].outputs[0]
    assert by_string.finish_reason == "stop" and by_string.stop_reason == stop
    token = whole.token_ids[3]
    by_token = llm.generate("ROMEO:", SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[token]),
                            use_tqdm=False)[0].outputs[0]
    assert by_token.finish_reason == "stop" and by_token.stop_reason == token and by_token.token_ids[-1] == token


def test_max_tokens_none_runs_to_the_context_end_and_max_logprobs_holds(llm):
    [out] = llm.generate("ROMEO:", SamplingParams(temperature=0, max_tokens=None, ignore_eos=True), use_tqdm=False)
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 128
    small = LLM(llm.model, warm_up=False, max_logprobs=2)
    with pytest.raises(MemraError, match=r"SamplingParams\(logprobs=3\) is over LLM\(max_logprobs=2\)"):
        small.generate("x", SamplingParams(logprobs=3))
    with pytest.raises(MemraError, match="lora_request"):
        small.generate("x", SamplingParams(), lora_request=object())


def _model_dir(tmp_path, generation_config: dict | None = None):
    d = tmp_path / "model"
    shutil.copytree(hf_dir("llama"), d)
    (d / "chat_template.jinja").write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}|END\n"
                                           "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}",
                                           encoding="utf-8")
    if generation_config is not None:
        (d / "generation_config.json").write_text(json.dumps(generation_config), encoding="utf-8")
    return d


def test_generation_config_sets_the_defaults_and_chat_continues_a_message(tmp_path):
    d = _model_dir(tmp_path, {"temperature": 0.0, "top_k": 5, "max_new_tokens": 3, "eos_token_id": 2})
    auto = LLM(str(d), max_model_len=64, warm_up=False)
    p = auto.get_default_sampling_params()
    assert (p.temperature, p.top_k, p.max_tokens) == (0.0, 5, 3)
    assert len(auto.generate("hello", use_tqdm=False)[0].outputs[0].token_ids) <= 3
    plain = LLM(auto.model, generation_config="vllm", warm_up=False).get_default_sampling_params()
    assert plain == SamplingParams()
    convo = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Well"}]
    [cont] = auto.chat(convo, SamplingParams(max_tokens=1), add_generation_prompt=False, continue_final_message=True,
                       use_tqdm=False)
    assert cont.prompt == "user: Hi|END\nassistant: Well" and cont.prompt_token_ids == auto.tokenizer.encode(cont.prompt)
    with pytest.raises(MemraError, match="chat_template"):
        auto.chat(convo, chat_template="{{ messages }}")


def test_progress_bar_on_a_terminal_only_when_asked(llm, capsys, monkeypatch):
    monkeypatch.setattr(llm_module, "show_progress", lambda: True)  # as on an interactive terminal
    llm.generate(["ROMEO:"] * 2, SamplingParams(max_tokens=2))
    assert "generate" in capsys.readouterr().err
    llm.generate(["ROMEO:"] * 2, SamplingParams(max_tokens=2), use_tqdm=False)
    assert capsys.readouterr().err == ""
    made = []

    def own_bar(**kw):  # vLLM's use_tqdm may be a callable that makes the bar
        from tqdm import tqdm

        made.append(kw["total"])
        return tqdm(**kw, disable=True)

    llm.generate(["ROMEO:"] * 2, SamplingParams(max_tokens=2, n=2), use_tqdm=own_bar)
    assert made == [4]


def test_structured_outputs_params_is_vllms_name():
    from memra.sampling_params import StructuredOutputsParams

    assert StructuredOutputsParams is memra.StructuredOutputs
    assert StructuredOutputsParams(choice=["a"], json_object=None).choice == ("a",)
    with pytest.raises(MemraError, match=r"StructuredOutputsParams\(disable_any_whitespace=\.\.\.\)"):
        StructuredOutputsParams(json={}, disable_any_whitespace=True)
