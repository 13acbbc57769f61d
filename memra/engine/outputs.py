"""What memra.LLM returns: vLLM's output objects, with vLLM's fields and types (so a script written
against vllm.outputs reads them unchanged), plus memra's own extras as additional fields.

    RequestOutput          one per prompt: request_id, prompt, prompt_token_ids, prompt_logprobs,
                           outputs, finished, metrics, num_cached_tokens
      CompletionOutput     one per choice: index, text, token_ids, cumulative_logprob, logprobs,
                           finish_reason, stop_reason (+ memra's seed, top_logprobs, token_logprobs)
        Logprob            logprob, rank, decoded_token: one entry of a position's {token id: Logprob}
"""

from __future__ import annotations

from dataclasses import dataclass, field

from memra.tokenizer import TextStream

@dataclass(frozen=True)
class Logprob:
    """A token's log-probability in the row it came from (log_softmax of the raw fp32 logits, before
    temperature, penalties and filters: vLLM's default), its rank there (1 = the likeliest) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(frozen=True)
class RequestMetrics:
    """When a request's milestones happened, in time.time() seconds under vLLM's names: generate queued
    it, its first and last token came, it finished (memra does not report its scheduler's internals)."""

    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass(frozen=True)
class CompletionOutput:
    index: int  # which of the prompt's n choices
    text: str  # "" with detokenize=False
    token_ids: list[int]
    cumulative_logprob: float | None  # the sum of the chosen tokens' logprobs, where logprobs were asked
    logprobs: list[dict[int, Logprob]] | None  # per position {token id: Logprob}: the chosen token and the top n
    finish_reason: str | None  # "stop" (EOS, a stop token or a stop string) | "length" (max_tokens)
    stop_reason: int | str | None = None  # the stop string or stop_token_ids id that ended it; None for EOS
    lora_request: None = None  # vLLM's; memra serves no adapters
    # memra's extras
    seed: int | None = None  # the sampling seed this choice used (choice i: the request's seed + i)
    top_logprobs: list[dict[int, float]] | None = field(default=None, repr=False)  # the top n of each position

    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def token_logprobs(self) -> list[float] | None:
        """Each chosen token's logprob, as a plain list (memra's shape before vLLM's dicts)."""
        if self.logprobs is None:
            return None
        return [pos[t].logprob for pos, t in zip(self.logprobs, self.token_ids)]


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt: str | None  # the text, when the prompt was given as text
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, Logprob] | None] | None  # SamplingParams.prompt_logprobs: None first, then {token id: Logprob}
    outputs: list[CompletionOutput]
    finished: bool = True
    metrics: RequestMetrics | None = None
    lora_request: None = None  # vLLM's; memra serves no adapters
    num_cached_tokens: int | None = None  # prompt tokens the prefix cache served (memra.prefix)
    weights_version: int = 0  # which weights answered: 0 as loaded, +1 per update_weights (memra.weights)


@dataclass(frozen=True)
class ScoreOutput:
    """LLM.score's answer for one (prompt, continuation): each continuation token's logprob, bit for bit
    the one it got when it was sampled after this prompt (promise E9)."""

    prompt_token_ids: list[int]
    token_ids: list[int]  # the continuation's
    logprobs: list[float]
    top_logprobs: list[dict[int, float]] | None = None  # where top_logprobs > 0


@dataclass
class Choice:
    """One choice while it runs (memra.LLM's sink fills it from the engine's events)."""

    text: TextStream
    pieces: list[str] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[tuple[float, int | None, tuple[tuple[int, float], ...]]] = field(default_factory=list)
    finish: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    cached: int = 0  # prompt tokens the prefix cache served
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


class OutputBuilder:
    """Builds vLLM's output objects from finished choices: the logprob dicts' decoded tokens (None with
    detokenize=False, as vLLM), the cumulative logprob, the request's metrics."""

    def __init__(self, tokenizer):
        self.tok = tokenizer

    def _entry(self, token: int, lp: float, rank: int | None, detok: bool) -> Logprob:
        return Logprob(lp, rank, self.tok.decode([token]) if detok else None)

    def position(self, token: int, lp: float, rank: int | None, top, detok: bool) -> dict[int, Logprob]:
        """{token id: Logprob}: the chosen (or prompt) token, then the top n in rank order."""
        out = {token: self._entry(token, lp, rank, detok)}
        for r, (t, v) in enumerate(top, 1):
            if t not in out:
                out[t] = self._entry(t, v, r, detok)
        return out

    def completion(self, index: int, c: Choice, seed: int | None, detok: bool) -> CompletionOutput:
        asked = bool(c.logprobs)
        lps = [self.position(t, lp, rank, top, detok) for t, (lp, rank, top) in zip(c.tokens, c.logprobs)]
        cumulative = None
        if asked:
            cumulative = 0.0
            for lp, _, _ in c.logprobs:  # in order, as vLLM adds them up
                cumulative += lp
        return CompletionOutput(index, "".join(c.pieces) if detok else "", c.tokens, cumulative,
                                lps if asked else None, c.finish or "length", c.stop_reason, seed=seed,
                                top_logprobs=[dict(top) for _, _, top in c.logprobs] if asked else None)

    def prompt_logprobs(self, ids: list[int], scores, detok: bool) -> list[dict[int, Logprob] | None]:
        return [None if s is None else self.position(ids[k], s.logprob, s.rank, s.top, detok)
                for k, s in enumerate(scores)]

    @staticmethod
    def metrics(arrival: float, choices: list[Choice]) -> RequestMetrics:
        def pick(f, name):
            got = [getattr(c, name) for c in choices if getattr(c, name) is not None]
            return f(got) if got else None

        return RequestMetrics(arrival, pick(min, "first_token_time"), pick(max, "last_token_time"),
                              pick(max, "finished_time"))
