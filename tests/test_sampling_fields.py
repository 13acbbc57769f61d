"""vLLM's sampling fields (issue 36 item 4): stop_token_ids, ignore_eos, min_tokens, include_stop_str_in_output,
skip_special_tokens, spaces_between_special_tokens, truncate_prompt_tokens. Each in Python (memra.LLM) and over
HTTP on a real server on loopback (the openai client, vLLM's fields in extra_body). Where sampling is involved the
tokens and logprobs are compared bit for bit: a row with min_tokens beside rows without gets each row its solo
tokens, and min_tokens gives the reference loop's tokens (memra.generate.generate_tokens)."""

from __future__ import annotations

import concurrent.futures as cf

import httpx
import pytest

openai = pytest.importorskip("openai")

import memra  # noqa: E402
from memra import counters  # noqa: E402
from memra.engine.engine import Engine, EngineConfig  # noqa: E402
from memra.generate import generate_tokens  # noqa: E402
from memra.sampling import SamplingParams as SP  # noqa: E402
from memra.server.api import build_app  # noqa: E402
from memra.server.http import ServerThread  # noqa: E402
from memra.server.options import ServerOptions  # noqa: E402

EOS = 2  # the demo's end-of-sequence id
PUSH_EOS = {EOS: 22.0}  # with this bias the demo ends within three tokens of these prompts
PROMPTS = ["ROMEO:", "JULIET:\nO Romeo", "KING LEAR:"]


@pytest.fixture(scope="module")
def llm():
    return memra.LLM("demo", max_batch=4, warm_up=False)


@pytest.fixture(scope="module")
def url(llm):
    srv = ServerThread(build_app(Engine(llm.model, EngineConfig(max_batch=4, max_ctx=512)), "demo",
                                 ServerOptions())).start()
    yield srv.url
    srv.stop()


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def _one(llm, prompt, params):
    return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]


MIN_GREEDY = SP(temperature=0.0, max_tokens=16, logit_bias=PUSH_EOS, min_tokens=4, logprobs=2)
PLAIN = SP(temperature=0.0, max_tokens=16, logit_bias=PUSH_EOS, logprobs=2)
MIN_SAMPLED = SP(max_tokens=16, logit_bias=PUSH_EOS, min_tokens=5, temperature=0.9, seed=7, logprobs=2)


def test_min_tokens_masks_the_stop_ids_of_its_own_row_only(llm):
    before = counters.snapshot()["min_tokens_masked_rows"]
    params = [MIN_GREEDY, PLAIN, MIN_SAMPLED]
    solo = [_one(llm, p, sp) for p, sp in zip(PROMPTS, params)]
    batched = [r.outputs[0] for r in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert counters.snapshot()["min_tokens_masked_rows"] >= before + 2 * (4 + 5)  # the mask ran, in both runs
    for a, b in zip(solo, batched):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs and a.top_logprobs == b.top_logprobs
    assert len(solo[1].token_ids) < 4 and solo[1].token_ids[-1] == EOS  # canary: unmasked, EOS comes early
    assert EOS not in solo[0].token_ids[:4] and EOS not in solo[2].token_ids[:5]
    assert solo[0].finish_reason == "stop" and solo[0].token_ids[-1] == EOS  # EOS is allowed again after
    # the reference loop (no engine) gives the same tokens: the mask is part of the reference rule
    ids = llm.tokenizer.encode(PROMPTS[0], add_special=True)
    ref = list(generate_tokens(llm.model, ids, MIN_GREEDY, eos_ids=MIN_GREEDY.stop_ids(llm.tokenizer.eos_ids)))
    assert ref == solo[0].token_ids


def test_min_tokens_with_speculation_gives_the_plain_tokens(llm):
    """E4 with the mask: the accept walk chooses each column by the same rule (penalized rows: column by column)."""
    spec = memra.LLM(llm.model, max_batch=4, warm_up=False, speculative="ngram")
    long = SP(temperature=0.0, max_tokens=40, logit_bias=PUSH_EOS, min_tokens=30, logprobs=1)  # n-gram drafts land in its mask
    params = [MIN_GREEDY, PLAIN, MIN_SAMPLED, long, SP(**{**vars(long), "temperature": 0.7, "seed": 3})]
    prompts = PROMPTS + ["ROMEO: ROMEO: ROMEO: ROMEO:"] * 2
    plain = [r.outputs[0] for r in llm.generate(prompts, params, use_tqdm=False)]
    before = counters.snapshot()
    drafted = [r.outputs[0] for r in spec.generate(prompts, params, use_tqdm=False)]
    assert counters.snapshot()["spec_drafted_tokens"] > before["spec_drafted_tokens"] + 20  # speculation ran
    for a, b in zip(plain, drafted):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    assert len(plain[3].token_ids) > 30 and EOS not in plain[3].token_ids[:30]


def test_stop_token_ids_ignore_eos_and_the_stop_text(llm):
    plain = _one(llm, PROMPTS[0], SP(temperature=0.0, max_tokens=12))
    stop_id = plain.token_ids[3]
    cut = plain.token_ids[: plain.token_ids.index(stop_id) + 1]
    out = _one(llm, PROMPTS[0], SP(temperature=0.0, max_tokens=12, stop_token_ids=[stop_id]))
    assert out.token_ids == cut and out.finish_reason == "stop"
    assert out.text == llm.tokenizer.decode(cut[:-1], skip_special=True)  # the stop token's text is left out
    kept = _one(llm, PROMPTS[0], SP(temperature=0.0, max_tokens=12, stop_token_ids=[stop_id], include_stop_str_in_output=True))
    assert kept.text == llm.tokenizer.decode(cut, skip_special=True) != out.text
    # ignore_eos runs through EOS to max_tokens; a stop token still ends it
    assert len(_one(llm, PROMPTS[1], SP(temperature=0.0, max_tokens=10, logit_bias=PUSH_EOS)).token_ids) < 10
    run = _one(llm, PROMPTS[1], SP(temperature=0.0, max_tokens=10, logit_bias=PUSH_EOS, ignore_eos=True))
    assert len(run.token_ids) == 10 and EOS in run.token_ids and run.finish_reason == "length"
    stopped = _one(llm, PROMPTS[1], SP(temperature=0.0, max_tokens=10, logit_bias=PUSH_EOS, ignore_eos=True, stop_token_ids=[EOS]))
    assert stopped.finish_reason == "stop" and stopped.token_ids[-1] == EOS


def test_include_stop_str_and_special_token_text(llm):
    text = _one(llm, PROMPTS[2], SP(temperature=0.0, max_tokens=20)).text
    stop = text.strip()[4:7]
    without = _one(llm, PROMPTS[2], SP(temperature=0.0, max_tokens=20, stop=[stop]))
    with_it = _one(llm, PROMPTS[2], SP(temperature=0.0, max_tokens=20, stop=[stop], include_stop_str_in_output=True))
    assert with_it.text == without.text + stop and without.text == text[: text.index(stop)]
    # as in vLLM, a stop string counts only in text that comes after min_tokens tokens
    full = _one(llm, PROMPTS[2], SP(temperature=0.0, max_tokens=20, min_tokens=20))
    assert full.text == text and full.finish_reason == "length"
    assert _one(llm, PROMPTS[2], SP(temperature=0.0, max_tokens=20, stop=[stop], min_tokens=20)).text == text
    # special tokens' text: forced with a bias; skipped by default, kept (spaced as HF decodes) on request
    tok = llm.tokenizer
    forced = dict(temperature=0.0, max_tokens=3, logit_bias={1: 100.0})
    piece = tok.decode([1])
    assert piece and tok.is_special(1)
    assert _one(llm, PROMPTS[0], SP(**forced)).text == ""
    assert _one(llm, PROMPTS[0], SP(**forced, skip_special_tokens=False)).text == " ".join([piece] * 3)
    assert _one(llm, PROMPTS[0], SP(**forced, skip_special_tokens=False, spaces_between_special_tokens=False)
                ).text == piece * 3


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm):
    ids = llm.tokenizer.encode(PROMPTS[1] + " " + PROMPTS[2], add_special=True)
    r = llm.generate(PROMPTS[1] + " " + PROMPTS[2], SP(temperature=0.0, max_tokens=8, truncate_prompt_tokens=5), use_tqdm=False)[0]
    assert r.prompt_token_ids == ids[-5:]
    assert r.outputs[0].token_ids == _one(llm, ids[-5:], SP(temperature=0.0, max_tokens=8)).token_ids
    assert llm.generate(ids, SP(temperature=0.0, max_tokens=8, truncate_prompt_tokens=-1), use_tqdm=False)[0].prompt_token_ids == ids


@pytest.mark.parametrize("bad, named", [
    (dict(min_tokens=9, max_tokens=8), "min_tokens"), (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"), (dict(skip_special_tokens=1), "skip_special_tokens")])
def test_bad_values_are_named(bad, named):
    with pytest.raises(memra.MemraError, match=named):
        SP(**bad)


# --- over HTTP ---

def _ids(choice) -> list[int]:
    return [int(t.split(":")[1]) for t in choice.logprobs.tokens]


def test_http_min_tokens_rows_get_their_solo_tokens(llm, client):
    params = [MIN_GREEDY, PLAIN, MIN_SAMPLED]

    def ask(prompt, sp):
        extra = {"min_tokens": sp.min_tokens, "logit_bias": {str(k): v for k, v in sp.logit_bias},
                 "return_tokens_as_token_ids": True}
        return client.completions.create(model="demo", prompt=prompt, max_tokens=sp.max_tokens, logprobs=2,
                                         temperature=sp.temperature, seed=sp.seed, extra_body=extra).choices[0]

    with cf.ThreadPoolExecutor(3) as pool:
        got = list(pool.map(ask, PROMPTS, params))
    for choice, prompt, sp in zip(got, PROMPTS, params):
        want = _one(llm, prompt, sp)
        assert _ids(choice) == want.token_ids and choice.logprobs.token_logprobs == want.token_logprobs
        assert choice.text == want.text and choice.finish_reason == want.finish_reason
    assert len(_ids(got[0])) > 4 > len(_ids(got[1]))


def test_http_stop_fields_and_special_text(llm, client):
    plain = _one(llm, PROMPTS[0], SP(temperature=0.0, max_tokens=12))
    stop_id = plain.token_ids[3]
    for include in (False, True):
        want = _one(llm, PROMPTS[0], SP(temperature=0.0, max_tokens=12, stop_token_ids=[stop_id], include_stop_str_in_output=include))
        r = client.completions.create(model="demo", prompt=PROMPTS[0], max_tokens=12, temperature=0, extra_body={
            "stop_token_ids": [stop_id], "include_stop_str_in_output": include})
        assert r.choices[0].text == want.text and r.choices[0].finish_reason == "stop"
        assert r.usage.completion_tokens == len(want.token_ids)
    r = client.completions.create(model="demo", prompt=PROMPTS[1], max_tokens=10, temperature=0,
                                  logit_bias={str(EOS): 22.0}, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 10 and r.choices[0].finish_reason == "length"
    piece = llm.tokenizer.decode([1])
    for extra, text in (({}, ""), ({"skip_special_tokens": False}, " ".join([piece] * 3)),
                        ({"skip_special_tokens": False, "spaces_between_special_tokens": False}, piece * 3)):
        r = client.completions.create(model="demo", prompt=PROMPTS[0], max_tokens=3, logit_bias={"1": 100.0},
                                      extra_body=extra)
        assert r.choices[0].text == text, extra


def test_http_chat_streams_the_included_stop_string(client):
    msgs = [{"role": "user", "content": "Speak, fair lady."}]
    text = client.chat.completions.create(model="demo", messages=msgs, max_tokens=30, temperature=0
                                          ).choices[0].message.content
    stop = text.strip()[3:6]
    extra = {"include_stop_str_in_output": True, "min_tokens": 2}
    whole = client.chat.completions.create(model="demo", messages=msgs, max_tokens=30, temperature=0, stop=[stop],
                                           extra_body=extra).choices[0]
    assert whole.message.content == text[: text.index(stop) + len(stop)] and whole.finish_reason == "stop"
    chunks = list(client.chat.completions.create(model="demo", messages=msgs, max_tokens=30, temperature=0,
                                                 stop=[stop], stream=True, extra_body=extra))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.message.content


def test_http_truncate_prompt_tokens(llm, client, url):
    prompt = PROMPTS[1] + " " + PROMPTS[2]
    ids = llm.tokenizer.encode(prompt, add_special=True)
    r = client.completions.create(model="demo", prompt=prompt, max_tokens=8, temperature=0,
                                  extra_body={"truncate_prompt_tokens": 5})
    assert r.usage.prompt_tokens == 5
    assert r.choices[0].text == client.completions.create(model="demo", prompt=ids[-5:], max_tokens=8,
                                                          temperature=0).choices[0].text
    chat = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": prompt}],
                                                          "max_tokens": 2, "truncate_prompt_tokens": 7}, timeout=60)
    assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] == 7


@pytest.mark.parametrize("extra, named", [
    ({"min_tokens": 9, "max_tokens": 8}, "min_tokens"), ({"stop_token_ids": [10**6]}, "stop_token_ids"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"), ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"skip_special_tokens": 0}, "skip_special_tokens")])
def test_http_bad_values_are_a_400_naming_the_field(url, extra, named):
    r = httpx.post(url + "/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 4, **extra}, timeout=60)
    assert r.status_code == 400 and named in r.json()["error"]["message"], r.text
    assert "\n" not in r.json()["error"]["message"]
