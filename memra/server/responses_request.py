"""A /v1/responses request read as the chat request it stands for (memra.server.responses serves it).

The Responses API is the chat API with other names: `input` (a string, or items) and `instructions` are
the messages, `max_output_tokens` is max_tokens, `text.format` is response_format, tools are flat
({"type": "function", "name", "parameters"}). So a Responses request is turned into a chat body and
served by the chat route's code: the same prompt tokens, the same sampling, the same tokens out (exact,
as the chat request would be). memra takes vLLM's subset of the API; the rest is refused in one line
naming the field:

    input items    messages (role user / system / developer / assistant, text parts), function_call,
                   function_call_output; not images, files, audio, reasoning or item references
    tools          type "function" only (no hosted tools: web search, file search, MCP, ...)
    tool_choice    none | auto | required | {"type": "function", "name": ...}
    text.format    text | json_object | json_schema (name, schema, strict)
    include        message.output_text.logprobs only
    refused        background, conversation, prompt, max_tool_calls, truncation "auto", reasoning settings,
                   text.verbosity, prompt_cache_key
"""

from __future__ import annotations

from memra.server.errors import ApiError

# sampling fields of the chat route that a Responses request may also carry (vLLM's extras, memra's)
PASSED = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "presence_penalty", "frequency_penalty",
          "repetition_penalty", "logit_bias", "stop_token_ids", "ignore_eos", "min_tokens", "skip_special_tokens",
          "include_stop_str_in_output", "chat_template_kwargs", "speculative", "user", "parallel_tool_calls")
LOGPROBS_INCLUDE = "message.output_text.logprobs"
_REFUSED = (("background", (False,), "memra answers while the request is open (no background responses)"),
            ("conversation", (), "memra keeps no conversations; chain requests with previous_response_id"),
            ("prompt", (), "memra has no stored prompt templates; send input and instructions"),
            ("max_tool_calls", (), "memra does not cap calls; use parallel_tool_calls false for one call"),
            ("truncation", ("disabled",), "memra never drops input to fit; a request too long is refused"),
            ("prompt_cache_key", (), "memra's prefix cache needs no routing key"),
            ("prompt_cache_retention", (), "memra's prefix cache keeps pages while memory allows"),
            ("service_tier", ("auto", "default"), "memra has one service tier"))
_TEXT_PARTS = ("input_text", "output_text", "text", "refusal")


def _bad(message: str, param: str) -> ApiError:
    return ApiError(400, message, param=param)


def check_refused(raw: dict) -> None:
    for name, no_ops, why in _REFUSED:
        value = raw.get(name)
        if value is not None and value not in no_ops:
            raise _bad(f"{name} is not supported: {why}; remove the field", name)
    reasoning = raw.get("reasoning")
    if reasoning not in (None, {}) and not (isinstance(reasoning, dict) and all(v is None for v in reasoning.values())):
        raise _bad("reasoning is not supported: memra does not steer reasoning (start the server with "
                   "--reasoning-parser to get the model's reasoning as an output item); remove the field", "reasoning")
    include = raw.get("include") or []
    if not isinstance(include, list) or any(i != LOGPROBS_INCLUDE for i in include):
        raise _bad(f"include takes only {LOGPROBS_INCLUDE!r} here", "include")
    obfuscate = (raw.get("stream_options") or {}).get("include_obfuscation") if isinstance(
        raw.get("stream_options"), dict) else None
    if obfuscate:
        raise _bad("stream_options.include_obfuscation is not supported: memra pads no events", "stream_options")


def _text(content, where: str) -> str:
    """A message's content: a string, or text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where}.content must be a string or a list of text parts", "input")
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text", part.get("refusal")), str):
            raise _bad(f"{where}.content[{j}] of type {str(kind)[:30]!r} is not supported: memra takes text parts "
                       f"({', '.join(_TEXT_PARTS)})", "input")
        out.append(part.get("text", part.get("refusal")))
    return "".join(out)


def input_messages(items) -> list[dict]:
    """`input` as chat messages: function_call items become an assistant message's tool_calls (joined to
    the assistant text just before them, as the chat API has both in one message), function_call_output
    items tool messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise _bad("input must be a string or a list of items", "input")
    messages: list[dict] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise _bad(f"{where} must be an object", "input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise _bad(f"{where}.role must be user, system, developer or assistant", "input")
            messages.append({"role": role, "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            name, args, call_id = item.get("name"), item.get("arguments"), item.get("call_id")
            if not (isinstance(name, str) and isinstance(args, str) and isinstance(call_id, str)):
                raise _bad(f"{where}: a function_call needs name, arguments (a JSON string) and call_id", "input")
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise _bad(f"{where}: a function_call_output needs the call_id it answers", "input")
            text = output if isinstance(output, str) else _text(output, where) if isinstance(output, list) else None
            if text is None:
                raise _bad(f"{where}.output must be a string or a list of text parts", "input")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
        else:
            raise _bad(f"{where} of type {str(kind)[:40]!r} is not supported: memra takes message, function_call "
                       "and function_call_output items", "input")
    return messages


def chat_tools(tools) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _bad("tools must be a list", "tools")
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise _bad(f"tools[{i}] of type {str(kind)[:40]!r} is not supported: memra calls functions only "
                       "(no hosted tools)", "tools")
        out.append({"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters",
                                                                          "strict") if tool.get(k) is not None}})
    return out


def chat_tool_choice(choice):
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    kind = choice.get("type") if isinstance(choice, dict) else choice
    raise _bad(f"tool_choice {str(kind)[:40]!r} is not supported: memra takes none, auto, required or "
               "{\"type\": \"function\", \"name\": ...}", "tool_choice")


def response_format(text) -> dict | None:
    if text is None:
        return None
    if not isinstance(text, dict):
        raise _bad("text must be an object with a format", "text")
    if text.get("verbosity") is not None:
        raise _bad("text.verbosity is not supported: memra does not steer verbosity; remove it", "text")
    fmt = text.get("format")
    if fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return None
    if isinstance(fmt, dict) and fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    raise _bad("text.format must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or {\"type\": \"json_schema\", "
               "\"name\": ..., \"schema\": {...}}", "text")


def chat_body(raw: dict, history: list[dict]) -> dict:
    """The chat request that `raw` stands for; `history`: the messages of previous_response_id's chain
    (its instructions are not carried over, as in OpenAI's API)."""
    check_refused(raw)
    if "input" not in raw:
        raise _bad("input is required: a string or a list of items", "input")
    messages = list(history) + input_messages(raw["input"])
    if raw.get("instructions") is not None:
        if not isinstance(raw["instructions"], str):
            raise _bad("instructions must be a string", "instructions")
        messages.insert(0, {"role": "system", "content": raw["instructions"]})
    if not messages:
        raise _bad("input is empty", "input")
    body = {"messages": messages, "stream": raw.get("stream", False)}
    for name in ("model", *PASSED):
        if raw.get(name) is not None:
            body[name] = raw[name]
    if raw.get("max_output_tokens") is not None:
        if type(raw["max_output_tokens"]) is not int or raw["max_output_tokens"] < 1:
            raise _bad("max_output_tokens must be a positive integer", "max_output_tokens")
        body["max_tokens"] = raw["max_output_tokens"]
    tools = chat_tools(raw.get("tools"))
    if tools:
        body["tools"] = tools
    if raw.get("tool_choice") is not None:
        body["tool_choice"] = chat_tool_choice(raw["tool_choice"])
    fmt = response_format(raw.get("text"))
    if fmt is not None:
        body["response_format"] = fmt
    if raw.get("top_logprobs") is not None or LOGPROBS_INCLUDE in (raw.get("include") or []):
        body["logprobs"] = True
        body["top_logprobs"] = raw.get("top_logprobs") or 0
    return body


def stored_messages(raw: dict, chat: dict, output: list[dict]) -> list[dict]:
    """The chain a later previous_response_id continues: this request's messages but its instructions,
    then its output as the assistant's message (text and calls; reasoning is not carried, as the chat
    API's reasoning_content is not)."""
    messages = chat["messages"][1:] if raw.get("instructions") is not None else chat["messages"]
    answer: dict = {"role": "assistant", "content": None}
    for item in output:
        if item["type"] == "message":
            answer["content"] = (answer["content"] or "") + "".join(p["text"] for p in item["content"])
        elif item["type"] == "function_call":
            answer.setdefault("tool_calls", []).append({"id": item["call_id"], "type": "function", "function": {
                "name": item["name"], "arguments": item["arguments"]}})
    return [*messages, answer]
