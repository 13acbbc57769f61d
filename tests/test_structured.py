"""Structured output (memra.structured): every token held to a JSON schema, a regex, a choice list or a Lark
grammar through llguidance, on the demo model, which writes garbage without one (each check's canary: the same
request unconstrained fails it). A constrained row's tokens and logprobs are the same bits alone and beside
other rows (E10); over a real server on loopback, the OpenAI and vLLM fields work and a bad schema is a 400."""

from __future__ import annotations

import json
import re

import httpx
import pytest

openai = pytest.importorskip("openai")

import memra  # noqa: E402
from memra import counters  # noqa: E402
from memra.engine.engine import Engine, EngineConfig  # noqa: E402
from memra.errors import MemraError  # noqa: E402
from memra.sampling import SamplingParams  # noqa: E402
from memra.server.api import build_app  # noqa: E402
from memra.server.http import ServerThread  # noqa: E402
from memra.server.options import ServerOptions  # noqa: E402
from memra.structured import StructuredOutputs, compile_for  # noqa: E402

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "mood"],
          "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "maximum": 120},
                         "mood": {"enum": ["glad", "sad"]}}}
REGEX = r"[0-9]{3}-[a-z]{2,6}"
CHOICES = ["Montague", "Capulet", "neither"]
LARK = 'start: "(" word ("," word)? ("," word)? ")"\nword: /[a-z]{1,5}/'


@pytest.fixture(scope="module")
def demo():
    return memra.load("demo")


@pytest.fixture(scope="module")
def engine(demo):
    return Engine(demo, EngineConfig(max_batch=4, max_ctx=512))


def run(engine, tok, jobs):
    """[(prompt, SamplingParams)] submitted together -> per job (token ids, logprobs, finish_reason)."""
    events = [[] for _ in jobs]
    for (prompt, params), sink in zip(jobs, events):
        engine.submit(tok.encode(prompt), params, sink.append, logprobs=0, eos_ids=tok.eos_ids)
    engine.run_until_idle()
    return [([e.token_id for e in ev if e.token_id is not None], [e.logprob for e in ev if e.token_id is not None],
             ev[-1].finish_reason) for ev in events]


def _valid(obj) -> bool:
    return (isinstance(obj, dict) and set(obj) == {"name", "age", "mood"} and isinstance(obj["name"], str)
            and len(obj["name"]) <= 12 and type(obj["age"]) is int and obj["age"] <= 120 and obj["mood"] in ("glad", "sad"))


def _parses(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def closing_bias(tok) -> dict[int, float]:
    """logit_bias for the tokens holding '"' or '}': the demo left alone opens keys and never closes them."""
    return {i: 10.0 for i in range(tok.vocab_size) if set(tok.token_to_piece(i).decode("utf-8", "replace")) & set('"}')}


CHECKS = [  # (constraint, whether a text satisfies it); json_object runs with closing_bias
    (StructuredOutputs(json=SCHEMA), lambda t: _valid(_parses(t))),
    (StructuredOutputs(json_object=True), lambda t: isinstance(_parses(t), dict)),
    (StructuredOutputs(regex=REGEX), lambda t: re.fullmatch(REGEX, t) is not None),
    (StructuredOutputs(choice=CHOICES), lambda t: t in CHOICES),
    (StructuredOutputs(grammar=LARK), lambda t: re.fullmatch(r"\([a-z]{1,5}(,[a-z]{1,5}){0,2}\)", t) is not None),
]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_each_constraint_holds_and_its_canary_fails(demo, engine, temperature):
    tok = demo.tokenizer
    before = counters.snapshot()
    for so, ok in CHECKS:
        bias = closing_bias(tok) if so.json_object else {}
        base = SamplingParams(max_tokens=120, temperature=temperature, seed=5, logit_bias=bias)
        (ids, _, finish), (free, _, _) = run(engine, tok, [("ROMEO:", SamplingParams(**{**base.__dict__, "structured_outputs": so})),
                                                           ("ROMEO:", base)])
        text = tok.decode(ids, skip_special=True)
        assert ok(text) and finish == "stop", (so.key[0], text, finish)
        assert not ok(tok.decode(free, skip_special=True)), so.key[0]  # canary: the demo unconstrained fails it
    assert counters.delta(before)["grammar_masked_rows"] > 0


def test_a_rows_tokens_do_not_depend_on_its_batchmates(demo):
    """E10: a constrained row alone (B=1) and beside three other rows, constrained differently or not (B=4),
    gets the same tokens and the same logprobs, bit for bit; sampled and greedy."""
    tok = demo.tokenizer
    eng = Engine(demo, EngineConfig(max_batch=4, max_ctx=512))
    rows = [("ROMEO:", SamplingParams(max_tokens=40, temperature=1.0, seed=11, structured_outputs=StructuredOutputs(json=SCHEMA))),
            ("JULIET:", SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=StructuredOutputs(regex=REGEX))),
            ("KING LEAR:\nBlow, winds,", SamplingParams(max_tokens=40, temperature=0.8, seed=2)),
            ("First Citizen:", SamplingParams(max_tokens=40, temperature=1.0, seed=7,
                                              structured_outputs=StructuredOutputs(grammar=LARK)))]
    together = run(eng, tok, rows)
    for i, job in enumerate(rows):
        alone = run(eng, tok, [job])[0]
        assert alone[0] == together[i][0] and alone[1] == together[i][1], i  # float ==: the same bits
    # canary: the constraint changed the tokens (an ignored constraint would pass the check above)
    assert run(eng, tok, [(rows[0][0], SamplingParams(max_tokens=40, temperature=1.0, seed=11))])[0][0] != together[0][0]


def test_grammars_are_cached_by_constraint_and_bad_ones_refused(demo):
    tok = demo.tokenizer
    spec = StructuredOutputs(regex="[a-c]{4}x")
    before = counters.snapshot()
    first = compile_for(tok, spec)
    assert compile_for(tok, StructuredOutputs(regex="[a-c]{4}x")) is first
    assert counters.delta(before)["grammars_compiled"] == 1
    for bad, needle in ((StructuredOutputs(json={"type": "frobnicate"}), "frobnicate"),
                        (StructuredOutputs(regex="(["), "unclosed"), (StructuredOutputs(grammar="start: nothing"), "nothing")):
        with pytest.raises(MemraError, match=needle):
            compile_for(tok, bad)
    with pytest.raises(MemraError, match="exactly one"):
        StructuredOutputs(regex="a", choice=["b"])
    assert SamplingParams(temperature=0.0, max_tokens=128, structured_outputs={"choice": ["a", "b"]}).structured_outputs.key[0] == "choice"
    with pytest.raises(MemraError, match="structured_outputs"):
        SamplingParams(temperature=0.0, max_tokens=128, structured_outputs={"jsonn": {}})
    # a non-strict schema may use what the compiler does not implement; a strict one may not
    odd = {"type": "object", "properties": {"a": {"type": "string", "format": "no-such-format"}}}
    with pytest.raises(MemraError, match="refused"):
        compile_for(tok, StructuredOutputs(json=odd))
    compile_for(tok, StructuredOutputs(json=odd, strict=False))


def test_llm_takes_structured_outputs(demo):
    llm = memra.LLM(demo)
    out = llm.generate(["ROMEO:"], SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=StructuredOutputs(choice=CHOICES)),
                       use_tqdm=False)
    assert out[0].outputs[0].text in CHOICES


@pytest.fixture(scope="module")
def server(demo):
    srv = ServerThread(build_app(Engine(demo, EngineConfig(max_batch=4, max_ctx=512)), "demo", ServerOptions())).start()
    yield srv.url
    srv.stop()


def test_the_openai_client_gets_what_it_asked_for(demo, server):
    client = openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0)
    msgs = [{"role": "user", "content": "Who are you?"}]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    r = client.chat.completions.create(model="demo", messages=msgs, max_tokens=120, response_format=fmt)
    assert _valid(json.loads(r.choices[0].message.content)) and r.choices[0].finish_reason == "stop"
    bias = {str(k): v for k, v in closing_bias(demo.tokenizer).items()}
    r = client.chat.completions.create(model="demo", messages=msgs, max_tokens=200, response_format={"type": "json_object"},
                                       logit_bias=bias)
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    for extra, ok in (({"guided_regex": REGEX}, CHECKS[2][1]), ({"guided_choice": CHOICES}, CHECKS[3][1]),
                      ({"guided_grammar": LARK}, CHECKS[4][1]), ({"guided_json": SCHEMA}, CHECKS[0][1]),
                      ({"structured_outputs": {"regex": REGEX}}, CHECKS[2][1])):
        r = client.completions.create(model="demo", prompt="ROMEO:", max_tokens=120, temperature=0.9, seed=3,
                                      extra_body=extra)
        assert ok(r.choices[0].text), (extra, r.choices[0].text)
    # streamed: the deltas join to a valid answer
    chunks = client.chat.completions.create(model="demo", messages=msgs, max_tokens=120, response_format=fmt, stream=True)
    assert _valid(json.loads("".join(c.choices[0].delta.content or "" for c in chunks if c.choices)))


@pytest.mark.parametrize("extra, needle, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}},
     "frobnicate", None),
    ({"guided_regex": "(["}, "unclosed character class", None),
    ({"guided_grammar": "start: nothing"}, "nothing", None),
    ({"response_format": {"type": "xml"}}, "json_schema", "response_format"),
    ({"response_format": {"type": "json_schema"}}, "schema", "response_format"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "send one of them", "guided_choice"),
    ({"structured_outputs": {"choice": ["a"], "regex": "a"}}, "exactly one", "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structural_tag is not supported", "structured_outputs"),
])
def test_a_bad_constraint_is_a_400_naming_the_problem(server, extra, needle, param):
    r = httpx.post(server + "/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 4, **extra}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in err["message"] and "\n" not in err["message"] and err.get("param") == param, err
