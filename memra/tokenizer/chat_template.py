"""Chat templates rendered the way HF transformers renders them (sandboxed jinja2 with the same
options and helpers), so a prompt is byte-identical to the one the model was trained on."""

from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any, Callable, Mapping

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from memra.errors import TokenizerError


class _GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}`: HF templates mark the assistant's text with it to build
    training masks. For inference the block just renders its body; without this the template would not
    even parse."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _render_body(caller: Callable[[], str]) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    """Templates call raise_exception('...') to reject a conversation they cannot format."""
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    """Templates that print today's date (Llama 3.x) call strftime_now('%d %b %Y')."""
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """HF's tojson: plain json.dumps. jinja2's own would HTML-escape '<' and '&', changing the prompt."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=1)
def _template_environment() -> ImmutableSandboxedEnvironment:
    """The environment HF transformers renders chat templates in. Templates come from model downloads,
    so they run sandboxed; trim_blocks/lstrip_blocks change whitespace, so they must match exactly."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@functools.lru_cache(maxsize=16)
def _compile_template(text: str) -> jinja2.Template:
    return _template_environment().from_string(text)


def _clean_messages(messages: Any) -> list[dict[str, Any]]:
    """Check the conversation's shape and drop None-valued keys, as HF does: OpenAI-style clients send
    `"content": None` on tool calls, which templates treat differently from a missing key."""
    if not isinstance(messages, (list, tuple)):
        raise TokenizerError(f"apply_chat_template: messages must be a list of dicts, got {type(messages).__name__}")
    cleaned = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or "role" not in message:
            raise TokenizerError(
                f"apply_chat_template: message {i} must be a dict with a 'role' (and usually 'content'), "
                f"got {message!r}"
            )
        cleaned.append({k: v for k, v in message.items() if v is not None})
    return cleaned
