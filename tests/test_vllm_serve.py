"""Issue 46's drop-in test for servers: a `vllm serve`-style command line with its flags (a real
`python -m memra serve demo ...` process on loopback, started once for the module) driven by the real
`openai` client as a vLLM user drives it — `chat.completions.parse` with a Pydantic model,
`pydantic_function_tool` tools with enums and nested models under every tool_choice, `responses.create`
streamed and not (the same tokens as the same chat request, bit for bit), previous_response_id,
unseeded samples that differ and seeded ones that repeat, aborts counted in /metrics, and endpoints memra
does not serve named as such."""

from __future__ import annotations

import enum
import json
import re
import time

import httpx
import pytest
from test_serve_cli import _serve

openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")

KEY = "sk-vllm-style"
# as a vLLM user writes it (memra's own names for these are aliases)
FLAGS = ("--host", "127.0.0.1", "--max-model-len", "1024", "--max-num-seqs", "4", "--max-num-batched-tokens", "256",
         "--gpu-memory-utilization", "0.5", "--served-model-name", "demo", "my-model", "--api-key", KEY,
         "--dtype", "auto", "--seed", "7", "--enable-prefix-caching", "--enforce-eager", "--generation-config", "vllm",
         "--tensor-parallel-size", "1", "--pipeline-parallel-size", "1", "--trust-remote-code",
         "--uvicorn-log-level", "warning", "--enable-auto-tool-choice", "--disable-log-stats",
         "--disable-log-requests")


class Mood(str, enum.Enum):
    happy = "happy"
    sad = "sad"


class Place(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=8)
    days: int = pydantic.Field(ge=0, le=9)


class Note(pydantic.BaseModel):
    """A note about the weather."""

    mood: Mood
    place: Place


class Lookup(pydantic.BaseModel):
    mood: Mood


@pytest.fixture(scope="module")
def server():
    proc, url = _serve(*FLAGS)  # `python -m memra serve demo --port P` + the flags, up and healthy
    yield url
    proc.terminate()
    proc.wait(timeout=60)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0)


MSGS = [{"role": "user", "content": "How is the weather?"}]


def test_served_names_are_the_given_ones(client):
    assert [m.id for m in client.models.list().data] == ["demo", "my-model"]
    r = client.chat.completions.create(model="my-model", messages=MSGS, max_tokens=2, temperature=0)
    assert r.model == "demo" and r.choices[0].message.content is not None
    with pytest.raises(openai.NotFoundError, match="'nope' does not exist; this server serves 'demo' or 'my-model'"):
        client.chat.completions.create(model="nope", messages=MSGS, max_tokens=2)


def test_parse_with_a_pydantic_model(client):
    r = client.chat.completions.parse(model="demo", messages=MSGS, response_format=Note, max_tokens=60, seed=1)
    note = r.choices[0].message.parsed
    assert isinstance(note, Note) and isinstance(note.mood, Mood) and len(note.place.city) <= 8


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "Note"}}])
def test_pydantic_function_tools_with_enums_and_nested_models(client, choice):
    tools = [openai.pydantic_function_tool(Note), openai.pydantic_function_tool(Lookup)]
    assert "$defs" in json.dumps(tools[0])  # the schema refers to its definitions, as real ones do
    r = client.chat.completions.create(model="demo", messages=MSGS, tools=tools, tool_choice=choice,
                                       parallel_tool_calls=False, max_tokens=80, seed=2)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    model = {"Note": Note, "Lookup": Lookup}[calls[0].function.name]
    model.model_validate_json(calls[0].function.arguments)  # held to the tool's own schema, $refs included


def _chat_and_response(client, **common):
    """The same request through both APIs; -> (chat completion, response)."""
    chat = client.chat.completions.create(
        model="demo", messages=[{"role": "system", "content": "Answer in verse."}, *MSGS], max_tokens=16,
        logprobs=True, top_logprobs=2, **common)
    resp = client.responses.create(model="demo", instructions="Answer in verse.", input=MSGS, max_output_tokens=16,
                                   top_logprobs=2, **common)
    return chat, resp


@pytest.mark.parametrize("common", [{"temperature": 0}, {"temperature": 0.9, "extra_body": {"seed": 11}}])
def test_a_response_has_the_tokens_of_the_same_chat_request(client, common):
    chat, resp = _chat_and_response(client, **common)
    want = [(t.token, t.logprob, [(x.token, x.logprob) for x in t.top_logprobs]) for t in chat.choices[0].logprobs.content]
    part = resp.output[0].content[0]
    got = [(t.token, t.logprob, [(x.token, x.logprob) for x in t.top_logprobs]) for t in part.logprobs]
    assert got == want and resp.output_text == chat.choices[0].message.content  # floats through JSON: bit for bit
    assert (resp.usage.input_tokens, resp.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    # streamed: the deltas add up to the same text, and the last event carries the same response
    events = list(client.responses.create(model="demo", instructions="Answer in verse.", input=MSGS,
                                          max_output_tokens=16, stream=True, **common))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == resp.output_text
    assert events[-1].response.output_text == resp.output_text and events[-1].response.status == "incomplete"
    with client.responses.stream(model="demo", instructions="Answer in verse.", input=MSGS, max_output_tokens=16,
                                 **common) as stream:  # the client's helper, as agent SDKs read a stream
        assert stream.get_final_response().output_text == resp.output_text


def test_response_tools_call_outputs_and_previous_response_id(client):
    strict = openai.pydantic_function_tool(Note)["function"]["parameters"]  # $defs, additionalProperties false
    tool = {"type": "function", "name": "Note", "parameters": strict, "strict": True}
    first = client.responses.create(model="demo", input="Write a note.", tools=[tool], tool_choice="required",
                                    parallel_tool_calls=False, max_output_tokens=200, temperature=0)
    call = first.output[-1]
    assert call.type == "function_call" and call.name == "Note" and first.status == "completed"
    Note.model_validate_json(call.arguments)
    events = list(client.responses.create(model="demo", input="Write a note.", tools=[tool], tool_choice="required",
                                          parallel_tool_calls=False, max_output_tokens=200, temperature=0, stream=True))
    streamed = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert streamed == done[0].arguments == call.arguments and events[-1].type == "response.completed"
    # the call's result as an input item, continuing the stored conversation
    follow = client.responses.create(model="demo", previous_response_id=first.id, max_output_tokens=8, temperature=0,
                                     input=[{"type": "function_call_output", "call_id": call.call_id, "output": "ok"}])
    # the same conversation sent whole (the call as an input item) gives the same tokens
    whole = client.responses.create(model="demo", max_output_tokens=8, temperature=0, input=[
        {"role": "user", "content": "Write a note."},
        {"type": "function_call", "call_id": call.call_id, "name": "Note", "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "ok"}])
    assert follow.output_text == whole.output_text and follow.usage.input_tokens == whole.usage.input_tokens
    assert client.responses.retrieve(first.id).output[-1].arguments == call.arguments
    with pytest.raises(openai.NotFoundError, match="is not stored on this server"):
        client.responses.create(model="demo", input="x", previous_response_id="resp_missing")


def test_responses_structured_output(client):
    r = client.responses.parse(model="demo", input="Write a note.", text_format=Note, max_output_tokens=60,
                               temperature=0)
    assert isinstance(r.output_parsed, Note)


@pytest.mark.parametrize("extra, needle", [
    ({"background": True}, "background is not supported"),
    ({"tools": [{"type": "web_search"}]}, "tools[0] of type 'web_search' is not supported"),
    ({"reasoning": {"effort": "high"}}, "reasoning is not supported"),
    ({"truncation": "auto"}, "truncation is not supported"),
])
def test_what_responses_does_not_serve_is_refused_in_one_line(client, extra, needle):
    with pytest.raises(openai.BadRequestError, match=re.escape(needle)):
        client.responses.create(model="demo", input="x", max_output_tokens=2, extra_body=extra)


def test_unseeded_samples_differ_and_seeded_ones_repeat(client):
    def text(**kw):
        return client.chat.completions.create(model="demo", messages=MSGS, max_tokens=12, temperature=1.0,
                                              **kw).choices[0].message.content

    unseeded = {text() for _ in range(3)}
    assert len(unseeded) == 3
    assert text(seed=5) == text(seed=5)


def _aborts(url: str) -> float:
    found = re.search(r'^memra:request_success_total\{finished_reason="abort"\} (\S+)$',
                      httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text, re.M)
    return float(found.group(1)) if found else 0.0


def test_an_abort_is_counted_in_metrics(server):
    before = _aborts(server)
    body = {"model": "demo", "prompt": "KING LEAR:", "max_tokens": 900, "temperature": 0, "stream": True}
    with httpx.stream("POST", server + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=60) as r:
        next(r.iter_lines())  # the first chunk, then the client goes away
    deadline = time.monotonic() + 30
    while _aborts(server) < before + 1:
        assert time.monotonic() < deadline, "the aborted request never reached request_success_total"
        time.sleep(0.1)


def test_endpoints_memra_does_not_serve_say_so(client):
    for call in (lambda: client.embeddings.create(model="demo", input="x"),
                 lambda: client.images.generate(model="demo", prompt="x")):
        with pytest.raises(openai.NotFoundError, match="is not supported by memra, which serves text generation"):
            call()


def test_the_servers_seed_makes_unseeded_runs_repeat():
    """--seed S: requests without a seed draw theirs from a stream seeded by S, so a run of the same requests
    repeats from server to server; another S (the canary) gives other samples."""
    import memra
    from memra.engine.engine import Engine, EngineConfig
    from memra.server.api import build_app
    from memra.server.http import ServerThread
    from memra.server.options import ServerOptions

    model = memra.load("demo")

    def run(seed: int) -> list[str]:
        srv = ServerThread(build_app(Engine(model, EngineConfig(max_batch=2, max_ctx=256)), "demo",
                                     ServerOptions(seed=seed))).start()
        try:
            c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
            return [c.completions.create(model="demo", prompt="ROMEO:", max_tokens=8, temperature=1.0).choices[0].text
                    for _ in range(2)]
        finally:
            srv.stop()

    first = run(3)
    assert first[0] != first[1] and run(3) == first and run(4) != first

