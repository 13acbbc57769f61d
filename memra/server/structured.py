"""A request's structured-output fields as one memra.structured.StructuredOutputs, or a 400 naming the field.

Accepted, as OpenAI and vLLM define them (at most one of these per request):
  response_format       {"type": "text"} (nothing), {"type": "json_object"}, or {"type": "json_schema",
                        "json_schema": {"name": ..., "schema": {...}, "strict": true|false}}
  structured_outputs    vLLM's: {"json": schema} | {"regex": ...} | {"choice": [...]} | {"grammar": lark}
                        | {"json_object": true}
  guided_json / guided_regex / guided_choice / guided_grammar   vLLM's older names for the same
A non-strict json_schema lets the schema use keywords the compiler does not implement (they are ignored).
"""

from __future__ import annotations

from memra.errors import MemraError
from memra.server.errors import ApiError
from memra.structured import StructuredOutputs

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_VLLM_KEYS = {"json", "regex", "choice", "grammar", "json_object"}


def structured_from(body) -> StructuredOutputs | None:
    """The one constraint `body` asks for, or None; ApiError(400) naming the field when it is malformed."""
    asked = {}
    rf = body.response_format
    if rf is not None and rf.get("type") != "text" or rf is not None and set(rf) - {"type"}:
        asked["response_format"] = lambda: _response_format(rf)
    so = body.structured_outputs
    if so is not None and any(v is not None for v in so.values()):
        asked["structured_outputs"] = lambda: _vllm(so)
    for name, kind in GUIDED.items():
        if getattr(body, name) is not None:
            asked[name] = lambda name=name, kind=kind: StructuredOutputs(**{kind: getattr(body, name)})
    if len(asked) > 1:
        raise ApiError(400, f"{' and '.join(asked)} each constrain the output; send one of them", param=list(asked)[1])
    for name, make in asked.items():
        try:
            return make()
        except MemraError as err:
            raise ApiError(400, f"{name}: {err}", param=name) from None
    return None


def _response_format(rf: dict) -> StructuredOutputs:
    kind = rf.get("type")
    if kind == "json_object" and set(rf) <= {"type"}:
        return StructuredOutputs(json_object=True)
    if kind != "json_schema":
        raise MemraError(f"type must be \"text\", \"json_object\" or \"json_schema\", got {str(kind)[:40]!r}")
    spec = rf.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise MemraError("json_schema must be an object whose \"schema\" is the JSON schema")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise MemraError("json_schema.strict must be true or false")
    return StructuredOutputs(json=spec["schema"], strict=bool(strict) if strict is not None else False)


def _vllm(so: dict) -> StructuredOutputs:
    unknown = [k for k, v in so.items() if k not in _VLLM_KEYS and v not in (None, False, "")]
    if unknown:
        raise MemraError(f"{unknown[0]} is not supported; memra takes one of {', '.join(sorted(_VLLM_KEYS))}")
    return StructuredOutputs(**{k: v for k, v in so.items() if k in _VLLM_KEYS and v is not None})
