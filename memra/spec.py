"""Speculative decoding that emits exactly the tokens plain decoding emits (promise E4).

A round: the drafter proposes up to K tokens after the last emitted token x; the model verifies
[x, d1..dK] in one forward (`decode_step_t`), whose column j holds the very logits decode_step would
return after feeding x, d1..dj — bit for bit, not "close". The accept walk then chooses column j's
token exactly as plain decoding would (same penalties, same step counter, same noise) and keeps
draft d(j+1) only if it equals that choice. The emitted stream is therefore plain decoding's, token
for token, at every K and with every drafter; a drafter only decides how many tokens a verify yields.

Sampled requests: plain sampling draws argmax(logits / T + Gumbel(u(seed, ctr, id))) — a pure
function of the logits once (seed, ctr) is fixed (memra.sampling). The accept walk makes the same
draw, so "keep the draft iff it equals the target's draw" is rejection sampling with the noise
shared between drafter and target: the output is the target's own sample (so a seeded stream is
identical with and without speculation), and a drafter that draws with the same noise is accepted
whenever its distribution leads to the same token.

Rejected suffixes are dropped by rollback: KV by truncation (the position moves back; the rows are
overwritten later) and GDN state from the verify's per-column trail (`StateTrail`), or — the
alternative kept for measurement — by restoring a snapshot taken before the verify and replaying
the kept tokens (SpecConfig.rollback = "replay").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from memra import counters
from memra.cache import Cache
from memra.errors import MemraError
from memra.sampling import SamplingParams, device_sample
from memra.state_trail import StateTrail

METHODS = ("mtp", "ngram")
ROLLBACKS = ("trail", "replay")
MAX_DRAFT_K = 32


@dataclass(frozen=True)
class SpecConfig:
    """How to speculate. k: draft tokens per verify (T = k+1). dynamic_k: shrink/grow k between 1
    and `k` by an EMA of accepted drafts per round. ngram_*: the suffix lengths prompt lookup tries
    (longest first)."""

    method: str = "mtp"
    k: int = 4
    dynamic_k: bool = False
    ngram_max: int = 4
    ngram_min: int = 1
    rollback: str = "trail"

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise MemraError(f"speculative method {self.method!r} is not one of {', '.join(METHODS)}")
        if not isinstance(self.k, int) or not 1 <= self.k <= MAX_DRAFT_K:
            raise MemraError(f"draft k must be an integer in 1..{MAX_DRAFT_K}, got {self.k!r}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise MemraError(f"n-gram lengths need 1 <= ngram_min <= ngram_max, got {self.ngram_min}..{self.ngram_max}")
        if self.rollback not in ROLLBACKS:
            raise MemraError(f"rollback {self.rollback!r} is not one of {', '.join(ROLLBACKS)}")


@dataclass
class SpecStats:
    verifies: int = 0  # verify forwards (decode_step_t calls)
    drafted: int = 0  # draft tokens sent to a verify
    accepted: int = 0  # ... kept by the accept walk
    emitted: int = 0  # tokens the verifies produced (accepted drafts + one per verify, fewer at a stop)
    rollbacks: int = 0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_verify(self) -> float:
        return self.emitted / self.verifies if self.verifies else 0.0

    def summary(self) -> str:
        return (f"speculation: {self.accepted}/{self.drafted} drafts accepted ({self.acceptance:.1%}), "
                f"{self.tokens_per_verify:.2f} tokens per verify over {self.verifies} verifies")


# --- drafters ----------------------------------------------------------------------------------------


class Drafter(Protocol):
    """What the speculation loop needs from a drafter. Positions follow the trunk's cache."""

    def start(self, prompt: Sequence[int], prompt_hidden: torch.Tensor | None, first: int) -> None:
        """After the prompt was primed and its next token `first` chosen (not yet fed)."""

    def propose(self, k: int, ctr: int) -> list[int]:
        """Up to k tokens to follow the last emitted one; the i-th (from 0) would be drawn at step ctr + i."""

    def advance(self, kept: Sequence[int], h_seed: torch.Tensor, nxt: int) -> None:
        """A verify kept `kept` (now in the trunk's cache; h_seed [len(kept), E] their normed hiddens)
        and chose `nxt` (emitted, not yet fed)."""


class ReplayDrafter:
    """Proposes a known stream's next tokens (e.g. plain decoding's own output), so every draft is
    accepted: the speed ceiling of speculation, and a test that a fully accepted verify is exact."""

    def __init__(self, stream: Sequence[int]):
        self.stream = list(stream)

    def start(self, prompt, prompt_hidden, first) -> None:
        pass

    def propose(self, k: int, ctr: int) -> list[int]:
        return self.stream[ctr : ctr + k]

    def advance(self, kept, h_seed, nxt) -> None:
        pass


class NgramDrafter:
    """Prompt lookup: find the latest earlier occurrence of the longest suffix (ngram_max down to
    ngram_min tokens) of everything seen so far, and propose the tokens that followed it."""

    def __init__(self, spec: SpecConfig):
        self.lo, self.hi = spec.ngram_min, spec.ngram_max
        self.history: list[int] = []

    def start(self, prompt, prompt_hidden, first) -> None:
        self.history = [*prompt, first]

    def propose(self, k: int, ctr: int) -> list[int]:
        h = self.history
        for n in range(min(self.hi, len(h) - 1), self.lo - 1, -1):
            suffix = h[-n:]
            for start in range(len(h) - n - 1, -1, -1):  # latest match first, excluding the suffix itself
                if h[start : start + n] == suffix:
                    return h[start + n : start + n + k]
        return []

    def advance(self, kept, h_seed, nxt) -> None:
        self.history += [*kept[1:], nxt]  # kept[0] was emitted (and recorded) the round before


class MtpDrafter:
    """The checkpoint's NextN block as drafter: from the trunk's normed hidden at position t and the
    token at t+1 it predicts t+2 (memra.model.mtp). Its attention keeps its own KV (layer n_layers)
    in the sequence's cache, one entry per position t; entries are written for every true pair —
    the prompt's, then each verify's kept tokens — and chained drafts write speculative entries that
    the next round overwrites. Drafts use the request's own sampling draw (same noise as the target)."""

    def __init__(self, model, cache: Cache, params: SamplingParams):
        check_model(model, SpecConfig("mtp"))
        self.model, self.cache, self.params, self.block = model, cache, params, model.mtp[0]
        self.device = self.block.fc.device  # under PP: the last stage's
        self.embed = model.embed if model.embed.device == self.device else model.embed.to(self.device)
        self.pending_h: torch.Tensor | None = None  # [n, E] trunk hiddens of pairs not yet run
        self.pending_x: list[int] = []  # [n] the token after each
        self.pending_pos = 0  # position of the first pending pair

    def start(self, prompt, prompt_hidden, first) -> None:
        if prompt_hidden is None:
            raise MemraError("the MTP drafter needs the prompt's hidden states (prime with hidden=True)")
        self.pending_h, self.pending_x, self.pending_pos = prompt_hidden, [*prompt[1:], first], 0

    def _choose(self, u: torch.Tensor, ctr: int) -> int:
        logits = self.model.logits(u)[0]
        return int(torch.argmax(logits)) if self.params.greedy else int(device_sample(logits, self.params.dev_samp(ctr)))

    def propose(self, k: int, ctr: int) -> list[int]:
        m, n = self.model, len(self.pending_x)
        ids = torch.tensor(self.pending_x, device=self.device)
        ctx = m.context(self.cache, self.pending_pos, n, recurrent=False, device=self.device)
        u = self.block.forward(self.pending_h, self.embed[ids], ctx)[-1:]  # writes the true pairs' KV
        pos = self.pending_pos + n
        self.pending_h, self.pending_x, self.pending_pos = None, [], pos
        drafts: list[int] = []
        while len(drafts) < k:
            drafts.append(self._choose(u, ctr + len(drafts)))
            if len(drafts) == k:
                break
            ctx = m.context(self.cache, pos, 1, recurrent=False, device=self.device)
            u = self.block.forward(u, self.embed[torch.tensor(drafts[-1:], device=self.device)], ctx)
            pos += 1
        return drafts

    def advance(self, kept, h_seed, nxt) -> None:
        # pairs (h at p, token at p+1) for the kept positions p = pos0.., where pos0 — the verify's first
        # position — is where propose left pending_pos; they overwrite the chained drafts' entries
        h = h_seed.to(self.device)
        self.pending_h = h if self.pending_h is None else torch.cat((self.pending_h, h))  # (a round without propose)
        self.pending_x += [*kept[1:], nxt]


def check_model(model, spec: SpecConfig) -> None:
    """Refuse a drafter the model cannot serve (before anything is primed or printed)."""
    if spec.method == "mtp" and not model.mtp:
        raise MemraError(f"{model.cfg.arch}: this checkpoint has no MTP block; use --speculative ngram")


def make_drafter(spec: SpecConfig, model, cache: Cache, params: SamplingParams):
    return MtpDrafter(model, cache, params) if spec.method == "mtp" else NgramDrafter(spec)


# --- one speculative round -------------------------------------------------------------------------


def next_k(spec: SpecConfig, ema: float | None) -> int:
    """Draft length for the next round: spec.k, or under dynamic_k the accepted-drafts EMA plus one."""
    if not spec.dynamic_k or ema is None:
        return spec.k
    return max(1, min(spec.k, math.floor(ema) + 1))


def verify_round(model, cache: Cache, last: int, drafts: list[int], spec: SpecConfig, trail: StateTrail):
    """Feed [last, *drafts] in one verify. -> (logits [T, V], h_seed [T, E], pos0, snapshot-or-None)."""
    pos0 = cache.pos
    snap = cache.snapshot() if spec.rollback == "replay" else None
    logits, h_seed = model.decode_step_t([last, *drafts], pos0, cache, trail if snap is None else None)
    return logits, h_seed, pos0, snap


def drop_rejected(model, cache: Cache, chunk: list[int], keep: int, pos0: int, trail: StateTrail, snap) -> None:
    """Keep chunk[:keep] in the cache, drop the rest (no-op when everything was kept)."""
    if keep == len(chunk):
        return
    if snap is None:
        cache.rollback(pos0, keep, trail)
    else:  # snapshot + replay: back to before the verify, then feed the kept tokens again
        cache.restore(snap)
        model.decode_step_t(chunk[:keep], pos0, cache)
    counters.bump("spec_rollbacks")
