"""The OpenAI request bodies, validated: a wrong type, a value out of range or an unsupported option
is an HTTP 400 with an OpenAI-style error body, never a stack trace. Unknown extra fields are ignored
(clients send vendor extras), known fields are type-checked strictly (no "0.5" for a number)."""

from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from memra.errors import MemraError
from memra.sampling import MAX_STOP_STRINGS, SamplingParams

Number = Union[StrictInt, StrictFloat]
MAX_N = 16
MAX_LOGPROBS = 20


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: StrictInt | None = None  # vLLM's extension: 0 or -1 = off
    min_p: Number | None = None
    n: StrictInt = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    repetition_penalty: Number | None = None
    logit_bias: dict[StrictStr, Number] | None = None
    user: StrictStr | None = None

    def sampling(self, max_tokens: int, seed: int) -> SamplingParams:
        """SamplingParams (which validates ranges) from this body; MemraError names the bad field."""
        if not 1 <= self.n <= MAX_N:
            raise MemraError(f"n must be in 1..{MAX_N}, got {self.n}")
        if max_tokens <= 0:
            raise MemraError(f"max_tokens must be at least 1, got {max_tokens}")
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if len(stops) > MAX_STOP_STRINGS or any(s == "" for s in stops):
            raise MemraError(f"stop must be a string or a list of at most {MAX_STOP_STRINGS} non-empty strings")
        bias = {}
        for key, value in (self.logit_bias or {}).items():
            try:
                bias[int(key)] = float(value)
            except ValueError:
                raise MemraError(f"logit_bias keys must be token ids (integers as strings), got {key!r}") from None
        top_k = self.top_k if self.top_k is not None else 0
        if top_k == -1:
            top_k = 0
        return SamplingParams(
            temperature=float(1.0 if self.temperature is None else self.temperature),
            top_k=top_k, top_p=float(1.0 if self.top_p is None else self.top_p),
            min_p=float(self.min_p or 0.0), seed=seed, max_tokens=max_tokens, stop=stops,
            repetition_penalty=float(1.0 if self.repetition_penalty is None else self.repetition_penalty),
            presence_penalty=float(self.presence_penalty or 0.0), frequency_penalty=float(self.frequency_penalty or 0.0),
            logit_bias=bias)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: StrictInt | None = 16  # OpenAI's default for completions
    logprobs: StrictInt | None = None
    echo: StrictBool = False
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None

    def check_supported(self) -> None:
        if self.echo:
            raise MemraError("echo is not supported")
        if self.suffix:
            raise MemraError("suffix is not supported")
        if self.best_of not in (None, 1, self.n):
            raise MemraError("best_of other than n is not supported")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise MemraError(f"logprobs must be in 0..{MAX_LOGPROBS}, got {self.logprobs}")

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
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None

    def check_supported(self) -> None:
        if self.top_logprobs is not None:
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise MemraError(f"top_logprobs must be in 0..{MAX_LOGPROBS}, got {self.top_logprobs}")
            if not self.logprobs:
                raise MemraError("top_logprobs needs logprobs: true")


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: StrictStr | None = None
    tokens: list[StrictInt]
