"""A request's tools, checked: what the chat template is shown, which tool_choice applies, and for
`required` / a named tool the JSON-schema constraint that makes any model call a tool (as vLLM does).

    tools                 [{"type": "function", "function": {"name", "description"?, "parameters"?, "strict"?}}]
    tool_choice           "none" | "auto" | "required" | {"type": "function", "function": {"name": ...}}
    parallel_tool_calls   false: at most one call (required: the grammar allows one; auto: later calls dropped)

The grammar's output is JSON, read back by memra.tools.calls: for a named tool the output *is* its
arguments object; for `required` it is [{"name": ..., "arguments": {...}}, ...] with one alternative per
tool, so each call's arguments match that tool's parameters.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from memra.errors import MemraError
from memra.structured import StructuredOutputs

CHOICES = ("none", "auto", "required")
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")  # OpenAI's rule for a function's name
# a function declared without parameters takes none (OpenAI: "omitting parameters defines a function with an
# empty parameter list"); its grammar allows only {}
_NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


class ToolError(MemraError):
    """A malformed tools / tool_choice / parallel_tool_calls; `param` names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolSpec:
    tools: tuple[dict, ...]  # as the client sent them (the template renders them in that key order)
    choice: str  # "none", "auto", "required" or "named"
    name: str | None = None  # the one tool to call, where choice is "named"
    parallel: bool = True

    @classmethod
    def from_request(cls, tools, tool_choice=None, parallel_tool_calls=None) -> "ToolSpec | None":
        """The request's tool fields checked (ToolError names the bad one); None when it sends no tools.
        tool_choice defaults to "auto" with tools, as in OpenAI's API."""
        if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
            raise ToolError("parallel_tool_calls must be true or false", "parallel_tool_calls")
        if not tools:
            if tool_choice not in (None, "none"):
                raise ToolError("tool_choice needs tools: send the tools it may call", "tool_choice")
            return None
        if not isinstance(tools, (list, tuple)):
            raise ToolError("tools must be a list of {\"type\": \"function\", \"function\": {...}}", "tools")
        names = [_check_tool(t, i) for i, t in enumerate(tools)]
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise ToolError(f"tools: two tools are named {dup!r}", "tools")
        choice, name = _choice(tool_choice if tool_choice is not None else "auto", names)
        return cls(tuple(tools), choice, name, parallel_tool_calls is not False)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t["function"]["name"] for t in self.tools)

    @property
    def forced(self) -> bool:
        """Whether a grammar makes the output a tool call (required or a named tool)."""
        return self.choice in ("required", "named")

    def parameters(self, name: str) -> dict:
        for t in self.tools:
            if t["function"]["name"] == name:
                return t["function"].get("parameters") or _NO_PARAMETERS
        return _NO_PARAMETERS

    def constraint(self) -> StructuredOutputs | None:
        """The JSON-schema constraint of a forced choice, None for none / auto. Non-strict: client schemas
        often carry keywords the compiler does not implement (they are ignored, as vLLM's backends do)."""
        if not self.forced:
            return None
        if self.choice == "named":
            return StructuredOutputs(json=self.parameters(self.name), strict=False)
        defs: dict = {}
        one = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                "properties": {"name": {"enum": [n]}, "arguments": hoisted(self.parameters(n), n, defs)}}
               for n in self.names]
        schema = {"type": "array", "minItems": 1, "items": one[0] if len(one) == 1 else {"anyOf": one}}
        if defs:
            schema["$defs"] = defs
        if not self.parallel:
            schema["maxItems"] = 1
        return StructuredOutputs(json=schema, strict=False)


# keywords whose values are data, not schemas: a "$ref" inside them is not a reference
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})


def hoisted(params: dict, tool: str, defs: dict) -> dict:
    """A tool's parameters schema made to work below the root of the `required` schema: its local
    references ("#", "#/$defs/X", "#/definitions/X", "#/properties/...") point from the root of the
    document, so its definitions move to the root's $defs as `<tool>__<name>` (`defs`, shared by every
    tool) and each reference is rewritten to match; a reference into the schema itself gets the whole
    schema as $defs/<tool>. -> the schema to place as the call's arguments."""
    own = {k: v for k, v in params.items() if k not in ("$defs", "definitions")}
    into_self = []

    def ref(target: str) -> str:
        if target != "#" and not target.startswith("#/"):
            return target  # another document's: left alone
        parts = target[2:].split("/") if target != "#" else []
        if len(parts) >= 2 and parts[0] in ("$defs", "definitions"):
            name = tool + "__" + parts[1].replace("~1", "/").replace("~0", "~")
            return "#/$defs/" + "/".join([name.replace("~", "~0").replace("/", "~1")] + parts[2:])
        into_self.append(target)  # the reference reaches into the schema itself
        return "#/$defs/" + "/".join([tool] + parts)

    def walk(node):
        if isinstance(node, list):
            return [walk(x) for x in node]
        if not isinstance(node, dict):
            return node
        return {k: (ref(v) if k == "$ref" and isinstance(v, str) else v if k in _DATA_KEYWORDS else walk(v))
                for k, v in node.items()}

    whole = walk(own)
    if into_self:
        defs[tool] = whole
    for key in ("$defs", "definitions"):
        for name, sub in (params.get(key) or {}).items():
            defs[f"{tool}__{name}"] = walk(sub)
    return whole


def _check_tool(tool, i: int) -> str:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise ToolError(f"{where} must be {{\"type\": \"function\", \"function\": {{...}}}}", "tools")
    fn = tool["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ToolError(f"{where}.function.name must be 1 to 64 letters, digits, '_', '.' or '-'", "tools")
    params = fn.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise ToolError(f"{where}.function.parameters must be a JSON schema (an object)", "tools")
    if fn.get("description") is not None and not isinstance(fn["description"], str):
        raise ToolError(f"{where}.function.description must be a string", "tools")
    return name


def _choice(value, names: list[str]) -> tuple[str, str | None]:
    if isinstance(value, str):
        if value not in CHOICES:
            raise ToolError(f"tool_choice must be one of {', '.join(CHOICES)} or a named function, got {value[:40]!r}",
                            "tool_choice")
        return value, None
    fn = value.get("function") if isinstance(value, dict) and value.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise ToolError("tool_choice must be a string or {\"type\": \"function\", \"function\": {\"name\": ...}}",
                        "tool_choice")
    if name not in names:
        raise ToolError(f"tool_choice names {name[:64]!r}, which is not among the tools", "tool_choice")
    return "named", name
