"""Scoring over HTTP (promise E9, memra.engine.scoring), for real: uvicorn on loopback with the demo.

- echo + logprobs + max_tokens 0 / 1 on /v1/completions: the prompt's tokens, null first, then each
  token's logprob and top n, text_offset into the choice's text;
- a sampled completion re-scored with continuation_start gives its sampled logprobs, float-equal through
  JSON, greedy and seeded (n = 2);
- lm-eval's `local-completions` loglikelihood requests over a local JSONL task, parsed the way its
  `parse_logprobs` does (lm-eval is not installed: the request shape and the parse are reproduced here,
  no network), equal to an offline one-shot prime's log_softmax rows;
- prompt_logprobs on completions and chat, return_tokens_as_token_ids, and the refusals.
"""

from __future__ import annotations

import json
from operator import itemgetter
from pathlib import Path

import httpx
import pytest
import torch

import memra
from memra.engine.engine import Engine, EngineConfig
from memra.server.api import build_app
from memra.server.http import ServerThread
from memra.server.options import ServerOptions

openai = pytest.importorskip("openai")
TASK = Path(__file__).parent / "fixtures" / "lm_eval" / "tiny_mc.jsonl"
PROMPT = "First Citizen:\nBefore we proceed any further, hear me speak."


@pytest.fixture(scope="module")
def demo():
    return memra.load("demo")


@pytest.fixture(scope="module")
def url(demo):
    engine = Engine(demo, EngineConfig(max_batch=4, max_ctx=512))
    srv = ServerThread(build_app(engine, "demo", ServerOptions())).start()
    yield srv.url
    srv.stop()


def post(url: str, body: dict, route: str = "/v1/completions") -> dict:
    r = httpx.post(url + route, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def ids_of(lp: dict) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in lp["tokens"]]


def test_echo_scores_the_prompt_with_offsets(demo, url):
    tok = demo.tokenizer
    ids = tok.encode(PROMPT, True)
    for max_tokens in (0, 1):
        got = post(url, {"prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": max_tokens, "temperature": 0})
        ch = got["choices"][0]
        lp = ch["logprobs"]
        assert ch["text"].startswith(PROMPT) and len(lp["tokens"]) == len(ids) + max_tokens
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert all(isinstance(x, float) and x <= 0 for x in lp["token_logprobs"][1:])
        assert all(len(t) == 1 for t in lp["top_logprobs"][1:])
        offsets = lp["text_offset"]
        assert offsets == sorted(offsets) and offsets[0] == 0
        for i, t in enumerate(lp["tokens"][: len(ids)]):  # each token's text sits at its offset
            assert ch["text"][offsets[i]: offsets[i] + len(t)] == t
        assert got["usage"]["completion_tokens"] == max_tokens
    # the prompt's part does not depend on max_tokens (the same one-shot prime)
    a = post(url, {"prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 0})["choices"][0]["logprobs"]
    b = post(url, {"prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 3})["choices"][0]["logprobs"]
    assert b["token_logprobs"][: len(ids)] == a["token_logprobs"] and b["top_logprobs"][: len(ids)] == a["top_logprobs"]


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.8, "top_p": 0.95, "seed": 3, "n": 2}])
def test_a_sampled_completion_rescored_gives_its_sampled_logprobs(demo, url, sampling):
    prompt = demo.tokenizer.encode(PROMPT, True)
    gen = post(url, {"prompt": prompt, "max_tokens": 24, "logprobs": 2, "return_tokens_as_token_ids": True,
                     **sampling})
    for ch in gen["choices"]:
        sampled = ch["logprobs"]
        out = ids_of(sampled)
        assert len(out) == 24
        scored = post(url, {"prompt": prompt + out, "echo": True, "logprobs": 2, "max_tokens": 0,
                            "continuation_start": len(prompt), "return_tokens_as_token_ids": True})
        lp = scored["choices"][0]["logprobs"]
        assert ids_of(lp) == prompt + out
        assert lp["token_logprobs"][len(prompt):] == sampled["token_logprobs"]  # float equality through JSON
        assert lp["top_logprobs"][len(prompt):] == sampled["top_logprobs"]
        # without continuation_start the completion is scored as prompt text: other bits (the canary's point)
        plain = post(url, {"prompt": prompt + out, "echo": True, "logprobs": 0, "max_tokens": 0})
        assert plain["choices"][0]["logprobs"]["token_logprobs"][len(prompt):] != sampled["token_logprobs"]


def test_the_openai_client_carries_continuation_start(demo, url):
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    prompt = demo.tokenizer.encode("ROMEO:", True)
    gen = client.completions.create(model="demo", prompt=prompt, max_tokens=8, temperature=0, logprobs=0,
                                    extra_body={"return_tokens_as_token_ids": True})
    out = [int(t.split(":")[1]) for t in gen.choices[0].logprobs.tokens]
    again = client.completions.create(model="demo", prompt=prompt + out, max_tokens=0, echo=True, logprobs=0,
                                      extra_body={"continuation_start": len(prompt)})
    assert again.choices[0].logprobs.token_logprobs[len(prompt):] == gen.choices[0].logprobs.token_logprobs


def lm_eval_requests(tok) -> tuple[list[list[int]], list[int], list[tuple[int, int]]]:
    """lm-eval's loglikelihood requests for the task: (context, continuation) pairs encoded as its
    `_encode_pair` does (the whole text encoded, the context's tokens split off), as token ids."""
    tokens, ctxlens, where = [], [], []
    for n, line in enumerate(TASK.read_text().splitlines()):
        doc = json.loads(line)
        for k, cont in enumerate(doc["choices"]):
            whole = tok.encode(doc["context"] + cont, False)
            ctx = tok.encode(doc["context"], False)
            tokens.append(whole)
            ctxlens.append(len(ctx))
            where.append((n, k))
    return tokens, ctxlens, where


def lm_eval_parse(out: dict, ctxlens: list[int]) -> list[tuple[float, bool]]:
    """lm-eval's LocalCompletionsAPI.parse_logprobs, as it reads a response."""
    res = []
    for choice, ctxlen in zip(sorted(out["choices"], key=itemgetter("index")), ctxlens):
        logprobs = sum(choice["logprobs"]["token_logprobs"][ctxlen:-1])
        tokens_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        is_greedy = all(t == max(top.values()) for t, top in zip(tokens_logprobs, top_logprobs))
        res.append((logprobs, is_greedy))
    return res


def test_lm_eval_loglikelihood_requests_on_a_local_task(demo, url):
    tokens, ctxlens, where = lm_eval_requests(demo.tokenizer)
    got = []
    for i in range(0, len(tokens), 4):  # lm-eval's batch of prompts per request
        payload = {"model": "demo", "prompt": tokens[i: i + 4], "temperature": 0, "max_tokens": 1, "logprobs": 1,
                   "seed": 1234, "echo": True}
        got += lm_eval_parse(post(url, payload), ctxlens[i: i + 4])
    assert len(got) == len(tokens)
    for toks, ctxlen, (ll, greedy) in zip(tokens, ctxlens, got):  # the oracle: one prime, all positions
        cache = demo.new_cache(len(toks))
        rows = demo.prime(toks, cache, all_logits=True)
        cache.free()
        logp = [torch.log_softmax(rows[i - 1].float(), -1) for i in range(ctxlen, len(toks))]
        assert ll == sum(float(lp[t].double()) for lp, t in zip(logp, toks[ctxlen:]))
        assert greedy == all(int(lp.argmax()) == t for lp, t in zip(logp, toks[ctxlen:]))
    picks = {}
    for (n, k), (ll, _) in zip(where, got):
        picks.setdefault(n, []).append(ll)
    assert len(picks) == 4 and all(len(v) == 3 for v in picks.values())


def test_prompt_logprobs_on_completions_and_chat(demo, url):
    ids = demo.tokenizer.encode(PROMPT, True)
    ch = post(url, {"prompt": ids, "max_tokens": 2, "prompt_logprobs": 2, "echo": True, "logprobs": 2})["choices"][0]
    plp = ch["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    for i in range(1, len(ids)):
        own = plp[i][str(ids[i])]
        assert own["logprob"] == ch["logprobs"]["token_logprobs"][i] and own["rank"] >= 1
        ranks = sorted(e["rank"] for e in plp[i].values())
        assert ranks[:2] == [1, 2] or own["rank"] > 2
    chat = post(url, {"messages": [{"role": "user", "content": "Speak."}], "max_tokens": 2, "prompt_logprobs": 0},
                "/v1/chat/completions")
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    assert all(len(e) == 1 for e in chat["prompt_logprobs"][1:])


@pytest.mark.parametrize("body,needle", [
    ({"prompt": "x", "echo": True, "stream": True}, "echo"),
    ({"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"prompt": "x", "continuation_start": 1}, "continuation_start"),
    ({"prompt": "ROMEO:", "echo": True, "logprobs": 0, "max_tokens": 0, "continuation_start": 99},
     "continuation_start"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
])
def test_scoring_refusals(url, body, needle):
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 400 and needle in r.json()["error"]["message"] + str(r.json()["error"]["param"]), r.text


def test_text_offsets_of_a_stream_and_a_whole_answer_agree(url):
    body = {"prompt": PROMPT, "max_tokens": 16, "logprobs": 0, "temperature": 0}
    whole = post(url, body)["choices"][0]
    offsets, text = [], ""
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                ch = json.loads(line[6:])["choices"][0]
                offsets += (ch["logprobs"] or {}).get("text_offset", [])
                text += ch["text"]
    assert text == whole["text"] and offsets == whole["logprobs"]["text_offset"]
    for t, o in zip(whole["logprobs"]["tokens"], offsets):
        assert whole["text"][o: o + len(t)] == t
