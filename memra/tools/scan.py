"""One JSON tool call, `{"name": ..., "arguments": {...}}`, read a character at a time as it is generated.

Streamed tool calls need the call's name as soon as it is complete and its arguments as they grow,
before the object closes; a JSON parser wants the whole text. So this reads the object's top level by
hand (strings with their escapes, nesting of the values) in time linear in the text, and hands out the
arguments member's *raw* text: the streamed fragments and the whole answer's `arguments` are the very
characters the model wrote, so the two agree however the text was cut.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

_WS = " \t\r\n"


@dataclass(frozen=True)
class CallDelta:
    """What a piece of text adds to one tool call: its name on the call's first delta, then argument text."""

    index: int  # the call's position among the message's calls
    name: str | None = None
    arguments: str = ""


class ObjectScanner:
    """The top level of one JSON object: the value of its "name" member and the raw text of its arguments
    member (any of `arg_keys`). `bad`: the text is not such an object (the caller falls back to text)."""

    def __init__(self, arg_keys: tuple[str, ...] = ("arguments",)):
        self.arg_keys = arg_keys
        self.expect = "open"  # open | key | colon | value_start | value | scalar | after
        self.in_string = self.escaped = False
        self.nest = 0  # brackets open inside the current value
        self.member: str | None = None  # the key whose value is being read
        self.key_raw: list[str] = []
        self.name_raw: list[str] = []
        self.name: str | None = None
        self.args: list[str] = []  # argument text not yet taken (take_args)
        self.saw_args = False
        self.done = self.bad = False

    def take_args(self) -> str:
        out, self.args = "".join(self.args), []
        return out

    def feed(self, text: str) -> int:
        """Read `text`; returns how many characters belong to the object (all, unless it ended or went bad)."""
        for i, ch in enumerate(text):
            if self.done or self.bad:
                return i
            self._char(ch)
        return len(text)

    def _char(self, ch: str) -> None:
        e = self.expect
        if e in ("value", "scalar"):
            self._value_char(ch)
        elif e == "key" and self.in_string:
            self._key_char(ch)
        elif ch in _WS:
            return
        elif e == "open":
            self.expect, self.bad = "key", ch != "{"
        elif e == "key":
            if ch == '"':
                self.in_string, self.key_raw = True, []
            else:
                self.done, self.bad = ch == "}", ch != "}"
        elif e == "colon":
            self.expect, self.bad = "value_start", ch != ":"
        elif e == "value_start":
            self._start_value(ch)
        else:  # after a value
            self.expect, self.done, self.bad = "key", ch == "}", ch not in ",}"

    def _closes_string(self, ch: str) -> bool:
        """Inside a string: whether `ch` is its closing quote (escapes followed)."""
        if self.escaped:
            self.escaped = False
        elif ch == "\\":
            self.escaped = True
        elif ch == '"':
            self.in_string = False
            return True
        return False

    def _key_char(self, ch: str) -> None:
        if self._closes_string(ch):
            try:
                self.member = json.loads('"' + "".join(self.key_raw) + '"')
            except ValueError:  # a bad escape: not JSON, so not a call
                self.bad = True
            self.expect = "colon"
        else:
            self.key_raw.append(ch)

    def _start_value(self, ch: str) -> None:
        self.expect = "value" if ch in '"{[' else "scalar"
        if self.member in self.arg_keys:
            self.saw_args = True
        self._value_char(ch)

    def _value_char(self, ch: str) -> None:
        if self.expect == "scalar" and (ch in _WS or ch in ",}"):
            self._end_value()
            if ch in ",}":
                self._char(ch)
            return
        self._keep(ch)
        if self.expect == "scalar":
            return
        if self.in_string:
            if self._closes_string(ch) and self.nest == 0:
                self._end_value()
        elif ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.nest += 1
        elif ch in "}]":
            self.nest -= 1
            if self.nest == 0:
                self._end_value()

    def _keep(self, ch: str) -> None:
        if self.member == "name":
            self.name_raw.append(ch)
        elif self.member in self.arg_keys:
            self.args.append(ch)

    def _end_value(self) -> None:
        if self.member == "name":
            try:
                name = json.loads("".join(self.name_raw))
            except ValueError:
                name = None
            self.name, self.bad = (name, False) if isinstance(name, str) else (None, True)
        self.expect, self.member = "after", None
