"""A conversation's tool calls as chat templates read them.

OpenAI clients send an assistant message's `tool_calls[].function.arguments` as a JSON *string*; chat
templates written for transformers expect a mapping (Qwen3.5's iterates `arguments|items`, Llama 3.1's
writes `arguments | tojson`), and transformers passes messages through unchanged. vLLM parses the string
into a mapping before rendering (chat_utils' _postprocess_messages); so does memra, so a history rendered
from an OpenAI client's messages is the text the model was trained on. A string that is not a JSON object
is left as it is (a template that prints strings verbatim still shows it).
"""

from __future__ import annotations

import json
from typing import Any


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` with each tool call's JSON-string arguments parsed to a mapping (copies; the input is kept)."""
    out = []
    for m in messages:
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        if isinstance(calls, list) and calls:
            m = {**m, "tool_calls": [_parsed(c) for c in calls]}
        out.append(m)
    return out


def _parsed(call):
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        args = json.loads(fn["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**fn, "arguments": args}} if isinstance(args, dict) else call
