"""One engine step's next tokens for the whole batch, chosen on the device, one copy to the host.

    logits [B, V] --(penalized rows only: repetition / presence / frequency / logit_bias)-->
        --(constrained rows only: the row's grammar mask, memra.structured)-->
        --argmax for greedy rows; ops.sample_batch for the others (one launch on CUDA: temperature,
          top-k/p, min-p, seeded noise)--> tokens [B]
        --(rows that asked: log-softmax, the chosen token's logprob, the top n)--> one .tolist()

Each row's token is the one offline generation picks for that sequence (memra.sampling.sample after
apply_penalties), bit for bit: the penalties are the same elementwise fp32 operations, applied from
per-sequence state kept on the device (the tokens seen, the output counts) instead of Python lists
rebuilt every step; the batch sampler gives device_sample's token in every row (memra.kernels
.triton.sampling, tested against it). Logprobs are of the raw logits, as before penalties.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from memra import counters
from memra.errors import MemraError
from memra.sampling import SamplingParams
from memra.upload import Download, start_download, upload_values


@dataclass
class PenaltyState:
    """One penalized sequence's history on the device: which tokens it has seen (prompt and output:
    repetition) and how often each came out (presence / frequency), and its logit_bias as a scatter."""

    seen: torch.Tensor  # [V] bool
    counts: torch.Tensor  # [V] fp32 (whole numbers: exact)
    bias_ids: torch.Tensor | None = None  # [n] int64
    bias_vals: torch.Tensor | None = None  # [n] fp32
    stop_ids: torch.Tensor | None = None  # [s] int64: masked to -inf while fewer than min_tokens came out
    produced: int = 0  # output tokens already counted

    @classmethod
    def start(cls, params: SamplingParams, prompt: list[int], vocab: int, device: torch.device,
              stop_ids: frozenset[int] = frozenset()) -> "PenaltyState":
        seen = torch.zeros(vocab, dtype=torch.bool, device=device)
        seen.index_fill_(0, upload_values(prompt, torch.long, device), True)
        state = cls(seen, torch.zeros(vocab, dtype=torch.float32, device=device))
        if params.logit_bias:
            if max(t for t, _ in params.logit_bias) >= vocab:
                raise MemraError(f"logit_bias names a token outside the vocabulary (0..{vocab - 1})")
            state.bias_ids = upload_values([t for t, _ in params.logit_bias], torch.long, device)
            state.bias_vals = upload_values([b for _, b in params.logit_bias], torch.float32, device)
        if params.min_tokens and stop_ids:
            state.stop_ids = upload_values(sorted(stop_ids), torch.long, device)
        return state

    def observe(self, out: list[int]) -> None:
        """Count the output tokens not yet counted (the last step's, usually one)."""
        if len(out) > self.produced:
            new = upload_values(out[self.produced:], torch.long, self.counts.device)
            self.seen.index_fill_(0, new, True)
            self.counts.index_add_(0, new, torch.ones_like(new, dtype=torch.float32))
            self.produced = len(out)

    def apply(self, logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
        """apply_penalties' result for this sequence, as a new [V] tensor: the same fp32 operations."""
        out = logits.clone()
        if p.repetition_penalty != 1.0:
            out = torch.where(self.seen, torch.where(out > 0, out / p.repetition_penalty, out * p.repetition_penalty),
                              out)
        if self.produced and (p.presence_penalty or p.frequency_penalty):
            out -= p.frequency_penalty * self.counts + p.presence_penalty * (self.counts > 0).to(out.dtype)
        if self.bias_ids is not None:
            out[self.bias_ids] += self.bias_vals
        if self.stop_ids is not None and self.produced < p.min_tokens:  # a function of this row's own count
            out.index_fill_(0, self.stop_ids, float("-inf"))
            counters.bump("min_tokens_masked_rows")
        return out


@dataclass
class RowSpec:
    """What the sampler needs of one row: the sequence's params, prompt and output so far."""

    params: SamplingParams
    prompt: list[int]
    out: list[int]
    logprobs: int | None  # top-n asked for (0 = the chosen token's only), None = off
    penalty: PenaltyState | None = field(default=None)
    stop_ids: frozenset[int] = frozenset()  # the ids that end it: what min_tokens masks
    grammar: object | None = None  # its memra.structured.GrammarState where the output is constrained


@dataclass(frozen=True)
class Picked:
    token: int
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None  # the chosen token's rank in its row (1 = the likeliest), where logprobs were asked


@dataclass
class PendingPick:
    """A batch's choices still on the device: `tokens` [B] int64 (what the next decode step feeds), and
    their copy to the host under way: the tokens, then each asking row's logprob numbers (float64): the
    chosen token's logprob and rank, then the top n ids and their logprobs."""

    tokens: torch.Tensor
    asked: list[tuple[int, int]]  # (row, top-n) of the rows that asked for logprobs, in payload order
    copy: Download  # of the payload, or of the tokens when no row asked: queued with the launches

    def fetch(self) -> list[Picked]:
        """Wait for the choices' copy to the host (not for later work on the stream)."""
        host = self.copy.wait()
        b = self.tokens.shape[0]
        out = [Picked(int(t)) for t in host[:b]]
        at = b
        for i, n in self.asked:
            lp, rank, at = host[at], int(host[at + 1]), at + 2
            top = tuple(zip((int(x) for x in host[at : at + n]), host[at + n : at + 2 * n])) if n else ()
            at += 2 * n
            out[i] = Picked(out[i].token, lp, top, rank)
        return out


def joined_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat(parts) of [n_i, V] row blocks; a view, not a copy, where they already lie one after the other
    in one tensor: a mixed step's decode rows and its pieces' last rows as memra.graphs.widened reads them out
    (a 260 MB copy at 262 rows of Qwen3.5's vocabulary, 0.18 ms of an H100's mixed step), unless a piece that
    goes on to its next chunk sits between them. One storage, not adjacent addresses alone: two tensors the
    allocator happened to place end to end (CUDA's caching allocator does) are not one tensor."""
    first, at, rows = parts[0], parts[0].data_ptr(), 0
    storage = first.untyped_storage().data_ptr()
    for p in parts:
        if (p.data_ptr() != at or not p.is_contiguous() or p.dtype != first.dtype or p.device != first.device
                or p.shape[1:] != first.shape[1:] or p.untyped_storage().data_ptr() != storage):
            return torch.cat(parts)
        at, rows = at + p.numel() * p.element_size(), rows + p.shape[0]
    return first.as_strided((rows, *first.shape[1:]), (first.shape[1:].numel(), *first.stride()[1:]))


def launch_pick(ops, logits: torch.Tensor, rows: list[RowSpec]) -> PendingPick:
    """Every row's next token (and logprobs where asked) from logits [B, V], chosen on the device and
    not waited for (PendingPick.fetch: one device-to-host copy). `ops`: the model's kernel table (its
    batch sampler). The penalties read each row's history as the host has it now, so the rows' earlier
    tokens must have landed."""
    vocab = logits.shape[-1]
    chosen_from = logits
    penalized = [i for i, r in enumerate(rows) if r.params.penalized]
    constrained = [i for i, r in enumerate(rows) if r.grammar is not None]
    if penalized or constrained:
        chosen_from = logits.clone()
        for i in penalized:
            r = rows[i]
            if r.penalty is None:
                r.penalty = PenaltyState.start(r.params, r.prompt, vocab, logits.device, r.stop_ids)
            r.penalty.observe(r.out)
            chosen_from[i] = r.penalty.apply(logits[i], r.params)
        for i in constrained:  # after the penalties, as vLLM: a row's mask is its own grammar's, at its own place
            rows[i].grammar.advance(rows[i].out)
            chosen_from[i] = rows[i].grammar.apply(chosen_from[i])
    sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
    # [B] int64 on the device: every greedy row's token (device_sample's rule); a batch with none skips the read
    tokens = None if rows and len(sampled) == len(rows) else chosen_from.argmax(-1)
    if sampled:  # one launch for the rest (a program per row walks its vocabulary: no use for argmax)
        idx = upload_values(sampled, torch.long, logits.device) if tokens is not None else slice(None)
        picked = ops.sample_batch(chosen_from[idx], [rows[i].params.dev_samp(len(rows[i].out)) for i in sampled])
        tokens = tokens.index_copy_(0, idx, picked) if tokens is not None else picked
    asked = [(i, r.logprobs) for i, r in enumerate(rows) if r.logprobs is not None]
    payload = None  # the tokens, then each asking row's numbers, as one float64 vector
    if asked:
        payload = torch.cat([tokens.double(), logprob_numbers(logits, tokens, asked, ops.batched_logprobs)])
    return PendingPick(tokens, asked, start_download(payload if payload is not None else tokens))


def lone_row(row: torch.Tensor) -> torch.Tensor:
    """A logits row [V] as fp32 in a tensor of its own, which every logprob's log-softmax runs over (the
    sampler's, scoring's): CUDA's softmax reads a row in 16-byte vectors from the row's own alignment, and
    where V is not a multiple of 4 the rows of a [B, V] tensor lie at different alignments, so a row's
    values would depend on its place in the batch (or its position in a scored text). A fresh tensor starts
    aligned wherever the row came from."""
    return row.to(torch.float32, copy=True)


def logprob_numbers(logits: torch.Tensor, tokens: torch.Tensor, asked: list[tuple[int, int]],
                    batched: bool) -> torch.Tensor:
    """The asking rows' numbers as PendingPick lays them out (float64): per (row, n) of `asked`, its chosen
    token's logprob and rank (vLLM's Logprob.rank: 1 + how many tokens have a strictly higher logprob), then
    the top n ids and logprobs. Each row's log-softmax is over that row alone, as offline and as scoring
    computes it. batched (MEMRA_BATCHED_LOGPROBS, CUDA): one log-softmax over every asking row [k, V] and one
    gather and count for all, a handful of launches instead of some seven a row; CUDA's softmax reduces each
    row in a block of its own, so a row's values are its one-row values (tests/test_logprob_numbers.py holds
    them equal). Not on a CPU, where torch splits a lone row's reduction across threads; nor for a vocabulary
    that is not a multiple of 4, whose rows in [k, V] lie at other alignments than a lone row's (lone_row; on
    an H100, V = 50,257 gave other bits batched)."""
    if not batched or logits.shape[-1] % 4:
        pieces = []
        for i, n in asked:  # one row's [V] log-softmax alive at a time (k of them would be k x V floats at once)
            logp = torch.log_softmax(lone_row(logits[i]), dim=-1)
            chosen = logp.index_select(0, tokens[i : i + 1])  # [1]; not logp[tokens[i]]: .item()
            pieces += [chosen.double(), (logp > chosen).sum().double().unsqueeze(0) + 1]
            if n:
                vals, ids = torch.topk(logp, n)
                pieces += [ids.double(), vals.double()]
        return torch.cat(pieces)
    if len(asked) == logits.shape[0]:  # every row asks (in row order): no gather of the rows
        rows, picked = logits, tokens
    else:
        which = upload_values([i for i, _ in asked], torch.long, logits.device)  # [k]
        rows, picked = logits.index_select(0, which), tokens.index_select(0, which)
    logp = torch.log_softmax(rows.float(), dim=-1)  # [k, V]
    chosen = logp.gather(1, picked[:, None])  # [k, 1]
    pairs = torch.cat((chosen.double(), ((logp > chosen).sum(1, keepdim=True) + 1).double()), 1)  # [k, 2]
    pieces = []
    for j, (_, n) in enumerate(asked):
        pieces.append(pairs[j])
        if n:  # one row's topk, as unbatched: ties keep the order a lone row gives them
            vals, ids = torch.topk(logp[j], n)
            pieces += [ids.double(), vals.double()]
    return torch.cat(pieces)
