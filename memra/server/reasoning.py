"""`memra serve --reasoning-parser qwen3`: a chat answer's thinking, `<think>…</think>`, split from its text
into `reasoning_content`, as vLLM's reasoning parsers do (whole answers and streamed deltas alike).

The rule, per choice, over the generated text (after stop strings):
- the chat template may open `<think>` in the prompt (Qwen3.5, Qwen3-Thinking; Qwen3 with enable_thinking):
  then the answer starts inside its reasoning;
- otherwise an answer that starts with `<think>` (after white space) opens it there; one that starts with
  anything else is all content;
- inside the reasoning, the text before `</think>` is reasoning and the text after it content; an answer
  that ends before `</think>` (max_tokens) is all reasoning.
Streamed text is held back only while it could still be the start of a tag, so the concatenated deltas are
the whole answer's two fields, however the text was cut (tests/test_reasoning.py cuts it everywhere).
"""

from __future__ import annotations

from dataclasses import dataclass

PARSERS = {"qwen3": ("<think>", "</think>")}  # vLLM's parser names -> (open tag, close tag)

_START, _REASONING, _CONTENT = "start", "reasoning", "content"


@dataclass(frozen=True)
class ReasoningFormat:
    start: str
    end: str

    @classmethod
    def named(cls, name: str) -> "ReasoningFormat":
        return cls(*PARSERS[name])

    def opened_by(self, prompt_suffix: str) -> bool:
        """Whether the generation prompt (the text the template adds for the assistant's turn) leaves a
        reasoning block open, so that the answer starts inside it."""
        return prompt_suffix.rfind(self.start) > prompt_suffix.rfind(self.end)

    def splitter(self, opened: bool) -> "ReasoningSplitter":
        return ReasoningSplitter(self, opened)


class ReasoningSplitter:
    """One choice's text in, (reasoning, content) pieces out (module docstring)."""

    def __init__(self, fmt: ReasoningFormat, opened: bool):
        self.fmt = fmt
        self.state = _REASONING if opened else _START
        self.held = ""  # text that may still turn out to be (the start of) a tag

    def push(self, text: str) -> tuple[str, str]:
        """-> (reasoning, content) released by this text."""
        self.held += text
        reasoning, content = [], []
        while self.held:
            if self.state == _START:
                lead = self.held.lstrip()
                if lead.startswith(self.fmt.start):
                    self.held, self.state = lead[len(self.fmt.start):], _REASONING
                elif not lead or self.fmt.start.startswith(lead):
                    break  # white space, or part of the open tag: wait for more
                else:
                    self.state = _CONTENT
            elif self.state == _REASONING:
                at = self.held.find(self.fmt.end)
                if at >= 0:
                    reasoning.append(self.held[:at])
                    self.held, self.state = self.held[at + len(self.fmt.end):], _CONTENT
                    continue
                keep = _partial_tail(self.held, self.fmt.end)
                reasoning.append(self.held[: len(self.held) - keep])
                self.held = self.held[len(self.held) - keep:]
                break
            else:
                content.append(self.held)
                self.held = ""
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """At the end of the answer: what was held back, in the field its state gives it."""
        held, self.held = self.held, ""
        return (held, "") if self.state == _REASONING else ("", held)


def _partial_tail(text: str, tag: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0
