"""Tool calling: a request's tools shown to the chat template, `tool_choice` required / named held to a JSON
grammar, and the model's own call format read back into OpenAI's `tool_calls`.

    ToolSpec.from_request(tools, tool_choice, parallel_tool_calls)   checked fields; .constraint() for the grammar
    parser_for(spec, fmt) -> CallParser    push(text) / finish() -> (content, [CallDelta]), streamed or whole
    parse_tool_calls(text, fmt, spec)      a whole text -> (content, [{"name", "arguments"}])
    detect_format(chat_template)           which format the template teaches, or None
    template_messages(messages)            assistant tool_calls' JSON-string arguments as mappings (vLLM's rule)

Formats (`memra serve --tool-call-parser`, named as vLLM names its parsers): hermes (alias qwen3) for
`<tool_call>{json}</tool_call>`, qwen3_xml (alias qwen3_coder) for Qwen3.5's `<function=…><parameter=…>`,
llama3_json for Llama 3.x's `{"name": …, "parameters": …}`.
"""

from __future__ import annotations

from memra.errors import MemraError
from memra.tools.calls import CallParser, HermesCalls, Llama3Calls, NamedCall, RequiredCalls
from memra.tools.messages import template_messages
from memra.tools.scan import CallDelta
from memra.tools.spec import ToolError, ToolSpec
from memra.tools.xml import QwenXmlCalls

FORMATS = {"hermes": "hermes", "qwen3": "hermes", "qwen3_xml": "qwen3_xml", "qwen3_coder": "qwen3_xml",
           "llama3_json": "llama3_json"}

__all__ = ["CallDelta", "CallParser", "FORMATS", "ToolError", "ToolSpec", "detect_format", "parse_tool_calls",
           "parser_for", "template_messages"]


def detect_format(chat_template: str | None) -> str | None:
    """The call format a chat template teaches its model (the instructions it writes when given tools)."""
    t = chat_template or ""
    if "<tool_call>" in t:
        return "qwen3_xml" if "<function=" in t else "hermes"
    if "parameters" in t and ("ipython" in t or "<|python_tag|>" in t):  # Llama 3.x's tool role is ipython
        return "llama3_json"
    return None


def parser_for(spec: ToolSpec | None, fmt: str | None) -> CallParser | None:
    """The parser of one choice's text: forced choices read the grammar's JSON, auto reads `fmt`; None where
    nothing is parsed (no tools, tool_choice none). MemraError: auto with no format known."""
    if spec is None or spec.choice == "none":
        return None
    if spec.choice == "named":
        return NamedCall(spec.name)
    if spec.choice == "required":
        return RequiredCalls()
    single = not spec.parallel
    kind = FORMATS.get(fmt or "")
    if kind == "hermes":
        return HermesCalls(single)
    if kind == "qwen3_xml":
        return QwenXmlCalls(spec, single)
    if kind == "llama3_json":
        return Llama3Calls(single)
    raise MemraError(f"tool call format {fmt!r} is unknown; memra reads {', '.join(sorted(FORMATS))}")


def parse_tool_calls(text: str, fmt: str | None, spec: ToolSpec | None = None) -> tuple[str, list[dict]]:
    """A whole answer -> (content, [{"name": ..., "arguments": JSON text}]): what a stream of it would carry."""
    parser = parser_for(spec if spec is not None else ToolSpec((), "auto"), fmt)
    content, deltas = parser.push(text)
    rest, more = parser.finish()
    calls: list[dict] = []
    for d in deltas + more:
        if d.name is not None:
            calls.append({"name": d.name, "arguments": ""})
        calls[d.index]["arguments"] += d.arguments
    return content + rest, calls
