"""chat_template_kwargs and `memra serve --reasoning-parser qwen3` (issue 36 item 3). The splitter is held to
one rule however the text is cut (every cut point, one character at a time); over HTTP (the openai client, a real
server on loopback) the demo model gets a Qwen3-style chat template, whose `enable_thinking` comes from
chat_template_kwargs and whose generation prompt opens `<think>` unless thinking is off."""

from __future__ import annotations

import httpx
import pytest

openai = pytest.importorskip("openai")

import memra  # noqa: E402
from memra.engine.engine import Engine, EngineConfig  # noqa: E402
from memra.errors import MemraError  # noqa: E402
from memra.server.api import build_app  # noqa: E402
from memra.server.http import ServerThread  # noqa: E402
from memra.server.options import ServerOptions  # noqa: E402
from memra.server.reasoning import ReasoningFormat  # noqa: E402

QWEN3 = ReasoningFormat.named("qwen3")
# (answer, opened by the prompt) -> (reasoning, content)
CASES = [
    (("<think>a plan</think>\n\nthe answer", False), ("a plan", "\n\nthe answer")),
    (("  \n<think>x</think>y", False), ("x", "y")),
    (("plain text </think> stays", False), ("", "plain text </think> stays")),
    (("<thin", False), ("", "<thin")),  # ended inside a would-be tag: it was text
    (("still thinking", True), ("still thinking", "")),  # max_tokens inside the reasoning
    (("a < b </thi", True), ("a < b </thi", "")),
    (("a plan</think>done</think>", True), ("a plan", "done</think>")),
    (("<think>never closed", False), ("never closed", "")),
    (("", True), ("", "")),
]


def _split(text: str, opened: bool, cuts: list[int]) -> tuple[str, str]:
    s = QWEN3.splitter(opened)
    r, c = [], []
    for a, b in zip([0, *cuts], [*cuts, len(text)]):
        x, y = s.push(text[a:b])
        r.append(x), c.append(y)
    x, y = s.finish()
    return "".join(r) + x, "".join(c) + y


@pytest.mark.parametrize("given, want", CASES)
def test_the_split_does_not_depend_on_how_the_text_was_cut(given, want):
    text, opened = given
    assert _split(text, opened, []) == want
    assert _split(text, opened, list(range(1, len(text)))) == want  # one character at a time
    for cut in range(1, len(text)):
        assert _split(text, opened, [cut]) == want, cut


def test_the_generation_prompt_decides_where_the_answer_starts():
    assert QWEN3.opened_by("<|im_start|>assistant\n<think>\n")
    assert not QWEN3.opened_by("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not QWEN3.opened_by("<|im_start|>assistant\n")


def test_an_unknown_parser_is_refused():
    with pytest.raises(MemraError, match="--reasoning-parser deepseek"):
        ServerOptions(reasoning_parser="deepseek")


TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
            "{% else %}<think>\n{% endif %}{% endif %}")
MSGS = [{"role": "user", "content": "Speak, fair lady."}]


@pytest.fixture(scope="module")
def servers():
    model = memra.load("demo")
    model.tokenizer.chat_template = TEMPLATE  # as a model directory's chat_template.jinja would give it
    engine = Engine(model, EngineConfig(max_batch=2, max_ctx=256))
    parsing = ServerThread(build_app(engine, "demo", ServerOptions(reasoning_parser="qwen3"))).start()
    plain = ServerThread(build_app(Engine(model, EngineConfig(max_batch=2, max_ctx=256)), "demo",
                                   ServerOptions())).start()
    yield parsing.url, plain.url, model.tokenizer
    parsing.stop()
    plain.stop()


def _completion(url: str, ids: list[int]) -> str:
    r = httpx.post(url + "/v1/completions", json={"prompt": ids, "max_tokens": 12, "temperature": 0}, timeout=60)
    return r.json()["choices"][0]["text"]


def test_reasoning_content_over_http(servers):
    url, plain_url, tok = servers
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    thinking_ids = tok.encode(tok.apply_chat_template(MSGS, add_generation_prompt=True), add_special=False)
    off_ids = tok.encode(tok.apply_chat_template(MSGS, add_generation_prompt=True, enable_thinking=False),
                         add_special=False)
    # thinking on (the template's default): the prompt opens <think>, so the answer is reasoning
    r = client.chat.completions.create(model="demo", messages=MSGS, max_tokens=12, temperature=0)
    msg = r.choices[0].message
    assert r.usage.prompt_tokens == len(thinking_ids)
    assert msg.content is None and msg.reasoning_content == _completion(url, thinking_ids) != ""
    stream = client.chat.completions.create(model="demo", messages=MSGS, max_tokens=12, temperature=0, stream=True)
    deltas = [c.choices[0].delta for c in stream if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == msg.reasoning_content
    assert not "".join(d.content or "" for d in deltas)
    # chat_template_kwargs reaches the template: thinking off closes the block, the answer is content
    r = client.chat.completions.create(model="demo", messages=MSGS, max_tokens=12, temperature=0,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.usage.prompt_tokens == len(off_ids) != len(thinking_ids)
    assert r.choices[0].message.content == _completion(url, off_ids)
    assert getattr(r.choices[0].message, "reasoning_content", None) is None
    tokenized = httpx.post(url + "/tokenize", json={"messages": MSGS, "chat_template_kwargs": {"enable_thinking": False}},
                           timeout=60).json()
    assert tokenized["tokens"] == off_ids
    # include_reasoning: false drops it
    r = httpx.post(url + "/v1/chat/completions", json={"messages": MSGS, "max_tokens": 4, "include_reasoning": False},
                   timeout=60).json()
    assert r["choices"][0]["message"]["reasoning_content"] is None and r["choices"][0]["message"]["content"] is None
    # without the parser the text stays whole, and include_reasoning is refused in one line naming it
    plain = httpx.post(plain_url + "/v1/chat/completions", json={"messages": MSGS, "max_tokens": 12, "temperature": 0},
                       timeout=60).json()["choices"][0]["message"]
    assert plain["content"] == msg.reasoning_content and "reasoning_content" not in plain
    refused = httpx.post(plain_url + "/v1/chat/completions", json={"messages": MSGS, "include_reasoning": False},
                         timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "include_reasoning"
    bad = httpx.post(url + "/v1/chat/completions", json={"messages": MSGS, "chat_template_kwargs": {"messages": []}},
                     timeout=60)
    assert bad.status_code == 400 and "chat_template_kwargs" in bad.json()["error"]["message"]
