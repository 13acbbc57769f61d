"""The typed field reader both front doors (from_hf, from_gguf) use.

A config file is untrusted input: a value of the wrong type, a NaN, a zero head count or a layer count of
2^32 must fail here, as a one-line ConfigError naming the file, the field as spelled in the file and the
value, before anything divides by it, loops over it or allocates for it. JSON and GGUF values arrive as
plain Python values; a bool is never taken for a number (JSON `true` is not 1), and a float counts as an
integer only when it is whole (64.0).

Bounds, generous on purpose (they stop only values no real model has):
    counts  (layers, heads, KV heads, experts, top-k, MTP blocks, conv kernel, intervals)   1 .. 2^16
    dims    (hidden, head_dim, FFN and expert widths, GDN head dims and inner size)         1 .. 2^20
    vocabulary                                                                               1 .. 2^24
    positions (max_position, RoPE's original context)                                        1 .. 2^27
    RMS epsilon in (0, 1); RoPE theta in [1, 1e12]; RoPE factors in [1e-6, 1e6] (beyond either end fp32
    frequencies underflow to 0 or overflow to Inf); partial_rotary_factor in (0, 1].
"""

from __future__ import annotations

import math
import reprlib
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from memra.errors import ConfigError

MAX_COUNT = 1 << 16
MAX_DIM = 1 << 20
MAX_VOCAB = 1 << 24
MAX_POSITION = 1 << 27


@dataclass(frozen=True)
class Range:
    """The finite numbers a float field may take."""

    lo: float
    hi: float
    lo_open: bool = False
    hi_open: bool = False

    def problem(self, v: Any) -> str | None:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return f"must be a number, found {kind(v)}"
        if not math.isfinite(v):
            return "must be a finite number"
        above = v > self.lo if self.lo_open else v >= self.lo
        below = v < self.hi if self.hi_open else v <= self.hi
        if above and below:
            return None
        bounds = ("(" if self.lo_open else "[") + f"{self.lo:g}, {self.hi:g}" + (")" if self.hi_open else "]")
        return f"is out of range (must be in {bounds})"


EPSILON = Range(0.0, 1.0, lo_open=True, hi_open=True)
ROPE_THETA = Range(1.0, 1e12)
ROPE_FACTOR = Range(1e-6, 1e6)
FRACTION = Range(0.0, 1.0, lo_open=True)

_MISSING = object()
REQUIRED = _MISSING  # the default of a field that must be present
_SHORT = reprlib.Repr()
_SHORT.maxstring, _SHORT.maxother, _SHORT.maxlist = 40, 40, 4


def kind(value: Any) -> str:
    """How a JSON / GGUF value reads in a message."""
    if value is None:
        return "null"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
            tuple: "a list", dict: "an object"}.get(type(value), type(value).__name__)


def short(value: Any) -> str:
    return _SHORT.repr(value)


class Fields:
    """Reads named fields from one or more scopes (label prefix, mapping), first scope first.

    A field set to null counts as absent. Every accessor checks the value it returns, the default
    included (a default may be derived from other fields); `home` prefixes the name of an absent field
    in messages, and `fix` ends every message."""

    def __init__(self, source: str, *scopes: tuple[str, Mapping[str, Any]], home: str = "", fix: str = ""):
        self.source, self.scopes, self.home, self.fix = source, scopes, home, fix

    def fail(self, label: str, value: Any, why: str, defaulted: bool = False) -> ConfigError:
        shown = f"{label} (absent, so {short(value)})" if defaulted else f"{label} = {short(value)}"
        return ConfigError(f"{self.source}: {shown} {why}" + (f"; {self.fix}" if self.fix else ""))

    def error(self, what: str) -> ConfigError:
        return ConfigError(f"{self.source}: {what}" + (f"; {self.fix}" if self.fix else ""))

    def find(self, name: str, *aliases: str) -> tuple[str, Any] | None:
        """(label, value) of the first scope that sets `name` (or an alias), else None."""
        for key in (name, *aliases):
            for prefix, scope in self.scopes:
                if scope.get(key) is not None:
                    return prefix + key, scope[key]
        return None

    def _read(self, name: str, default: Any, aliases: tuple[str, ...], check: Callable[[Any], str | None]) -> Any:
        found = self.find(name, *aliases)
        if found is None:
            if default is _MISSING:
                raise self.error(f"required field {self.home + name!r} is missing")
            if default is None:
                return None
            label, value, defaulted = self.home + name, default, True
        else:
            (label, value), defaulted = found, False
        why = check(value)
        if why:
            raise self.fail(label, value, why, defaulted)
        return value

    def int(self, name: str, default: Any = _MISSING, *aliases: str, lo: int = 1, hi: int = MAX_COUNT) -> Any:
        value = self._read(name, default, aliases, lambda v: _int_problem(v, lo, hi))
        return None if value is None else int(value)

    def float(self, name: str, default: Any = _MISSING, *aliases: str, within: Range) -> Any:
        value = self._read(name, default, aliases, within.problem)
        return None if value is None else float(value)

    def bool(self, name: str, default: Any = _MISSING, *aliases: str) -> Any:
        value = self._read(name, default, aliases, bool_item)
        return None if value is None else bool(value)

    def str(self, name: str, default: Any = _MISSING, *aliases: str) -> Any:
        return self._read(name, default, aliases, str_item)

    def list(self, name: str, default: Any = _MISSING, *aliases: str, item: Callable[[Any], str | None]) -> Any:
        """A list whose every item passes `item` (which returns a problem, or None)."""
        def problem(v: Any) -> str | None:
            if not isinstance(v, (list, tuple)):
                return f"must be a list, found {kind(v)}"
            for i, x in enumerate(v):
                if why := item(x):
                    return f"has a bad entry [{i}] = {short(x)}: {why}"
            return None

        value = self._read(name, default, aliases, problem)
        return None if value is None else list(value)

    def scope(self, name: str) -> tuple[str, Mapping[str, Any]]:
        """A nested object (text_config, rope_parameters, ...) as a scope; an absent one is empty."""
        found = self.find(name)
        if found is None:
            return name + ".", {}
        label, value = found
        if not isinstance(value, dict):
            raise self.fail(label, value, f"must be an object, found {kind(value)}")
        return label + ".", value

    def require(self, ok: bool, what: str) -> None:
        """A check across fields (e.g. heads a multiple of KV heads); `what` names the fields and values."""
        if not ok:
            raise self.error(what)


def _int_problem(v: Any, lo: int, hi: int) -> str | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return f"must be an integer, found {kind(v)}"
    if isinstance(v, float) and not (math.isfinite(v) and v.is_integer()):
        return "must be a whole number"
    return None if lo <= v <= hi else f"is out of range (must be {lo}..{hi})"


def int_item(lo: int, hi: int) -> Callable[[Any], str | None]:
    return lambda v: _int_problem(v, lo, hi)


def bool_item(v: Any) -> str | None:
    if isinstance(v, bool) or (isinstance(v, int) and v in (0, 1)):
        return None
    return f"must be true or false, found {kind(v)}"


def str_item(v: Any) -> str | None:
    return None if isinstance(v, str) else f"must be a string, found {kind(v)}"


def token_ids(fields: Fields, name: str) -> Any:
    """An `eos_token_id` / `bos_token_id` entry: an id, a list of ids, or absent (None). Some configs
    write -1 for "none", so that passes."""
    found = fields.find(name)
    if found is None:
        return None
    label, value = found
    ids = value if isinstance(value, (list, tuple)) else [value]
    for x in ids:
        if why := _int_problem(x, -1, MAX_VOCAB):
            raise fields.fail(label, value, "must be a token id or a list of token ids (" + why + ")")
    return value


def built(source: str, make: Callable[..., Any], **kwargs: Any) -> Any:
    """make(**kwargs), with the file named in a ConfigError raised by the dataclass's own checks."""
    try:
        return make(**kwargs)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
