"""Speculative decoding inside the engine loop: promise E4 under load.

A sequence speculates when the engine has a SpecConfig (`memra serve --speculative`, memra.LLM's
`speculative=`) and its request did not opt out. Each step, for every speculating decode row:

    draft    its last token must be on the host (the engine lands the step in flight first when one
             of these rows has a token there); k = the config's draft length (dynamic: an EMA of the
             row's accepted drafts, + 1), clamped to max_tokens and to the blocks the scheduler grants
             (Scheduler.reserve_extra); the drafter proposes up to k tokens (memra.spec). A row with no
             drafts (n-gram: no match; any: k = 0) stays in the step's plain decode batch. MTP rows
             always verify (even T = 1), so the drafter sees every position's hidden state.
    verify   after the batch's own tokens are launched: every verifying row's T = 1 + drafts tokens in
             one forward, rows of different lengths side by side (memra.verify_batch), each column
             with decode's bits for its token (E4).
    accept   column by column, the token is chosen by the engine's own sampler (launch_pick: the
             same penalties from the row's history, step counter = its output index, seeded noise,
             logprobs of the raw row) and emitted as the plain step would emit it; a draft survives
             only if it equals that choice. So every token and every logprob is the plain server's.
             (Without penalties every column's choice is made ahead, all rows in one launch and one
             copy to the host: column j is reached only after drafts[:j] came out.)
    rollback the rejected suffix is dropped (the row's state trail, or snapshot + replay) and the
             blocks past the kept position go back to the pool, so the cache holds what the
             scheduler counts.

The plain rows of the step decode as one batch beside it, as they would without speculation.

An MTP drafter needs the prompt's final-normed hidden states: a speculating MTP sequence's prefill
chunks are primed alone with hidden=True (the same forwards and bits as in the step's shared prefill,
E5/E6), and the hidden states are kept until its first draft.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from memra import counters
from memra.cache import BLOCK_SIZE
from memra.engine.sampler import RowSpec, launch_pick
from memra.errors import MemraError
from memra.spec import MtpDrafter, NgramDrafter, SpecConfig, check_model, drop_rejected, next_k
from memra.state_trail import StateTrail
from memra.verify_batch import decode_step_t_batch


@dataclass
class SpecSeq:
    """One speculating sequence's drafter state."""

    drafter: object | None = None  # made at its first draft (it needs the first token)
    hidden: list[torch.Tensor] = field(default_factory=list)  # MTP: the prompt's normed hidden states, per chunk
    seen: int = 0  # n-gram: output tokens already in the drafter's history
    ema: float | None = None  # accepted drafts per round (dynamic k)


@dataclass
class Verify:
    """A row that verifies this step: its drafts (k may be 0 for an MTP row)."""

    seq: object  # SeqState
    drafts: list[int]


class PlainDecoding:
    """An engine that does not speculate: every hook passes the step through."""

    enabled = False

    def start(self, params) -> None:
        return None

    def before_step(self, rows, chunks, scheduler, inflight, land):
        return rows, chunks, [], []

    def prime_alone(self, chunks, lasts, alone):
        return chunks, lasts

    def verify(self, rows, emit, end, metrics=None) -> dict[str, int]:
        return {}


def speculation_for(model, spec: SpecConfig | None, backend):
    """The engine's speculation for this config (None: plain decoding)."""
    return PlainDecoding() if spec is None else Speculation(model, spec, backend)


class Speculation:
    """The engine's speculation: drafts before the step's forward, verifies after it."""

    enabled = True

    def __init__(self, model, spec: SpecConfig, backend):
        if not isinstance(spec, SpecConfig):
            raise MemraError(f"speculative must be a SpecConfig, got {type(spec).__name__}")
        if not backend.device_tokens:
            raise MemraError("speculative decoding in the server runs in one process; a process pipeline "
                             "(--pp-size) cannot roll back across ranks: drop --speculative or --pp-size")
        check_model(model, spec)
        from memra.step import verify_plan

        verify_plan(model, model.settings.exact)  # refuses a plan with no verify body (bucket) now, not mid-request
        self.model, self.cfg = model, spec
        self.trails: list[StateTrail] = []  # the i-th verifying row of a step records into the i-th (grow-only)

    def start(self, params) -> SpecSeq:
        return SpecSeq()

    # --- before the forward ---
    def before_step(self, rows, chunks, scheduler, inflight, land):
        """-> (the rows that decode plainly, the chunks of the shared prefill, the rows that verify, the chunks
        primed alone). A drafter needs its row's last token on the host: where one is still in flight, the
        step in flight lands first (`land`), and rows that ended with it drop out."""
        if inflight is not None and any(s.spec is not None for s in inflight.rows):
            land()
            rows = [s for s in rows if not s.done]
        rows, verifying = self.draft(rows, scheduler)
        chunks, alone = self.split_prefill(chunks)
        return rows, chunks, verifying, alone

    def split_prefill(self, chunks):
        """-> (chunks for the shared prefill, chunks an MTP drafter needs the hidden states of)."""
        if self.cfg.method != "mtp":
            return chunks, []
        return ([c for c in chunks if c[0].spec is None], [c for c in chunks if c[0].spec is not None])

    def prime_alone(self, chunks, lasts, alone):
        """Prime each chunk of `alone` on its own, keeping its hidden states. -> (chunks + alone, lasts + their
        last-position logits [V] each)."""
        lasts = list(lasts)
        for s, start, n in alone:
            logits, hidden = self.model.prime(s.prompt[start : start + n], s.cache, hidden=True)
            s.spec.hidden.append(hidden)
            lasts.append(logits)
        return chunks + alone, lasts

    def draft(self, rows, scheduler) -> tuple[list, list[Verify]]:
        """-> (the rows that decode plainly this step, the rows that verify). Each verifying row's extra
        positions are reserved with the scheduler and in its cache before any drafter writes."""
        plain, verifying = [], []
        for s in rows:
            if s.spec is None:
                plain.append(s)
                continue
            k = max(0, min(next_k(self.cfg, s.spec.ema), s.params.max_tokens - len(s.out) - 1))
            drafter = self._drafter(s)
            if isinstance(drafter, MtpDrafter):
                k = scheduler.reserve_extra(s.rid, k)
                s.cache.reserve(k + 1)  # the drafter writes its chained drafts' KV up to the verify's last position
                verifying.append(Verify(s, drafter.propose(k, ctr=len(s.out)) if k else []))
                continue
            drafts = drafter.propose(k, ctr=len(s.out)) if k else []  # n-gram lookup writes nothing
            drafts = drafts[: scheduler.reserve_extra(s.rid, len(drafts))] if drafts else []
            if drafts:
                verifying.append(Verify(s, drafts))
            else:
                plain.append(s)
        return plain, verifying

    def _drafter(self, s):
        sp = s.spec
        if sp.drafter is None:
            if self.cfg.method == "mtp":
                sp.drafter = MtpDrafter(self.model, s.cache, s.params)
                sp.drafter.start(s.prompt, torch.cat(sp.hidden), s.out[0])
                sp.hidden = []
            else:
                sp.drafter = NgramDrafter(self.cfg)
                sp.drafter.start(s.prompt, None, s.out[0])
            sp.seen = 1
        if isinstance(sp.drafter, MtpDrafter):
            sp.drafter.cache = s.cache  # a new handle after a swap out and in
        else:  # the history follows the output, whichever way its tokens came (plain steps included)
            sp.drafter.history += s.out[sp.seen :]
            sp.seen = len(s.out)
        return sp.drafter

    # --- after the forward ---
    def verify(self, rows: list[Verify], emit, end, metrics=None) -> dict[str, int]:
        """Each row's verify, accept walk and rollback. `emit(seq, picked)` records a token as the plain step
        does (and marks the sequence done at EOS / max_tokens); `end(seq)` frees one that finished. -> rid
        -> tokens beyond one emitted, for every row still running (each got at least one)."""
        if not rows:
            return {}
        while len(self.trails) < len(rows):
            self.trails.append(StateTrail())
        trails = self.trails[: len(rows)]
        snaps = [v.seq.cache.snapshot() if self.cfg.rollback == "replay" else None for v in rows]
        verified = decode_step_t_batch(self.model, [[v.seq.out[-1], *v.drafts] for v in rows],
                                       [v.seq.cache for v in rows], [None if snap else t for snap, t in zip(snaps, trails)])
        early = self._early_picks(rows, [logits for logits, _ in verified])
        extra = {}
        for v, (logits, h_seed), trail, snap, picks in zip(rows, verified, trails, snaps, early):
            s, drafts = v.seq, v.drafts
            emitted, accepted = self._accept(s, drafts, logits, h_seed, trail, snap, picks, emit)
            counters.bump("spec_drafted_tokens", len(drafts))
            counters.bump("spec_accepted_tokens", accepted)
            if metrics is not None:
                metrics.spec_verifies.inc()
                if drafts:
                    metrics.spec_drafts.inc()
                    metrics.spec_draft_tokens.inc(len(drafts))
                    metrics.spec_accepted_tokens.inc(accepted)
            s.spec.ema = accepted if s.spec.ema is None else 0.7 * s.spec.ema + 0.3 * accepted
            if s.done:
                end(s)
            else:
                extra[s.rid] = emitted - 1
        return extra

    def _early_picks(self, rows: list[Verify], logits: list[torch.Tensor]) -> list[list | None]:
        """Every column's choice, chosen at once, for the rows without penalties: there a column's choice
        depends on the walk only through its step counter, and column j is reached only when the walk
        emitted drafts[:j] before it — so it is the sampler's choice for output out + drafts[:j], made in one
        launch and one copy to the host for all of them (the sampler's rows do not see each other, E3).
        -> per row its picks, or None (penalized: chosen column by column as the walk goes)."""
        specs, parts = [], []
        for v, lg in zip(rows, logits):
            s = v.seq
            if not s.params.penalized:
                specs += [RowSpec(s.params, s.prompt, s.out + v.drafts[:j], s.logprobs) for j in range(lg.shape[0])]
                parts.append(lg)
        picked = iter(launch_pick(self.model.ops, torch.cat(parts), specs).fetch() if specs else ())
        return [None if v.seq.params.penalized else [next(picked) for _ in range(lg.shape[0])]
                for v, lg in zip(rows, logits)]

    def _accept(self, s, drafts: list[int], logits, h_seed, trail, snap, picks, emit) -> tuple[int, int]:
        """One row's accept walk over its verify's columns (logits [T, V]; `picks`: their choices when made
        ahead), then its rollback. -> (tokens emitted, drafts accepted)."""
        c, chunk = s.cache, [s.out[-1], *drafts]
        pos0 = c.pos - len(chunk)
        keep = accepted = 0
        while True:
            picked = picks[keep] if picks is not None else \
                launch_pick(self.model.ops, logits[keep : keep + 1], [s.row]).fetch()[0]
            emit(s, picked)
            keep += 1
            if keep <= len(drafts) and drafts[keep - 1] == picked.token:
                accepted += 1  # the draft is the token this column chose: the next column stands
                if not s.done:
                    continue
            break
        if not s.done:
            drop_rejected(self.model, c, chunk, keep, pos0, trail, snap)
            _trim(c)
            if isinstance(s.spec.drafter, MtpDrafter):
                s.spec.drafter.advance(chunk[:keep], h_seed[:keep], picked.token)
        return keep, accepted


def _trim(cache) -> None:
    """Give back the blocks past the cache's position (a rejected suffix's), so the cache holds what the
    scheduler counts for it."""
    keep = -(-cache.pos // BLOCK_SIZE)
    if len(cache.blocks) > keep:
        cache.kv.release(cache.blocks[keep:])
        del cache.blocks[keep:]
