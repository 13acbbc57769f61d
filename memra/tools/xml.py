"""Qwen3.5's (and Qwen3-Coder's) tool calls, as their chat template tells the model to write them:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A parameter's value is raw text; it becomes JSON by the type the tool's schema gives that parameter
(vLLM's qwen3_coder parser does the same): a string stays a string, an integer / number / boolean /
object / array is read as JSON where it parses, and anything that does not parse stays a string. The
arguments stream one parameter at a time (`{"city": "Paris"`, then `, "days": 3`, then `}`), so their
concatenation is one JSON object, the same as the whole answer's.
"""

from __future__ import annotations

import json
from typing import Callable

from memra.tools.calls import HermesCalls
from memra.tools.scan import CallDelta

_WS = " \t\r\n"
FUNCTION, PARAMETER, END_PARAMETER, END_FUNCTION = "<function=", "<parameter=", "</parameter>", "</function>"
_MAX_NAME = 256  # a name longer than this is not a name: the block is given back as text


def typed(value: str, schema) -> object:
    """A parameter's raw text as the JSON value its schema's type asks for (module docstring)."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    kinds = set(kind) if isinstance(kind, list) else {kind}
    if kinds <= {"string", None} or "string" in kinds:
        return value
    try:
        parsed = json.loads(value)
    except ValueError:
        return value
    ok = {"integer": lambda v: type(v) is int, "number": lambda v: type(v) in (int, float),
          "boolean": lambda v: type(v) is bool, "object": lambda v: isinstance(v, dict),
          "array": lambda v: isinstance(v, list), "null": lambda v: v is None}
    return parsed if any(ok.get(k, lambda v: False)(parsed) for k in kinds) else value


class XmlCall:
    """One <function=…> block (JsonCall's interface: feed, committed, done, failed, raw)."""

    def __init__(self, index: int, properties: Callable[[str], dict]):
        self.index = index
        self.properties = properties  # tool name -> its parameters' "properties"
        self.buf = ""
        self.raw: list[str] = []
        self.state = "head"  # head | params | done
        self.committed = self.failed = False
        self.params = 0
        self.names: dict = {}  # the called tool's parameters' schemas, by name

    @property
    def done(self) -> bool:
        return self.state == "done"

    def feed(self, text: str, out: list[CallDelta]) -> int:
        if not self.committed:
            self.raw.append(text)
        self.buf += text
        while self.state != "done" and not self.failed and self._step(out):
            pass
        if self.state == "done":
            return len(text) - len(self.buf)
        return len(text)

    def _step(self, out: list[CallDelta]) -> bool:
        """Read one element if it is complete; False: wait for more text."""
        lead = self.buf.lstrip(_WS)
        if self.state == "head":
            if lead.startswith(FUNCTION) and ">" in lead:
                name = lead[len(FUNCTION):lead.index(">")]
                self.buf = lead[lead.index(">") + 1:]
                self.state, self.committed, self.names = "params", True, self.properties(name)
                out.append(CallDelta(self.index, name))
                return True
            self.failed = not (FUNCTION.startswith(lead) or lead.startswith(FUNCTION) and len(lead) < _MAX_NAME)
            return False
        if lead.startswith(END_FUNCTION):
            self.buf, self.state = lead[len(END_FUNCTION):], "done"
            out.append(CallDelta(self.index, arguments="}" if self.params else "{}"))
            return True
        if lead.startswith(PARAMETER) and ">" in lead and END_PARAMETER in lead:
            gt = lead.index(">")
            end = lead.index(END_PARAMETER, gt)
            name, value = lead[len(PARAMETER):gt], lead[gt + 1:end]
            value = value[1:] if value.startswith("\n") else value  # the template writes one newline each side
            value = value[:-1] if value.endswith("\n") else value
            fragment = json.dumps(name, ensure_ascii=False) + ": " + json.dumps(typed(value, self.names.get(name)),
                                                                                  ensure_ascii=False)
            out.append(CallDelta(self.index, arguments=("{" if not self.params else ", ") + fragment))
            self.params += 1
            self.buf = lead[end + len(END_PARAMETER):]
            return True
        if lead and not (lead.startswith(PARAMETER) or PARAMETER.startswith(lead) or END_FUNCTION.startswith(lead)):
            self.finish(out)  # neither a parameter nor the end: the call ends here, its arguments closed
        return False

    def finish(self, out: list[CallDelta]) -> None:
        """The answer ended inside the call (max_tokens): close its arguments, so they stay one JSON object."""
        if self.committed and self.state != "done":
            self.state, self.buf = "done", ""
            out.append(CallDelta(self.index, arguments="}" if self.params else "{}"))


class QwenXmlCalls(HermesCalls):
    """<tool_call> blocks holding XML calls: HermesCalls' handling of the text around the blocks."""

    def __init__(self, tools, single: bool = False):
        super().__init__(single, lambda index: XmlCall(index, lambda name: _properties(tools, name)))

    def finish(self) -> tuple[str, list[CallDelta]]:
        out: list[CallDelta] = []
        if isinstance(self.call, XmlCall) and self.call.committed:
            self.call.finish(out)
        content, more = super().finish()
        return content, out + more


def _properties(tools, name: str) -> dict:
    props = tools.parameters(name).get("properties") if tools is not None else None
    return props if isinstance(props, dict) else {}
