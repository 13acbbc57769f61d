"""The OpenAI request bodies, validated: a wrong type, a value out of range or an unsupported option
is an HTTP 400 with an OpenAI-style error body naming the field, never a stack trace. Unknown extra
fields are ignored (clients send vendor extras), known fields are type-checked strictly (no "0.5" for a
number, no true for 1), every number must be finite and in its range (so nothing downstream meets an
overflow), and every string must be Unicode text (JSON can carry a lone surrogate, "\\ud800", which has
no UTF-8 form and would fail deep in the tokenizer).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictStr

from memra.errors import MemraError
from memra.sampling import MAX_LOGPROBS, MAX_N, MAX_STOP_STRINGS, SamplingParams
from memra.server.structured import structured_from

MAX_STOP_CHARS = 1024  # per stop string; matching is linear anyway, this bounds the held-back text
MAX_LOGIT_BIAS = 1024  # entries
INT32 = 2**31 - 1
INT64 = 2**63 - 1


def _unicode(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"not valid Unicode: a lone surrogate at character {e.start}") from None
    return text


def _as_list(value):
    """`stop` may be one string or a list of them."""
    return [value] if isinstance(value, str) else value


def _number(lo: float, hi: float, *, above: bool = False):
    """A finite JSON number (an int is accepted where a float is asked) in [lo, hi], or (lo, hi]."""
    bound = {"gt": lo} if above else {"ge": lo}
    return Annotated[float, Field(strict=True, allow_inf_nan=False, le=hi, **bound)]


def _integer(lo: int, hi: int):
    return Annotated[int, Field(strict=True, ge=lo, le=hi)]


Text = Annotated[StrictStr, AfterValidator(_unicode)]
StopString = Annotated[StrictStr, Field(min_length=1, max_length=MAX_STOP_CHARS), AfterValidator(_unicode)]
TokenId = _integer(0, INT32)  # checked against the vocabulary when the request is queued


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: Text | None = None
    temperature: _number(0.0, 100.0) | None = None
    top_p: _number(0.0, 1.0, above=True) | None = None
    top_k: _integer(-1, INT32) | None = None  # vLLM's extension: 0 or -1 = off
    min_p: _number(0.0, 1.0) | None = None
    n: _integer(1, MAX_N) = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: Annotated[list[StopString], BeforeValidator(_as_list), Field(max_length=MAX_STOP_STRINGS)] | None = None
    seed: _integer(0, INT64) | None = None
    presence_penalty: _number(-2.0, 2.0) | None = None
    frequency_penalty: _number(-2.0, 2.0) | None = None
    repetition_penalty: _number(0.0, 10.0, above=True) | None = None
    logit_bias: Annotated[dict[StrictStr, _number(-100.0, 100.0)], Field(max_length=MAX_LOGIT_BIAS)] | None = None
    user: Text | None = None
    # memra's extra: false = decode this request plainly on a server started with --speculative (its tokens
    # and logprobs are the same either way, E4); true on a server without speculation is refused
    speculative: StrictBool | None = None
    prompt_logprobs: _integer(0, MAX_LOGPROBS) | None = None  # vLLM's: score the prompt (memra.server.scored)
    continuation_start: _integer(1, INT32) | None = None  # memra's: the first generated position of the prompt (E9)
    return_tokens_as_token_ids: StrictBool | None = None  # vLLM's: tokens as "token_id:<id>"
    # vLLM's sampling fields (memra.SamplingParams says what each does); null = the default
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_LOGIT_BIAS)] | None = None
    ignore_eos: StrictBool | None = None
    min_tokens: _integer(0, INT32) | None = None
    include_stop_str_in_output: StrictBool | None = None
    skip_special_tokens: StrictBool | None = None
    spaces_between_special_tokens: StrictBool | None = None
    truncate_prompt_tokens: _integer(-1, INT32) | None = None
    # structured output (memra.server.structured reads these into one StructuredOutputs)
    response_format: dict | None = None
    structured_outputs: dict | None = None
    guided_json: dict | Text | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None

    def check_scoring(self, echo_logprobs: bool) -> None:
        """The refusals of the scoring fields; echo_logprobs: the completions route's echo with logprobs."""
        if self.prompt_logprobs is not None and self.stream:
            raise MemraError("prompt_logprobs is not available with stream: true (as in vLLM); ask without stream")
        if self.continuation_start is not None and not echo_logprobs and self.prompt_logprobs is None:
            raise MemraError("continuation_start says where scoring switches to the decode arithmetic; it needs "
                             "prompt_logprobs (or, on /v1/completions, echo with logprobs)")

    def stops(self) -> tuple[str, ...]:
        return tuple(self.stop or ())

    def sampling(self, max_tokens: int, seed: int) -> SamplingParams:
        """SamplingParams (which validates ranges) from this body; MemraError names the bad field."""
        if max_tokens <= 0:
            raise MemraError(f"max_tokens must be at least 1, got {max_tokens}")
        bias = {}
        for key, value in (self.logit_bias or {}).items():
            if not (key.isdigit() and len(key) <= 10):
                raise MemraError(f"logit_bias keys must be token ids (integers as strings), got {key[:20]!r}")
            bias[int(key)] = float(value)
        top_k = self.top_k if self.top_k is not None else 0
        if top_k == -1:
            top_k = 0
        return SamplingParams(
            temperature=float(1.0 if self.temperature is None else self.temperature),
            top_k=top_k, top_p=float(1.0 if self.top_p is None else self.top_p),
            min_p=float(self.min_p or 0.0), seed=seed, max_tokens=max_tokens, stop=self.stops(),
            repetition_penalty=float(1.0 if self.repetition_penalty is None else self.repetition_penalty),
            presence_penalty=float(self.presence_penalty or 0.0), frequency_penalty=float(self.frequency_penalty or 0.0),
            logit_bias=bias, structured_outputs=structured_from(self), **self._vllm_fields())

    def _vllm_fields(self) -> dict:
        given = {"stop_token_ids": tuple(self.stop_token_ids or ()), "ignore_eos": self.ignore_eos,
                 "min_tokens": self.min_tokens, "include_stop_str_in_output": self.include_stop_str_in_output,
                 "skip_special_tokens": self.skip_special_tokens, "truncate_prompt_tokens": self.truncate_prompt_tokens,
                 "spaces_between_special_tokens": self.spaces_between_special_tokens}
        return {k: v for k, v in given.items() if v is not None}

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    prompt: Text | list[Text] | list[TokenId] | list[list[TokenId]]
    max_tokens: _integer(0, INT32) | None = 16  # OpenAI's default for completions
    logprobs: _integer(0, MAX_LOGPROBS) | None = None
    echo: StrictBool = False
    add_special_tokens: StrictBool = True  # vLLM's: BOS and kin before the prompt's text
    best_of: _integer(1, MAX_N) | None = None
    suffix: Text | None = None

    def check_supported(self) -> None:
        if self.echo and self.stream:
            raise MemraError("echo is not available with stream: true; ask without stream")
        self.check_scoring(self.echo and self.logprobs is not None)

    @property
    def scores(self) -> bool:
        """Whether the prompt must be scored: echo with logprobs, or prompt_logprobs."""
        return (self.echo and self.logprobs is not None) or self.prompt_logprobs is not None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise MemraError("prompt is empty")
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: Text


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: Text
    arguments: Text | dict[StrictStr, Any]  # OpenAI's: a JSON string (memra.tools.messages parses it)


class ToolCall(BaseModel):
    """A call in an assistant message of the history."""

    model_config = ConfigDict(extra="ignore")
    id: Text | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls
    tool_call_id: Text | None = None  # a tool message: the call it answers
    name: Text | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def for_template(self) -> dict:
        """The message as chat templates read it (content always a string, as vLLM gives it)."""
        m: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            m["tool_calls"] = [c.model_dump(exclude_none=True) for c in self.tool_calls]
        for key in ("tool_call_id", "name"):
            if getattr(self, key) is not None:
                m[key] = getattr(self, key)
        return m


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: _integer(0, INT32) | None = None
    max_completion_tokens: _integer(0, INT32) | None = None
    logprobs: StrictBool = False
    top_logprobs: _integer(0, MAX_LOGPROBS) | None = None
    add_special_tokens: StrictBool = False  # vLLM's: BOS and kin on top of what the chat template writes
    chat_template_kwargs: dict[StrictStr, Any] | None = None  # vLLM's: variables for the chat template
    include_reasoning: StrictBool | None = None  # vLLM's: false drops reasoning_content (--reasoning-parser)
    # tool calling (memra.server.tools checks them: a 400 names the field)
    tools: list[Any] | None = None
    tool_choice: Text | dict[StrictStr, Any] | None = None
    parallel_tool_calls: StrictBool | None = None

    def check_supported(self) -> None:
        if self.top_logprobs is not None and not self.logprobs:
            raise MemraError("top_logprobs needs logprobs: true")
        fixed = {"messages", "add_generation_prompt"} & set(self.chat_template_kwargs or ())
        if fixed:
            raise MemraError(f"chat_template_kwargs may not set {sorted(fixed)[0]}: the server sets it")
        self.check_scoring(False)


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool = True
    chat_template_kwargs: dict[StrictStr, Any] | None = None  # with messages: the chat route's
    tools: list[Any] | None = None  # with messages: shown to the chat template, as on the chat route


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: Text | None = None
    tokens: list[TokenId]


AnyRequest = Union[CompletionRequest, ChatRequest, TokenizeRequest, DetokenizeRequest]


def sampling_defaults(pairs: tuple[tuple[str, object], ...]) -> dict:
    """--generation-config's defaults, checked as a request's fields would be (MemraError naming the bad
    one), per request schema: {schema: ((field, value), ...)}. max_tokens is a default of the chat route
    only: a completion's is OpenAI's 16."""
    if not pairs:
        return {}
    try:
        ChatRequest.model_validate({"messages": [{"role": "user", "content": ""}], **dict(pairs)})
    except ValueError as e:
        raise MemraError(f"--generation-config gives a sampling default memra cannot take ({str(e).splitlines()[-1]})")
    return {ChatRequest: pairs, CompletionRequest: tuple((k, v) for k, v in pairs if k != "max_tokens")}
