"""What the serving engine takes and gives: its configuration, the events it sends each sequence's
reader, and the refusal it raises when it cannot take requests. Apart from the engine so that its
backends (memra.engine.backends) can size themselves from the configuration without importing it."""

from __future__ import annotations

from dataclasses import dataclass

from memra.cache import BLOCK_SIZE
from memra.engine.admission import PrefillGrouping
from memra.errors import ContextOverflowError, MemraError
from memra.sampling import SamplingParams
from memra.spec import SpecConfig
from memra.step import EXACT_PIECE

WIDE_BATCH = 256  # from here the default budget is split (EngineConfig.split_budget)


class Unavailable(MemraError):
    """The engine takes no requests now: shutting down, stopped after an error, or a pipeline rank is
    gone (HTTP 503). The message says which, and what brings the server back."""


@dataclass(frozen=True)
class EngineConfig:
    max_batch: int = 32  # sequences running at once
    max_ctx: int = 4096  # prompt + generated tokens of one sequence
    token_budget: int = 2048  # tokens per engine step (decode rows + prefill chunk tokens)
    max_waiting: int = 256  # queued requests beyond which submit() raises QueueFull (HTTP 429)
    kv_blocks: int | None = None  # shared KV pool size; default: max_batch sequences of max_ctx (in-process only)
    # Requests held while others decode so that several start in one prefill (memra.engine.admission):
    # most steps one is held (0: none). Default: 0 where the mixed step is a captured graph (a step that
    # starts a request then costs about a decode step: nothing to save by holding), else 8 (measured:
    # the module docstring there)
    prefill_wait_steps: int | None = None
    prefill_group: int | None = None  # how many end the hold at once; default max(2, max_batch // 8)
    speculative: SpecConfig | None = None  # draft-and-verify decoding (memra.engine.speculation); None: off
    prefix_caching: bool = True  # reuse primed prompt pages across requests (memra.prefix; promise E8)
    prefix_snapshots: int | None = None  # recurrent snapshots kept (hybrids); default memra.prefix.policy's
    # Prompt tokens a step may take apart from its decode rows (memra.engine.scheduler's split budget), so a wide
    # batch still prefills; 0: decode rows and prompt tokens share token_budget. None (the default): split_budget
    prefill_budget: int | None = None
    # Every request of a run comes at once (memra.LLM), not as a server's stream: MEMRA_ADMISSION_ORDER=auto then
    # starts the longest outputs first (memra.engine.admission)
    offline: bool = False

    def __post_init__(self) -> None:
        for name in ("max_batch", "max_ctx", "token_budget", "max_waiting"):
            if getattr(self, name) <= 0:
                raise MemraError(f"engine {name} must be positive, got {getattr(self, name)}")
        _ = self.grouping(False)  # PrefillGrouping refuses bad hold settings: one check, one message for every caller
        if self.token_budget < EXACT_PIECE:
            raise MemraError(f"token_budget must be at least {EXACT_PIECE} (one aligned prefill piece)")
        if self.prefill_budget not in (None, 0) and (type(self.prefill_budget) is not int or self.prefill_budget < EXACT_PIECE):
            raise MemraError(f"prefill_budget must be an integer of at least {EXACT_PIECE} (one aligned prefill piece), "
                             f"0 (shared with the decode rows) or None (the default), got {self.prefill_budget!r}")

    def grouping(self, mixed_graphed: bool) -> PrefillGrouping:
        """The hold rule, for an engine whose mixed steps are (or are not) captured graphs."""
        group = self.prefill_group if self.prefill_group is not None else max(2, self.max_batch // 8)
        wait = self.prefill_wait_steps
        return PrefillGrouping((0 if mixed_graphed else 8) if wait is None else wait, group)

    def longest_first(self, order: str) -> bool:
        """Whether this engine's waiting queue is longest output first under MEMRA_ADMISSION_ORDER=order: lof, or
        auto in an engine that takes a whole run at once (memra.engine.admission)."""
        return order == "lof" or (order == "auto" and self.offline)

    def split_budget(self, mixed_tokens: int) -> int | None:
        """The scheduler's prompt tokens a step apart from its decode rows (None: shared); mixed_tokens: the
        largest prompt bucket a captured mixed step takes (Settings.mixed_tokens), 0 where none is captured.
        Default: for a wide batch (max_batch >= WIDE_BATCH) whose mixed steps are captured graphs, that
        bucket (512 unless MEMRA_MIXED_TOKENS raises it), so that a step with many decode rows still prefills
        and stays one replayed forward; on an H100, 8.4-8.9k output tok/s against 7.7k shared at max_batch 768
        (Llama-3-8B shape), 5.66k against 5.38k at 256 (Qwen3.5-9B; docs/PERFORMANCE.md). Elsewhere shared: an
        eager step has no bucket to fit, and a narrow batch leaves the shared budget room for prompts (not
        measured faster split)."""
        if self.prefill_budget is None:
            return mixed_tokens if mixed_tokens and self.max_batch >= WIDE_BATCH else None
        return self.prefill_budget or None

    @property
    def blocks(self) -> int:
        return self.kv_blocks or self.max_batch * -(-self.max_ctx // BLOCK_SIZE)


@dataclass(frozen=True)
class TokenEvent:
    """One step of a sequence's output, in order: a new token, or (token_id None) its end.

    How a sequence ends: EOS or max_tokens (the last event's finish_reason "stop" / "length"); cancel
    (its reader went away or saw a stop string: "abort", or the reason given); or an abort carrying an
    error, whose `error_kind` tells the reader what to answer:
        "shutdown"  the server is shutting down and its drain deadline passed (HTTP 503)
        "refused"   the request cannot run here, e.g. it can never fit the KV pool (HTTP 400)
        "engine"    the engine failed; the message is ours (a pipeline rank gone, ...), never a Python
                    internal, which goes to the server log instead (HTTP 500)
    """

    index: int  # which choice of the request (n > 1)
    token_id: int | None
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    finish_reason: str | None = None  # "stop" | "length" | "abort" (or cancel's reason) on the last event
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None  # why an aborted sequence ended, in words a client may read
    error_kind: str | None = None  # "shutdown" | "refused" | "engine" (module docstring)
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (memra.prefix)
    rank: int | None = None  # the token's rank in the row it was drawn from (1 = the likeliest), with logprob
    weights_version: int = 0  # the weights the token came from (memra.weights: +1 per update; a request has one)


def public_error(err: BaseException) -> str:
    """What a client may read about an engine failure: our own errors say what happened in their own
    words; anything else is a bug whose details belong in the server log, not in a response body."""
    if isinstance(err, MemraError):
        return str(err)
    return "an internal error; the server log has the details"


def refuse_request(prompt: list[int], params: SamplingParams, limit: int, vocab: int) -> None:
    """Raise what a request is refused for before it is queued: empty, over `limit` tokens (prompt +
    max_tokens), ids or logit_bias outside the vocabulary. The length is checked first: it is O(1), and
    a prompt over the context needs no look at its ids."""
    if not prompt:
        raise MemraError("the prompt is empty")
    if params.max_tokens is None:  # memra.LLM turns None into the rest of the context before it submits
        raise MemraError("max_tokens must be a number here; None (up to the context's end) is memra.LLM's")
    if len(prompt) + params.max_tokens > limit:
        raise ContextOverflowError(
            f"this model's maximum context length is {limit} tokens; the request needs {len(prompt)} prompt "
            f"+ {params.max_tokens} completion tokens = {len(prompt) + params.max_tokens}; shorten the prompt "
            f"or lower max_tokens")
    if not 0 <= min(prompt) <= max(prompt) < vocab:
        bad = next(t for t in prompt if not 0 <= t < vocab)
        raise MemraError(f"prompt token id {bad} is outside the vocabulary (0..{vocab - 1})")
    for tok in params.stop_token_ids:
        if tok >= vocab:
            raise MemraError(f"stop_token_ids names token {tok}, outside the vocabulary (0..{vocab - 1})")
    for tok, _ in params.logit_bias:
        if tok >= vocab:
            raise MemraError(f"logit_bias names token {tok}, outside the vocabulary (0..{vocab - 1})")
