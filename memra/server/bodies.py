"""Request bodies: read within the size limit, parsed as strict JSON, validated against a schema.

Each step fails with a 4xx naming what is wrong, before any work that scales with the body is done:
- over `max_body_bytes` -> 413, without buffering more than the limit: the rest is read and dropped
  (up to DISCARD_LIMIT), so that the client gets to read the answer instead of a reset connection.
- not UTF-8, not JSON, NaN / Infinity (not JSON numbers), nested deeper than `max_json_depth` -> 400.
- a field of the wrong type or out of range -> 400 whose message and `param` name the field; an integer
  literal too long for any field (Python refuses to convert more than 4300 digits) is named the same way.
"""

from __future__ import annotations

import json
from typing import TypeVar

from fastapi import Request
from starlette.requests import ClientDisconnect
from pydantic import BaseModel, ValidationError

from memra.server.errors import ApiError

DISCARD_LIMIT = 256 << 20  # bytes of an oversized body read and dropped before the connection is simply closed
_MAX_INT_DIGITS = 40  # longer than any int64 / uint64; such a literal is kept as an OversizedInt

Schema = TypeVar("Schema", bound=BaseModel)


class OversizedInt:
    """An integer literal with more digits than any field accepts, kept unconverted so validation can
    name the field it was sent in."""

    def __init__(self, digits: str):
        self.digits = len(digits.lstrip("-"))

    def __repr__(self) -> str:
        return f"<integer of {self.digits} digits>"


def _integer(literal: str) -> int | OversizedInt:
    return int(literal) if len(literal) <= _MAX_INT_DIGITS else OversizedInt(literal)


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


async def read_json(request: Request, max_bytes: int, max_depth: int) -> dict:
    """The body as a JSON object, within the limits (module docstring), else ApiError."""
    declared = request.headers.get("content-length", "")
    keep = not (declared.isdigit() and int(declared) > max_bytes)
    parts, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                keep = False  # from here on, read only to drop it
            if keep:
                parts.append(chunk)
            elif size > DISCARD_LIMIT:
                break
    except ClientDisconnect:
        raise ApiError(400, "the client went away before sending the whole body") from None
    if not keep:
        raise _too_large(int(declared) if declared.isdigit() else None, max_bytes)
    return parse_json(b"".join(parts), max_depth)


def parse_json(raw: bytes, max_depth: int) -> dict:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(400, f"the request body is not UTF-8 (byte {e.start})") from None
    try:
        body = json.loads(text, parse_int=_integer, parse_constant=_no_constant)
    except RecursionError:  # deeper than the interpreter's stack allows: far past max_depth
        raise ApiError(400, f"the request body nests deeper than {max_depth} levels") from None
    except ValueError as e:  # JSONDecodeError is a ValueError; so are NaN / Infinity
        raise ApiError(400, f"the request body is not valid JSON ({e})") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    # A body with fewer brackets than the limit cannot nest past it: most bodies skip the walk.
    if text.count("[") + text.count("{") > max_depth and _deeper_than(body, max_depth):
        raise ApiError(400, f"the request body nests deeper than {max_depth} levels")
    return body


def _deeper_than(obj: dict, limit: int) -> bool:
    """Whether containers nest more than `limit` levels (the top object is level 1). Iterative: a
    recursive walk is what the limit protects against."""
    stack = [(obj, 1)]
    while stack:
        node, level = stack.pop()
        if level > limit:
            return True
        for child in (node.values() if isinstance(node, dict) else node):
            if isinstance(child, (dict, list)):
                stack.append((child, level + 1))
    return False


def validate(schema: type[Schema], body: dict) -> Schema:
    """`body` as `schema`, or a 400 naming the first bad field."""
    try:
        return schema.model_validate(body)
    except ValidationError as err:
        first = _most_telling(err.errors())
        where = ".".join(str(x) for x in first.get("loc", ()) if _is_field(x)) or None
        message = first.get("msg", "invalid value")
        if isinstance(first.get("input"), OversizedInt):
            message = f"the number ({first['input'].digits} digits) is out of range"
        raise ApiError(400, f"{where}: {message}" if where else message, param=where) from None


# pydantic puts the member of a union it tried into the error's location ("str", "list[int]",
# "function-after[...]"); a client wants the field's path only.
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def _is_field(part) -> bool:
    return isinstance(part, int) or part.isdigit() or (part.isidentifier() and part not in _TYPE_TAGS)


def _most_telling(errors: list[dict]) -> dict:
    """Of a union's errors (one per member tried), the one that says most: an oversized number first,
    then one about the value rather than its type, then the deepest. For `prompt: [1, 2**40]` that is
    "less than or equal to ..." at prompt.1 from the list-of-ids member, not "a valid string" at prompt."""
    def rank(e: dict) -> tuple[int, int]:
        kind = 0 if isinstance(e.get("input"), OversizedInt) else 1 if not e.get("type", "").endswith("_type") else 2
        return kind, -len(e.get("loc", ()))

    return min(errors, key=rank)


def _too_large(size: int | None, limit: int) -> ApiError:
    got = f"{size} bytes" if size is not None else f"over {limit} bytes"
    return ApiError(413, f"the request body is {got}; this server accepts at most {limit} bytes "
                         f"(--max-body-mb {limit / (1 << 20):g})")
