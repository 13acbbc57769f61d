"""Seeded sampling whose random stream depends only on (seed, step counter, token id).

The noise for token v at step `ctr` is Gumbel(u) with u = hash(seed, ctr, v) — an integer hash
(splitmix64), never the global torch RNG and never a batch index, so a sequence's sampled tokens
cannot depend on what else runs beside it (promise E3). Sampling is then argmax(logits / T + noise)
over the tokens that survive top-k / top-p / min-p, which draws from softmax(logits / T) restricted
to those tokens (the Gumbel-max trick).
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field

import torch

from memra import counters
from memra.errors import MemraError
from memra.sampling_vllm import refuse_unsupported
from memra.structured.params import StructuredOutputs

_MASK64 = (1 << 64) - 1


def _to_signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 lanes viewed as uint64 (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """The splitmix64 finalizer on int64 lanes (wrapping arithmetic = uint64 arithmetic mod 2^64)."""
    x = x + _to_signed(0x9E3779B97F4A7C15)
    x = (x ^ _shr(x, 30)) * _to_signed(0xBF58476D1CE4E5B9)
    x = (x ^ _shr(x, 27)) * _to_signed(0x94D049BB133111EB)
    return x ^ _shr(x, 31)


def uniform_noise(seed: int, ctr: int, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """u in (0, 1), fp64, for token ids 0..n-1 — a pure function of (seed, ctr, id)."""
    key = splitmix64(torch.tensor([_to_signed((seed & _MASK64) ^ ((ctr * 0xD1B54A32D192ED03) & _MASK64))], dtype=torch.int64))
    bits = splitmix64(torch.arange(n, dtype=torch.int64, device=device) ^ key.to(device))
    top53 = _shr(bits, 11).double()  # 53 random bits -> a double in [0, 1)
    return (top53 + 0.5) * (1.0 / (1 << 53))


MAX_STOP_STRINGS = 16
MAX_N = 16  # choices per prompt
MAX_LOGPROBS = 20  # top logprobs per token


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """What a user asks for, with vLLM's names and defaults (temperature 1.0, max_tokens 16, seed None);
    temperature 0 means greedy (argmax). docs/VLLM.md lists every vLLM field and what memra does with it.

    Penalties follow vLLM/OpenAI: repetition_penalty divides positive (multiplies negative) logits of
    every token seen in the prompt or output; presence_penalty subtracts once per token present in the
    output, frequency_penalty once per occurrence; logit_bias adds a bias in [-100, 100] per token id.
    """

    temperature: float = 1.0
    top_k: int = 0  # 0 (or vLLM's -1) = off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None  # None: drawn when the request is submitted (memra.LLM: from its seed stream)
    max_tokens: int | None = 16  # None: up to the context's end (memra.LLM fills it in per prompt)
    stop: tuple[str, ...] = field(default_factory=tuple)
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)  # ((token id, bias), ...)
    n: int = 1  # choices per prompt; choice i samples with seed + i
    logprobs: int | None = None  # the chosen token's logprob and this many top ones (0: the chosen only)
    ignore_eos: bool = False  # run to max_tokens through end-of-sequence tokens (vLLM's name; benchmarks)
    prompt_logprobs: int | None = None  # score the prompt too (memra.LLM.generate): each token's logprob + top n
    # vLLM's: more ids that end the sequence (they stop it even with ignore_eos; its token_ids keep the id)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # vLLM's: EOS and stop_token_ids are masked (logit -inf) until this many tokens came out, and stop strings
    # count only in text after them; the mask reads only the row's own output count, so a row's tokens stay
    # the same whatever runs beside it (E1, E3)
    min_tokens: int = 0
    include_stop_str_in_output: bool = False  # the stop string (or the stop token's text) ends the text
    skip_special_tokens: bool = True  # the text leaves control tokens (<|im_end|>, ...) out
    spaces_between_special_tokens: bool = True  # with skip_special_tokens=False: " " around their text (HF's)
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens (-1: the context's length)
    structured_outputs: StructuredOutputs | None = None  # hold the output to a schema / regex / choice / grammar
    detokenize: bool = True  # vLLM's: False leaves the outputs' text empty (token ids only)
    # vLLM's fields memra does not implement: refused where given anything but their no-op value
    # (memra.sampling_vllm says why and what to use instead)
    best_of: int | None = field(default=None, repr=False)
    use_beam_search: bool = field(default=False, repr=False)
    length_penalty: float = field(default=1.0, repr=False)
    early_stopping: bool | str = field(default=False, repr=False)
    bad_words: list[str] | None = field(default=None, repr=False)
    allowed_token_ids: list[int] | None = field(default=None, repr=False)
    logits_processors: list | None = field(default=None, repr=False)
    guided_decoding: object | None = field(default=None, repr=False)
    extra_args: dict | None = field(default=None, repr=False)
    flat_logprobs: bool = field(default=False, repr=False)
    logprob_token_ids: list[int] | None = field(default=None, repr=False)
    thinking_token_budget: int | None = field(default=None, repr=False)
    # vLLM's, accepted with no effect on what memra.LLM returns (docs/VLLM.md): generate returns whole outputs
    # (output_kind, stream_interval), and the prefix cache never changes a token (E8: skip_reading_prefix_cache)
    output_kind: object | None = field(default=None, repr=False, compare=False)
    stream_interval: int | None = field(default=None, repr=False, compare=False)
    skip_reading_prefix_cache: bool | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        refuse_unsupported(self)
        if self.top_k == -1:  # vLLM's spelling of "off"
            object.__setattr__(self, "top_k", 0)
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is None or isinstance(self.stop, list):
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        if self.stop_token_ids is None:
            object.__setattr__(self, "stop_token_ids", ())
        if self.logit_bias is None:
            object.__setattr__(self, "logit_bias", ())
        if not isinstance(self.stop_token_ids, tuple):
            try:
                object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
            except TypeError:
                raise MemraError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}") from None
        if isinstance(self.structured_outputs, dict):
            try:
                object.__setattr__(self, "structured_outputs", StructuredOutputs(**self.structured_outputs))
            except TypeError as e:
                raise MemraError(f"structured_outputs: {e}") from None
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputs):
            raise MemraError("structured_outputs must be a memra.StructuredOutputs (or a dict of its fields)")
        if isinstance(self.logit_bias, dict):
            try:
                object.__setattr__(self, "logit_bias", tuple(sorted((int(k), float(v)) for k, v in self.logit_bias.items())))
            except (TypeError, ValueError):
                raise MemraError("logit_bias must map integer token ids to numbers") from None
        self._validate()

    def _validate(self) -> None:
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature) and self.temperature >= 0):
            raise MemraError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise MemraError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise MemraError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise MemraError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.max_tokens is not None and (type(self.max_tokens) is not int or self.max_tokens <= 0):
            raise MemraError(f"max_tokens must be a positive integer (or None: up to the context's end), "
                             f"got {self.max_tokens!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise MemraError(f"seed must be a non-negative integer or None (a fresh random one), got {self.seed!r}")
        stops = tuple(self.stop)
        if len(stops) > MAX_STOP_STRINGS or not all(isinstance(x, str) and x for x in stops):
            raise MemraError(f"stop must be at most {MAX_STOP_STRINGS} non-empty strings, got {self.stop!r}")
        if not (isinstance(self.repetition_penalty, (int, float)) and 0 < self.repetition_penalty <= 10):
            raise MemraError(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and -2.0 <= v <= 2.0):
                raise MemraError(f"{name} must be in [-2, 2], got {v!r}")
        if not isinstance(self.n, int) or not 1 <= self.n <= MAX_N:
            raise MemraError(f"n must be an integer in 1..{MAX_N}, got {self.n!r}")
        if not isinstance(self.ignore_eos, bool):
            raise MemraError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        if self.logprobs is not None and not (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS):
            raise MemraError(f"logprobs must be None or an integer in 0..{MAX_LOGPROBS}, got {self.logprobs!r}")
        if self.prompt_logprobs is not None and not (type(self.prompt_logprobs) is int
                                                     and 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise MemraError(f"prompt_logprobs must be None or an integer in 0..{MAX_LOGPROBS}, got {self.prompt_logprobs!r}")
        self._validate_vllm_fields()
        for tok, bias in self.logit_bias:
            if tok < 0 or not -100.0 <= bias <= 100.0 or not math.isfinite(bias):
                raise MemraError(f"logit_bias entry {tok}: {bias} invalid; ids must be >= 0 and biases in [-100, 100]")

    def _validate_vllm_fields(self) -> None:
        if not all(type(t) is int and t >= 0 for t in self.stop_token_ids):
            raise MemraError(f"stop_token_ids must be non-negative token ids, got {list(self.stop_token_ids)!r}")
        top = self.max_tokens if self.max_tokens is not None else float("inf")
        if type(self.min_tokens) is not int or not 0 <= self.min_tokens <= top:
            raise MemraError(f"min_tokens must be an integer in 0..max_tokens ({self.max_tokens}), got {self.min_tokens!r}")
        for name in ("include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                raise MemraError(f"{name} must be true or false, got {getattr(self, name)!r}")
        k = self.truncate_prompt_tokens
        if k is not None and not (type(k) is int and (k >= 1 or k == -1)):
            raise MemraError(f"truncate_prompt_tokens must be an integer >= 1, or -1 (the context's length), got {k!r}")
        if not self.detokenize and self.stop:
            raise MemraError("stop strings need the text: they cannot be used with detokenize=False (as in vLLM)")

    @property
    def penalized(self) -> bool:
        """Whether a row's logits are changed before sampling (penalties, logit_bias, the min_tokens mask)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or bool(self.logit_bias) or self.min_tokens > 0)

    def stop_ids(self, eos_ids) -> frozenset[int]:
        """The ids that end this request's sequences: the model's EOS (unless ignore_eos) and stop_token_ids."""
        return frozenset(() if self.ignore_eos else eos_ids) | frozenset(self.stop_token_ids)

    def truncate(self, ids: list[int], max_len: int) -> list[int]:
        """The prompt's last truncate_prompt_tokens ids (-1: max_len), or all of them."""
        return truncate_prompt(ids, self.truncate_prompt_tokens, max_len)

    def dev_samp(self, ctr: int) -> "DevSamp":
        return DevSamp(self.temperature, self.seed, ctr, self.top_k, self.top_p, self.min_p)
    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class DevSamp:
    """Per-row device sampling spec: everything the device needs to choose this row's token."""

    temperature: float
    seed: int
    ctr: int  # the sequence's step counter: noise = f(seed, ctr, token id)
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0


def truncate_prompt(ids: list[int], k: int | None, max_len: int) -> list[int]:
    """vLLM's truncate_prompt_tokens: the last k ids (-1: max_len; None: all), cut from the left."""
    if k is not None and k != -1 and k < 1:
        raise MemraError(f"truncate_prompt_tokens must be an integer >= 1, or -1 (the context's length), got {k!r}")
    k = max_len if k == -1 else k
    return ids if k is None or len(ids) <= k else ids[len(ids) - k :]


def apply_penalties(logits: torch.Tensor, p: SamplingParams, prompt_ids, output_ids, stop_ids=()) -> torch.Tensor:
    """Logits [V] adjusted for repetition/presence/frequency penalties and logit_bias (a new tensor), and
    `stop_ids` (the ids that would end the sequence) set to -inf while fewer than min_tokens came out."""
    if not p.penalized:
        return logits
    out = logits.clone()
    v = out.shape[-1]
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.long, device=out.device)
        if seen.numel():
            vals = out[seen]
            out[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if output_ids and (p.presence_penalty or p.frequency_penalty):
        counts = torch.bincount(torch.tensor(output_ids, dtype=torch.long), minlength=v).to(out.device, out.dtype)
        out -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(out.dtype)
    for tok, bias in p.logit_bias:
        if tok >= v:
            raise MemraError(f"logit_bias names token {tok}, outside the vocabulary (0..{v - 1})")
        out[tok] += bias
    if len(output_ids) < p.min_tokens and stop_ids:
        out[torch.tensor(sorted(stop_ids), dtype=torch.long, device=out.device)] = float("-inf")
        counters.bump("min_tokens_masked_rows")
    return out


def allowed_tokens(logits: torch.Tensor, p: SamplingParams | DevSamp) -> torch.Tensor:
    """Boolean mask [V] of the tokens top-k, top-p and min-p keep (the most likely token always survives)."""
    if not p.top_k and p.top_p >= 1.0 and p.min_p <= 0.0:
        return torch.ones_like(logits, dtype=torch.bool)  # no filter: skip the vocab-wide sort
    scaled = logits.double() / p.temperature
    probs = torch.softmax(scaled, dim=-1)
    order = torch.argsort(probs, descending=True, stable=True)
    ranked = probs[order]
    # Decided by rank, then scattered back to token order: in-place ops only, since a `t[index] = v`
    # (index_put_) or a boolean mask waits for the device, and the engine calls this on its step.
    keep_ranked = torch.ones_like(ranked, dtype=torch.bool)
    if p.top_k:
        keep_ranked[p.top_k:].fill_(False)
    if p.top_p < 1.0:
        before = torch.cumsum(ranked, 0) - ranked  # mass of strictly more likely tokens
        keep_ranked &= ~(before >= p.top_p)
    if p.min_p > 0.0:
        keep_ranked &= ranked >= p.min_p * ranked[0]
    keep_ranked[0].fill_(True)
    return torch.empty_like(keep_ranked).scatter_(0, order, keep_ranked)


def device_sample(logits: torch.Tensor, s: DevSamp) -> torch.Tensor:
    """Choose a token from one row of logits [V] where they live. -> 0-d int64 tensor on that device.

    Greedy (temperature 0) is argmax; otherwise argmax(logits / T + Gumbel(u(seed, ctr, id))) over the
    tokens top-k / top-p / min-p allow. Computed per row, so batchmates cannot change it.
    """
    if s.temperature == 0.0:
        return torch.argmax(logits)
    u = uniform_noise(s.seed, s.ctr, logits.shape[-1], logits.device)
    score = logits.double() / s.temperature - torch.log(-torch.log(u))
    return torch.argmax(score.masked_fill(~allowed_tokens(logits, s), float("-inf")))


def sample(logits: torch.Tensor, p: SamplingParams, ctr: int) -> int:
    """Pick the next token from logits [V] (fp32) at step counter `ctr` (the same choice device_sample makes)."""
    return int(device_sample(logits, p.dev_samp(ctr)))


def fresh_seed() -> int:
    """A seed for a request that gave none (OpenAI: unseeded sampling is not reproducible)."""
    return secrets.randbits(62)
