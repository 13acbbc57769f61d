"""Every OpenAI or vLLM request field memra does not honour is a 400 naming it (memra.server.unhonoured),
over a real server on loopback; the same fields with their no-op values, and vendor extras, are served."""

from __future__ import annotations

import httpx
import pytest

import memra
from memra.engine.engine import Engine, EngineConfig
from memra.server.api import build_app
from memra.server.http import ServerThread
from memra.server.options import ServerOptions
from memra.server.unhonoured import BOTH, CHAT, HONOURED, TABLE

ROUTES = {CHAT: "/v1/chat/completions", "completions": "/v1/completions"}
BASE = {CHAT: {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1},
        "completions": {"prompt": "ROMEO:", "max_tokens": 1}}
# what the issue and the two protocols name; each must be refused or honoured, none silently dropped
NAMED = {"tools", "tool_choice", "response_format", "stop_token_ids", "min_tokens", "ignore_eos",
         "chat_template_kwargs", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
         "guided_grammar", "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
         "truncate_prompt_tokens", "allowed_token_ids", "bad_words", "use_beam_search", "length_penalty", "best_of",
         "suffix", "functions", "function_call", "parallel_tool_calls", "reasoning_effort", "modalities", "audio",
         "prediction", "service_tier", "store", "metadata", "web_search_options", "add_generation_prompt",
         "continue_final_message", "documents", "chat_template", "mm_processor_kwargs", "priority", "request_id",
         "logits_processors", "cache_salt", "kv_transfer_params", "vllm_xargs", "prompt_embeds"}


@pytest.fixture(scope="module")
def url():
    engine = Engine(memra.load("demo"), EngineConfig(max_batch=2, max_ctx=256))
    srv = ServerThread(build_app(engine, "demo", ServerOptions())).start()
    yield srv.url
    srv.stop()


def _refused_value(row, body):
    """A value the row does not accept as a no-op."""
    for v in ({"x": 1}, ["x"], "x", 7, True, 2.5):
        if not row.no_op(v, body):
            return v
    raise AssertionError(f"{row.name} accepts every value: it refuses nothing")


def test_the_table_covers_every_field_named():
    names = {r.name for r in TABLE}
    assert NAMED <= names | HONOURED, NAMED - names - HONOURED
    assert not names & HONOURED, names & HONOURED
    assert len(names) == len(TABLE)  # one row per field
    assert all(r.source and r.why for r in TABLE)


@pytest.mark.parametrize("route", BOTH)
def test_every_unhonoured_field_is_a_400_naming_it(url, route):
    walked = 0
    for row in TABLE:
        if route not in row.routes:
            continue
        body = dict(BASE[route])
        body[row.name] = _refused_value(row, body)
        r = httpx.post(url + ROUTES[route], json=body, timeout=60)
        assert r.status_code == 400, (row.name, r.text)
        err = r.json()["error"]
        assert err["param"] == row.name and err["message"].startswith(row.name + " "), err
        assert "\n" not in err["message"]
        walked += 1
    assert walked >= 20  # the table shrinks as fields are honoured; this proves the walk ran


@pytest.mark.parametrize("route", BOTH)
def test_no_op_values_nulls_and_vendor_extras_are_served(url, route):
    no_ops = {"tools": [], "tool_choice": "none", "parallel_tool_calls": False, "functions": [],
              "function_call": "auto", "response_format": {"type": "text"}, "modalities": ["text"],
              "service_tier": "auto", "store": False, "metadata": {}, "use_beam_search": False, "length_penalty": 1,
              "stop_token_ids": [], "include_stop_str_in_output": False, "ignore_eos": False, "min_tokens": 0,
              "skip_special_tokens": True, "spaces_between_special_tokens": True, "bad_words": [], "priority": 0,
              "return_token_ids": False, "vllm_xargs": {}, "some_vendor_extra": {"anything": 1}}
    if route == CHAT:
        no_ops |= {"add_generation_prompt": True, "continue_final_message": False, "chat_template_kwargs": {},
                   "echo": False, "include_reasoning": True}
    else:
        no_ops |= {"suffix": "", "best_of": 1}
    nulls = {r.name: None for r in TABLE if route in r.routes}
    for extra in (no_ops, nulls):
        r = httpx.post(url + ROUTES[route], json={**BASE[route], **extra}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 1


def test_a_type_confusion_is_not_a_no_op(url):
    """`ignore_eos: 0` is not `false`, `min_tokens: false` is not 0: JSON types are kept apart."""
    for field, value in (("ignore_eos", 0), ("min_tokens", False), ("store", 0), ("stop_token_ids", [True])):
        r = httpx.post(url + "/v1/completions", json={**BASE["completions"], field: value}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"].split(".")[0] == field


def test_add_special_tokens_is_honoured(url):
    tok = memra.load("demo").tokenizer
    for add in (True, False):
        r = httpx.post(url + "/v1/completions", json={**BASE["completions"], "add_special_tokens": add}, timeout=60)
        assert r.json()["usage"]["prompt_tokens"] == len(tok.encode("ROMEO:", add))
