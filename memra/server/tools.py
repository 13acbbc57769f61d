"""Tool calling on the chat route: the request's tool fields checked, and one choice's parsed calls in
OpenAI's shape, streamed or whole (memra.tools does the reading).

- `tools` reach the chat template; `tool_choice` none renders them and parses nothing (as vLLM does);
  auto reads the model's own format (`--tool-call-parser`, else the format the chat template teaches:
  memra.tools.detect_format) and is a 400 naming tool_choice where neither gives one; required and a named
  tool are held to a JSON-schema grammar, so they work on any model, and may not be combined with another
  output constraint (response_format and kin).
- A call's first delta carries its index, id (`chatcmpl-tool-<32 hex>`), type and name with empty
  arguments; later deltas carry argument text. The whole answer's message is what the deltas add up to:
  `tool_calls`, `content` null where no text is left, finish_reason "tool_calls" where the answer ended
  by itself (a cut-off one keeps "length").
"""

from __future__ import annotations

import uuid

from memra.server.errors import ApiError
from memra.tools import FORMATS, CallDelta, CallParser, ToolError, ToolSpec, parser_for


def tool_spec(body, fmt: str | None, generates: bool = True) -> ToolSpec | None:
    """The request's tool fields (ApiError 400 naming the field); None without tools. generates: false on
    /tokenize, which only renders them (no format is needed there)."""
    try:
        spec = ToolSpec.from_request(body.tools, getattr(body, "tool_choice", None),
                                     getattr(body, "parallel_tool_calls", None))
    except ToolError as err:
        raise ApiError(400, str(err), param=err.param) from None
    if spec is None:
        return None
    if generates and spec.choice == "auto" and fmt not in FORMATS:
        raise ApiError(400, "tool_choice \"auto\" (the default with tools) needs a tool call format, and this "
                            "model's chat template teaches none memra reads; send tool_choice \"required\", a named "
                            "function or \"none\", or start the server with --tool-call-parser "
                            f"{'|'.join(sorted(FORMATS))}", param="tool_choice")
    return spec


def forced_constraint(spec: ToolSpec | None, asked):
    """The output constraint of the request: the tool grammar for required / named, else `asked`."""
    if spec is None or not spec.forced:
        return asked
    if asked is not None:
        raise ApiError(400, f"tool_choice {spec.choice} holds the output to the tools' schema; it cannot also "
                            "follow response_format (or another output constraint): send one of them",
                       param="tool_choice")
    return spec.constraint()


class ChoiceCalls:
    """One choice's text through its call parser, the deltas in OpenAI's shape (ids given here)."""

    def __init__(self, parser: CallParser):
        self.parser = parser
        self.ids: list[str] = []

    @classmethod
    def for_choices(cls, spec: ToolSpec | None, fmt: str | None, n: int) -> "list[ChoiceCalls] | None":
        if parser_for(spec, fmt) is None:
            return None
        return [cls(parser_for(spec, fmt)) for _ in range(n)]

    def push(self, text: str, finish: str | None) -> tuple[str, list[dict], str | None]:
        """-> (content, tool-call deltas, finish_reason) for this piece of the choice's text."""
        content, deltas = self.parser.push(text) if text else ("", [])
        if finish is not None:
            rest, more = self.parser.finish()
            content, deltas = content + rest, deltas + more
            if finish == "stop" and self.parser.calls:
                finish = "tool_calls"
        return content, self._shaped(deltas), finish

    def _shaped(self, deltas: list[CallDelta]) -> list[dict]:
        out: list[dict] = []
        for d in deltas:
            if d.name is not None:
                self.ids.append("chatcmpl-tool-" + uuid.uuid4().hex)
                out.append({"index": d.index, "id": self.ids[d.index], "type": "function",
                            "function": {"name": d.name, "arguments": d.arguments}})
            elif out and out[-1]["index"] == d.index:  # fragments of one call in one delta: joined
                out[-1]["function"]["arguments"] += d.arguments
            else:
                out.append({"index": d.index, "function": {"arguments": d.arguments}})
        return out


def assembled(deltas: list[dict]) -> list[dict]:
    """A choice's streamed tool-call deltas -> the whole message's `tool_calls`."""
    calls: list[dict] = []
    for d in deltas:
        if "id" in d:
            calls.append({"id": d["id"], "type": "function",
                          "function": {"name": d["function"]["name"], "arguments": ""}})
        calls[d["index"]]["function"]["arguments"] += d["function"]["arguments"]
    return calls
