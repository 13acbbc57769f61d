"""A choice's generated text in, (content, tool-call deltas) out, piece by piece: one parser per format.

    NamedCall       tool_choice named: the whole output is that tool's arguments (a grammar made it so)
    RequiredCalls   tool_choice required: [{"name": ..., "arguments": {...}}, ...] (a grammar made it so)
    HermesCalls     auto, Qwen3 / Qwen2.5 / Hermes: <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>
    Llama3Calls     auto, Llama 3.x: {"name": ..., "parameters": {...}} (`; `-separated), after <|python_tag|> if kept
    (memra.tools.xml: QwenXmlCalls, auto, Qwen3.5 / Qwen3-Coder: <tool_call>\\n<function=...><parameter=...>)

Every parser's deltas, concatenated, are the same whatever the pieces were (tests/test_tools.py cuts the text
everywhere), so a stream and a whole answer carry the same calls. Text is held back only while it may still be
the start of a tag or a call; a call commits (its first delta goes out) once its name is complete, and text
that turns out not to be a call is given back as content. `single` (parallel_tool_calls false): after the
first call, the rest of the output is dropped.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from memra.tools.scan import CallDelta, ObjectScanner

_WS = " \t\r\n"
OPEN, CLOSE = "<tool_call>", "</tool_call>"


def partial_tail(text: str, tag: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class CallParser(ABC):
    """The interface: push(text) and finish() -> (content, [CallDelta]); `calls`: calls begun so far."""

    def __init__(self, single: bool = False):
        self.single = single
        self.calls = 0
        self.over = False  # single, and the one call is complete: the rest is dropped

    @abstractmethod
    def push(self, text: str) -> tuple[str, list[CallDelta]]:
        """The content and call deltas that `text`, appended to what came before, settles."""

    def finish(self) -> tuple[str, list[CallDelta]]:
        return "", []


class JsonCall:
    """One JSON call being read: commits (a delta with the name) once the name is complete; hands out the
    arguments' text after that. Before it commits, its raw text is kept, to give back if it is no call."""

    def __init__(self, index: int, arg_keys: tuple[str, ...]):
        self.index = index
        self.scan = ObjectScanner(arg_keys)
        self.raw: list[str] = []
        self.committed = False

    def feed(self, text: str, out: list[CallDelta]) -> int:
        used = self.scan.feed(text)
        if not self.committed:
            self.raw.append(text[:used])
        if not self.committed and self.scan.name is not None:
            self.committed = True
            out.append(CallDelta(self.index, self.scan.name))
        if self.committed:
            args = self.scan.take_args()
            if args:
                out.append(CallDelta(self.index, arguments=args))
            if self.scan.done and not self.scan.saw_args:
                out.append(CallDelta(self.index, arguments="{}"))  # a call without arguments: an empty object
        return used

    @property
    def done(self) -> bool:
        return self.scan.done and self.committed

    @property
    def failed(self) -> bool:
        """Not a call after all: bad JSON, or an object without a name."""
        return self.scan.bad or (self.scan.done and not self.committed)


class NamedCall(CallParser):
    def __init__(self, name: str):
        super().__init__(single=True)
        self.name = name

    def push(self, text: str) -> tuple[str, list[CallDelta]]:
        out = [] if self.calls else [CallDelta(0, self.name)]
        self.calls = 1
        return "", out + ([CallDelta(0, arguments=text)] if text else [])

    def finish(self) -> tuple[str, list[CallDelta]]:
        return self.push("")


class RequiredCalls(CallParser):
    """A JSON array of calls; the grammar guarantees its shape, so nothing is given back as text."""

    def __init__(self):
        super().__init__()
        self.opened = False
        self.call: JsonCall | None = None

    def push(self, text: str) -> tuple[str, list[CallDelta]]:
        out: list[CallDelta] = []
        i = 0
        while i < len(text):
            if self.call is not None:
                i += self.call.feed(text[i:], out)
                if self.call.scan.done or self.call.scan.bad:
                    self.call = None
                continue
            ch = text[i]
            if ch == "{" and self.opened:
                self.call = JsonCall(self.calls, ("arguments",))
                self.calls += 1
                continue
            self.opened = self.opened or ch == "["
            i += 1
        return "", out


class HermesCalls(CallParser):
    """Calls in <tool_call>…</tool_call> blocks; text outside them is content, except white space alone
    before, between or after the calls (dropped; an answer with no calls keeps all its text)."""

    def __init__(self, single: bool = False, make_call=None):
        super().__init__(single)
        # the call inside a block: JSON here; memra.tools.xml passes its XML reader (the same interface)
        self.make_call = make_call or (lambda index: JsonCall(index, ("arguments",)))
        self.held = ""  # outside a block: text that may be the start of <tool_call>
        self.call: JsonCall | None = None
        self.tail = False  # after a block's object, until </tool_call>
        self.spoke = False  # some content went out (white space after it is content too, until a call)

    def push(self, text: str) -> tuple[str, list[CallDelta]]:
        content: list[str] = []
        out: list[CallDelta] = []
        self.held += text
        while self.held and not self.over:
            if self.tail:
                at = self.held.find(CLOSE)
                if at < 0:
                    self.held = self.held[len(self.held) - partial_tail(self.held, CLOSE):]
                    break
                self.held, self.tail = self.held[at + len(CLOSE):], False
                self.over = self.single
            elif self.call is not None:
                used = self.call.feed(self.held, out)
                rest = self.held[used:]
                if self.call.failed:  # no call after all: the block's text is content
                    content.append(OPEN + "".join(self.call.raw))
                    self.held, self.call = rest, None
                elif self.call.done:
                    self.held, self.call, self.tail = rest, None, True
                else:
                    self.held = rest
                    break
            else:
                at = self.held.find(OPEN)
                if at < 0:
                    free = self.held[: len(self.held) - partial_tail(self.held, OPEN)]
                    if self._says(free):
                        content.append(free)
                        self.held, self.spoke = self.held[len(free):], True
                    break  # else white space is held until something other than white space follows
                before = self.held[:at]
                if self._says(before):
                    content.append(before)
                    self.spoke = True
                self.held = self.held[at + len(OPEN):]
                self.call = self.make_call(self.calls)
                self.calls += 1
        if self.over:
            self.held = ""
        return "".join(content), out

    def _says(self, text: str) -> bool:
        """Whether text outside the blocks is content: white space is only beside other content, never
        alone before or after the calls (where it would make an answer of calls carry a content of "\\n\\n")."""
        return bool(text.strip(_WS)) or bool(text) and self.spoke and not self.calls

    def finish(self) -> tuple[str, list[CallDelta]]:
        held, self.held = self.held, ""
        if self.call is not None and not self.call.committed:  # an unfinished block that never named a call
            return OPEN + "".join(self.call.raw) + held, []
        if self.call is None and not self.tail and (held.strip(_WS) or not self.calls):
            return held, []
        return "", []


class Llama3Calls(CallParser):
    """Llama 3.x's JSON calls: an answer that starts with `{` (or <|python_tag|>, where special tokens are
    kept) is calls, `{"name": ..., "parameters": {...}}` separated by `;`; any other answer is content."""

    TAG = "<|python_tag|>"

    def __init__(self, single: bool = False):
        super().__init__(single)
        self.held = ""
        self.mode = "start"  # start | call | between | text
        self.lead = ""  # white space before the first call
        self.call: JsonCall | None = None

    def push(self, text: str) -> tuple[str, list[CallDelta]]:
        content: list[str] = []
        out: list[CallDelta] = []
        self.held += text
        while self.held and not self.over:
            if self.mode == "text":
                content.append(self.held)
                self.held = ""
            elif self.mode == "call":
                used = self.call.feed(self.held, out)
                self.held = self.held[used:]
                if self.call.failed and self.call.index == 0 and not self.call.committed:  # no call: all text
                    self.mode, self.held, self.calls = "text", self.lead + "".join(self.call.raw) + self.held, 0
                elif self.call.failed or self.call.done:
                    self.mode = "between"
                    self.over = self.single and self.call.done
                else:
                    break
            else:
                lead = self.held.lstrip(_WS)
                if self.mode == "start" and lead.startswith(self.TAG):
                    self.held = lead[len(self.TAG):]
                elif self.mode == "start" and (not lead or self.TAG.startswith(lead)):
                    break  # white space, or part of the tag: wait for more
                elif lead.startswith("{") or (self.mode == "between" and lead.startswith(";")):
                    if self.mode == "start":  # given back with the call's text if it is no call
                        self.lead = self.held[: len(self.held) - len(lead)]
                    self.held = lead[1:] if lead.startswith(";") else lead
                    if lead.startswith("{"):
                        self.call, self.mode = JsonCall(self.calls, ("parameters", "arguments")), "call"
                        self.calls += 1
                elif self.mode == "between":
                    self.held = ""  # after the calls: dropped, as vLLM's llama3_json parser does
                else:
                    self.mode = "text"
        if self.over:
            self.held = ""
        return "".join(content), out

    def finish(self) -> tuple[str, list[CallDelta]]:
        held, self.held = self.held, ""
        if self.mode == "call" and not self.call.committed and self.call.index == 0:
            return self.lead + "".join(self.call.raw) + held, []
        if self.mode in ("start", "text"):
            return held, []
        return "", []
