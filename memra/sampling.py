"""Seeded sampling whose random stream depends only on (seed, step counter, token id).

The noise for token v at step `ctr` is Gumbel(u) with u = hash(seed, ctr, v) — an integer hash
(splitmix64), never the global torch RNG and never a batch index, so a sequence's sampled tokens
cannot depend on what else runs beside it (promise E3). Sampling is then argmax(logits / T + noise)
over the tokens that survive top-k / top-p / min-p, which draws from softmax(logits / T) restricted
to those tokens (the Gumbel-max trick).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from memra.errors import MemraError

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


@dataclass(frozen=True)
class SamplingParams:
    """What a user asks for. temperature 0 means greedy (argmax)."""

    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    max_tokens: int = 128
    stop: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature) and self.temperature >= 0):
            raise MemraError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise MemraError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise MemraError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise MemraError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise MemraError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise MemraError(f"seed must be a non-negative integer, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def allowed_tokens(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Boolean mask [V] of the tokens top-k, top-p and min-p keep (the most likely token always survives)."""
    scaled = logits.double() / p.temperature
    probs = torch.softmax(scaled, dim=-1)
    keep = torch.ones_like(probs, dtype=torch.bool)
    order = torch.argsort(probs, descending=True, stable=True)
    ranked = probs[order]
    if p.top_k:
        keep[order[p.top_k:]] = False
    if p.top_p < 1.0:
        before = torch.cumsum(ranked, 0) - ranked  # mass of strictly more likely tokens
        keep[order[before >= p.top_p]] = False
    if p.min_p > 0.0:
        keep &= probs >= p.min_p * ranked[0]
    keep[order[0]] = True
    return keep


def sample(logits: torch.Tensor, p: SamplingParams, ctr: int) -> int:
    """Pick the next token from logits [V] (fp32) at step counter `ctr`."""
    if p.greedy:
        return int(torch.argmax(logits))
    u = uniform_noise(p.seed, ctr, logits.shape[-1], logits.device)
    gumbel = -torch.log(-torch.log(u))
    score = logits.double() / p.temperature + gumbel
    score = score.masked_fill(~allowed_tokens(logits, p), float("-inf"))
    return int(torch.argmax(score))
