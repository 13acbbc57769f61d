"""Tool calling (issue 36 item 2). The call parsers are held to one rule however the text is cut (every cut
size); tools and a history of calls render as transformers renders them (Qwen3, Qwen3.5 and a Llama-3-style
template); over a real server on loopback with the openai client, `required` and a named tool make the demo
model call tools through a JSON-schema grammar, `auto` reads the model's own format (the demo's text forced
by a regex), streamed deltas add up to the whole answer, and a bad tool field is a 400 naming it."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

openai = pytest.importorskip("openai")

import memra  # noqa: E402
from memra.engine.engine import Engine, EngineConfig  # noqa: E402
from memra.server.api import build_app  # noqa: E402
from memra.server.http import ServerThread  # noqa: E402
from memra.server.options import ServerOptions  # noqa: E402
from memra.tools import ToolSpec, detect_format, parse_tool_calls, parser_for, template_messages  # noqa: E402

TEMPLATES = Path(__file__).parent / "fixtures" / "templates"
QWEN3, QWEN35 = TEMPLATES / "Qwen-Qwen3-0.6B.jinja", TEMPLATES / "Qwen3.5-4B.jinja"
LLAMA3 = TEMPLATES.parent / "tool_templates" / "llama3-tools.jinja"  # written here in Llama 3.1's conventions
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Today's weather <in> a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "days"],
                   "properties": {"city": {"type": "string", "maxLength": 10}, "days": {"type": "integer", "maximum": 9}}}}}
NOW = {"type": "function", "function": {"name": "now", "description": "The time"}}  # no parameters: takes none
TOOLS = [WEATHER, NOW]
_OPTS = {"type": "object"}  # the parsers' tools: get_weather also takes an object (typed from Qwen3.5's XML)
SPEC = ToolSpec.from_request([{"type": "function", "function": {**WEATHER["function"], "parameters": {
    **WEATHER["function"]["parameters"], "properties": {**WEATHER["function"]["parameters"]["properties"], "opts": _OPTS}}}},
    NOW])

# (format, generated text) -> (content, calls): each parser's whole-text reading
CASES = [
    ("hermes", 'I will check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa\\"ris}", "days": 3}}\n'
               '</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>',
     ("I will check.\n", [("get_weather", '{"city": "Pa\\"ris}", "days": 3}'), ("now", "{}")])),
    ("hermes", "no calls here <tool_ca", ("no calls here <tool_ca", [])),
    ("hermes", "<tool_call>\nnot json\n</tool_call> after", ("<tool_call>\nnot json\n</tool_call> after", [])),
    ("hermes", '<tool_call>\n{"name": "now"}\n</tool_call>', ("", [("now", "{}")])),
    ("hermes", '\n\n<tool_call>\n{"name": "now"}\n</tool_call>\n', ("", [("now", "{}")])),  # white space alone: no content
    ("hermes", " \n", (" \n", [])),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"ci', ("", [("get_weather", '{"ci')])),
    ("qwen3_xml", "Let me see.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                  "<parameter=days>\n3\n</parameter>\n<parameter=opts>\n{\"a\": [1]}\n</parameter>\n</function>\n"
                  "</tool_call>\n<tool_call>\n<function=now>\n</function>\n</tool_call>",
     ("Let me see.\n\n", [("get_weather", '{"city": "Paris", "days": 3, "opts": {"a": [1]}}'), ("now", "{}")])),
    ("qwen3_xml", "<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n<parameter=days>\nsoon",
     ("", [("get_weather", '{"city": "42"}')])),  # cut off: the arguments closed; city stays a string
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "now", "parameters": {}}',
     ("", [("get_weather", '{"city": "Paris"}'), ("now", "{}")])),
    ("llama3_json", '<|python_tag|>{"name": "now", "parameters": {}}', ("", [("now", "{}")])),
    ("llama3_json", 'Hello {"a": 1}', ('Hello {"a": 1}', [])),
    ("llama3_json", ' {"a": 1, "b": 2}', (' {"a": 1, "b": 2}', [])),  # JSON, but no call: content
]


def _read(parser, text: str, cut: int) -> tuple[str, list[tuple[str, str]]]:
    content, calls = "", []
    pieces = [text[i:i + cut] for i in range(0, len(text), cut)]
    for out in [parser.push(p) for p in pieces] + [parser.finish()]:
        content += out[0]
        for d in out[1]:
            if d.name is not None:
                assert d.index == len(calls)
                calls.append([d.name, ""])
            calls[d.index][1] += d.arguments
    return content, [tuple(c) for c in calls]


@pytest.mark.parametrize("fmt, text, want", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_a_parser_reads_the_same_calls_however_the_text_is_cut(fmt, text, want):
    content, calls = parse_tool_calls(text, fmt, SPEC)
    assert (content, [(c["name"], c["arguments"]) for c in calls]) == want
    for cut in range(1, 12):
        assert _read(parser_for(SPEC, fmt), text, cut) == want, cut


def test_forced_choices_and_parallel_tool_calls():
    text = '[{"name": "now", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "Rome", "days": 1}}]'
    want = ("", [("now", "{}"), ("get_weather", '{"city": "Rome", "days": 1}')])
    for cut in (1, 2, 5, 100):
        assert _read(parser_for(ToolSpec.from_request(TOOLS, "required"), None), text, cut) == want
        named = ToolSpec.from_request(TOOLS, {"type": "function", "function": {"name": "get_weather"}})
        assert _read(parser_for(named, None), '{"city": "Rome"}', cut) == ("", [("get_weather", '{"city": "Rome"}')])
    # parallel_tool_calls false: required's grammar allows one call; auto keeps the first and drops the rest
    single = ToolSpec.from_request(TOOLS, "required", False)
    assert json.loads(single.constraint().json)["maxItems"] == 1
    assert "maxItems" not in json.loads(ToolSpec.from_request(TOOLS, "required").constraint().json)
    two = CASES[0][1]
    assert _read(parser_for(ToolSpec.from_request(TOOLS, "auto", False), "hermes"), two, 3)[1] == CASES[0][2][1][:1]
    assert parser_for(ToolSpec.from_request(TOOLS, "none"), "hermes") is None


def test_templates_teach_their_formats():
    assert [detect_format(p.read_text()) for p in (QWEN3, QWEN35, LLAMA3)] == ["hermes", "qwen3_xml", "llama3_json"]
    assert detect_format("{% for m in messages %}{{ m.content }}{% endfor %}") is None


HISTORY = [  # an OpenAI client's history: arguments as JSON strings, content null beside calls
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris, and the time?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}},
        {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "noon"},
]


def _as_hf(history: list[dict], one_call: bool) -> list[dict]:
    """What a transformers user passes for the same history: arguments as mappings, content a string."""
    out = []
    for m in template_messages(history):
        m = {**m, "content": m["content"] or ""}
        if one_call and "tool_calls" in m:
            m["tool_calls"] = m["tool_calls"][:1]
        out.append(m)
    return out[:4] if one_call else out


@pytest.mark.parametrize("template_file", [QWEN3, QWEN35, LLAMA3], ids=lambda p: p.name)
def test_tools_and_calls_render_like_transformers(tmp_path, template_file):
    render = pytest.importorskip("transformers.utils.chat_template_utils").render_jinja_template
    template = template_file.read_text()
    tok = memra.load("demo").tokenizer
    tok.chat_template = template
    history = _as_hf(HISTORY, one_call=False)
    for msgs in (history[:2], history):
        want, _ = render(conversations=[msgs], chat_template=template, add_generation_prompt=True, tools=TOOLS,
                         bos_token="<|begin_of_text|>")
        got = tok.apply_chat_template(template_messages(msgs), add_generation_prompt=True, tools=TOOLS,
                                      bos_token="<|begin_of_text|>")
        assert got == want[0]
        assert "get_weather" in got and ("sunny" in got or msgs is not history)


@pytest.fixture(scope="module")
def servers():
    """The demo with its ChatML template (no call format); with Qwen3's template (hermes, detected) and the
    qwen3 reasoning parser; with Qwen3.5's (qwen3_xml, detected; its generation prompt opens <think>) and the
    same parser."""
    plain_model, qwen_model, qwen35_model = memra.load("demo"), memra.load("demo"), memra.load("demo")
    qwen_model.tokenizer.chat_template = QWEN3.read_text()
    qwen35_model.tokenizer.chat_template = QWEN35.read_text()
    started = [ServerThread(build_app(Engine(m, EngineConfig(max_batch=2, max_ctx=1024)), "demo", o)).start()
               for m, o in ((plain_model, ServerOptions()), (qwen_model, ServerOptions(reasoning_parser="qwen3")),
                            (qwen35_model, ServerOptions(reasoning_parser="qwen3")))]
    yield started[0].url, started[1].url, qwen_model.tokenizer, started[2].url
    for srv in started:
        srv.stop()


def _client(url: str):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def _streamed(chunks) -> tuple[str, list[dict], str]:
    """A stream's content, its tool-call deltas assembled (OpenAI's shape) and its finish_reason."""
    content, calls, finish = "", [], None
    for c in chunks:
        if not c.choices:
            continue
        d = c.choices[0].delta
        content += d.content or ""
        for t in d.tool_calls or ():
            if t.id is not None:
                assert t.index == len(calls) and t.type == "function" and t.function.name
                calls.append({"id": t.id, "name": t.function.name, "arguments": ""})
            calls[t.index]["arguments"] += t.function.arguments or ""
        finish = c.choices[0].finish_reason or finish
    return content, calls, finish


def _calls(message) -> list[dict]:
    return [{"id": t.id, "name": t.function.name, "arguments": t.function.arguments} for t in message.tool_calls]


MSGS = [{"role": "user", "content": "What is the weather?"}]


def test_required_and_named_make_the_demo_call_tools(servers):
    client = _client(servers[0])
    tok = servers[2]  # the same vocabulary as the plain server's
    # the demo left alone would list calls until max_tokens: a nudge towards closing the list
    close = {str(i): 5.0 for i in range(tok.vocab_size) if "]" in tok.token_to_piece(i).decode("utf-8", "replace")}
    for choice, parallel in (("required", None), ("required", False), ({"type": "function", "function": {"name": "get_weather"}}, None)):
        extra = {} if parallel is None else {"parallel_tool_calls": parallel}
        ask = dict(model="demo", messages=MSGS, tools=TOOLS, tool_choice=choice, max_tokens=200, temperature=0.8, seed=4,
                   logit_bias=close, **extra)
        r = client.chat.completions.create(**ask)
        msg, finish = r.choices[0].message, r.choices[0].finish_reason
        assert finish == "tool_calls" and msg.content is None and msg.tool_calls, (finish, msg)
        calls = _calls(msg)
        for c in calls:
            assert c["id"].startswith("chatcmpl-tool-") and c["name"] in ("get_weather", "now")
            args = json.loads(c["arguments"])
            if c["name"] == "get_weather":  # held to the tool's own schema
                assert set(args) == {"city", "days"} and type(args["days"]) is int and len(args["city"]) <= 10
            else:
                assert args == {}
        if parallel is False or isinstance(choice, dict):
            assert len(calls) == 1
        if isinstance(choice, dict):
            assert calls[0]["name"] == "get_weather"
        content, streamed, s_finish = _streamed(client.chat.completions.create(**ask, stream=True))
        assert content == "" and s_finish == "tool_calls"
        assert [(c["name"], c["arguments"]) for c in streamed] == [(c["name"], c["arguments"]) for c in calls]
    # canary: the demo left alone calls nothing
    r = client.chat.completions.create(model="demo", messages=MSGS, tools=TOOLS, tool_choice="none", max_tokens=30, seed=4)
    assert not r.choices[0].message.tool_calls and r.choices[0].message.content


AUTO_TEXT = ('<think>\nThe weather, then.\n</think>\n\nChecking.\n<tool_call>\n{"name": "get_weather", "arguments": '
             '{"city": "Paris", "days": 2}}\n</tool_call>')


def test_auto_reads_the_models_own_calls_after_its_reasoning(servers):
    """The Qwen3 template teaches <tool_call> JSON (hermes, detected); the demo's text is forced by a regex."""
    client = _client(servers[1])
    regex = "".join("\\" + ch if ch in "{}[]().*+?|^$\\" else ch for ch in AUTO_TEXT)
    ask = dict(model="demo", messages=MSGS, tools=TOOLS, max_tokens=200, extra_body={"guided_regex": regex})
    r = client.chat.completions.create(**ask)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content == "\n\nChecking.\n"
    assert msg.model_extra["reasoning_content"] == "\nThe weather, then.\n"
    assert [(c["name"], c["arguments"]) for c in _calls(msg)] == [("get_weather", '{"city": "Paris", "days": 2}')]
    content, streamed, finish = _streamed(client.chat.completions.create(**ask, stream=True))
    assert (content, [(c["name"], c["arguments"]) for c in streamed], finish) == (
        "\n\nChecking.\n", [("get_weather", '{"city": "Paris", "days": 2}')], "tool_calls")


XML_TEXT = ("The weather.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
            "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>")


def test_qwen35_calls_are_read_after_the_open_reasoning_and_required_skips_it(servers):
    """Qwen3.5's generation prompt opens <think>: auto reads the XML call after </think> (days typed as the
    schema's integer); required's grammar writes JSON from the first token, so no reasoning is split off."""
    client = _client(servers[3])
    regex = "".join("\\" + ch if ch in "{}[]().*+?|^$\\" else ch for ch in XML_TEXT)
    ask = dict(model="demo", messages=MSGS, tools=TOOLS, max_tokens=200, extra_body={"guided_regex": regex})
    msg = client.chat.completions.create(**ask).choices[0].message
    assert msg.model_extra["reasoning_content"] == "The weather.\n" and msg.content is None
    assert [(c["name"], c["arguments"]) for c in _calls(msg)] == [("get_weather", '{"city": "Paris", "days": 2}')]
    content, streamed, finish = _streamed(client.chat.completions.create(**ask, stream=True))
    assert [(c["name"], c["arguments"]) for c in streamed] == [("get_weather", '{"city": "Paris", "days": 2}')]
    assert content == "" and finish == "tool_calls"
    r = client.chat.completions.create(model="demo", messages=MSGS, tools=TOOLS, max_tokens=60, seed=1,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert r.choices[0].finish_reason == "tool_calls", r
    assert set(json.loads(r.choices[0].message.tool_calls[0].function.arguments)) == {"city", "days"}


def test_the_history_of_calls_reaches_the_template(servers):
    render = pytest.importorskip("transformers.utils.chat_template_utils").render_jinja_template
    tok = servers[2]
    want, _ = render(conversations=[_as_hf(HISTORY, False)], chat_template=tok.chat_template,
                     add_generation_prompt=True, tools=TOOLS)
    r = httpx.post(servers[1] + "/tokenize", json={"messages": HISTORY, "tools": TOOLS}, timeout=60)
    assert r.json()["tokens"] == tok.encode(want[0]), r.text
    r = _client(servers[1]).chat.completions.create(model="demo", messages=HISTORY, tools=TOOLS, tool_choice="none",
                                                      max_tokens=3)
    assert r.usage.prompt_tokens == len(tok.encode(want[0]))


@pytest.mark.parametrize("body, param, needle", [
    ({"tools": TOOLS}, "tool_choice", "--tool-call-parser"),  # auto on a template that teaches no format
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "must be one of"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "not among"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}], "tool_choice": "required"}, "tools", "name"),
    ({"tools": [NOW, NOW], "tool_choice": "required"}, "tools", "two tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice", "one of them"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls", ""),
])
def test_a_bad_tool_field_is_a_400_naming_it(servers, body, param, needle):
    r = httpx.post(servers[0] + "/v1/chat/completions", json={"messages": MSGS, "max_tokens": 4, **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and needle in err["message"], err


def test_llm_chat_renders_tools_and_a_history():
    model = memra.load("demo")
    model.tokenizer.chat_template = QWEN35.read_text()
    llm = memra.LLM(model)
    out = llm.chat(HISTORY, memra.SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False, tools=TOOLS)
    want = model.tokenizer.apply_chat_template(_as_hf(HISTORY, False), add_generation_prompt=True, tools=TOOLS)
    assert out[0].prompt_token_ids == model.tokenizer.encode(want)
    assert '<parameter=city>\nParis\n</parameter>' in want  # the string arguments reached the template as a mapping


def _accepts(tok, spec, text: str) -> bool:
    """Whether the constraint's grammar takes `text` whole (fed as the tokenizer's ids)."""
    from memra.structured import compile_for

    state = compile_for(tok, spec).start()
    state.advance(tok.encode(text, add_special=False))
    return not state.matcher.is_error() and state.matcher.is_accepting()


def test_tool_schemas_keep_their_defs_and_refs_under_every_tool_choice():
    """Issue 46: pydantic_function_tool's parameters refer to "#/$defs/..." (enums, nested models); wrapped
    as `required`'s call list, those references must still resolve, one tool's definitions apart from
    another's of the same name; a reference to the schema itself ("#") and to its properties too."""
    tok = memra.load("demo").tokenizer
    note = {"type": "function", "function": {"name": "note", "parameters": {
        "type": "object", "required": ["mood", "place"], "additionalProperties": False,
        "properties": {"mood": {"$ref": "#/$defs/Mood"}, "place": {"$ref": "#/$defs/Place"}},
        "$defs": {"Mood": {"enum": ["happy", "sad"], "type": "string"},
                  "Place": {"type": "object", "required": ["city"], "additionalProperties": False,
                            "properties": {"city": {"type": "string", "maxLength": 8}}}}}}}
    tree = {"type": "function", "function": {"name": "tree", "parameters": {
        "type": "object", "required": ["mood"], "additionalProperties": False,
        "properties": {"mood": {"$ref": "#/definitions/Mood"}, "kids": {"type": "array", "items": {"$ref": "#"}},
                       "same": {"$ref": "#/properties/mood"}},
        "definitions": {"Mood": {"const": 7}}}}}  # another tool's Mood: an integer, not the note's enum
    required = ToolSpec.from_request([note, tree], "required").constraint()
    assert "note__Mood" in required.key[1] and "tree__Mood" in required.key[1]
    good = ('[{"name":"note","arguments":{"mood":"sad","place":{"city":"Rome"}}},'
            '{"name":"tree","arguments":{"mood":7,"kids":[{"mood":7,"same":7}]}}]')
    assert _accepts(tok, required, good)
    for bad in (good.replace('"sad"', '"glad"'), good.replace('"mood":7,"kids"', '"mood":"sad","kids"'),
                good.replace('"same":7', '"same":8')):  # canaries: each reference is held, not dropped
        assert not _accepts(tok, required, bad), bad
    named = ToolSpec.from_request([note, tree], {"type": "function", "function": {"name": "note"}}).constraint()
    assert _accepts(tok, named, '{"mood":"happy","place":{"city":"Oslo"}}')
    assert not _accepts(tok, named, '{"mood":"glad","place":{"city":"Oslo"}}')
