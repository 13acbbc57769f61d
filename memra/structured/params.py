"""`StructuredOutputs`: what a request's output must match (vLLM's StructuredOutputsParams, in memra's terms)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from memra.errors import MemraError

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputs:
    """Exactly one of: `json` a JSON schema (a dict or its JSON text), `regex`, `choice` a list of strings,
    `grammar` a Lark grammar (llguidance's dialect), `json_object=True` any JSON object.
    `strict=False` lets a schema use keywords llguidance does not implement (they are ignored);
    with strict (the default) such a schema is refused."""

    json: str | dict | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = False  # None: vLLM's spelling of False
    strict: bool = True
    # vLLM's StructuredOutputsParams options memra does not take: refused where set
    disable_any_whitespace: bool = field(default=False, repr=False)
    disable_additional_properties: bool = field(default=False, repr=False)
    whitespace_pattern: str | None = field(default=None, repr=False)
    structural_tag: str | None = field(default=None, repr=False)
    key: tuple = field(init=False, repr=False, compare=False)  # (kind, text, strict): the compile cache's key

    def __post_init__(self) -> None:
        for name in ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern", "structural_tag"):
            if getattr(self, name) not in (None, False):
                raise MemraError(f"StructuredOutputsParams({name}=...) is not supported: memra holds the output to "
                                 "the schema's own grammar (llguidance); state it in the schema or use a regex / "
                                 "grammar constraint")
        if self.json_object is None:
            object.__setattr__(self, "json_object", False)
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise MemraError(f"structured_outputs takes exactly one of {', '.join(KINDS)}; got "
                             f"{', '.join(given) or 'none'}")
        if self.json is not None:
            if isinstance(self.json, dict):
                object.__setattr__(self, "json", json.dumps(self.json, ensure_ascii=False))
            elif not isinstance(self.json, str):
                raise MemraError(f"structured_outputs json must be a JSON schema (a dict or its text), "
                                 f"got {type(self.json).__name__}")
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) for c in self.choice) or not self.choice:
                raise MemraError("structured_outputs choice must be a non-empty list of strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise MemraError(f"structured_outputs {name} must be a string")
        if not isinstance(self.json_object, bool) or not isinstance(self.strict, bool):
            raise MemraError("structured_outputs json_object and strict must be true or false")
        kind = given[0]
        text = "" if kind == "json_object" else json.dumps(self.choice) if kind == "choice" else getattr(self, kind)
        object.__setattr__(self, "key", (kind, text, self.strict))
