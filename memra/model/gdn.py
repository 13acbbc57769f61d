"""Gated DeltaNet: causal conv + gated delta rule, chunked for prompt tokens, recurrent for generated ones."""

from __future__ import annotations

import torch

from memra.config import ModelConfig
from memra.kernels.table import KernelTable, written
from memra.model.context import Segments, StackedStep, StepContext, joined


class GatedDeltaNet:
    """Weights (canonical layout; value heads in grouped order: head g*r + j belongs to key head g):
    w_in [2*key_dim + 2*value_dim + 2*Hv, E]  rows [q | k | v | z | b | a]
    conv [conv_dim, Kc]   a_neg [Hv] = -exp(A_log) fp32   dt_bias [Hv] fp32   norm [Dv] fp32   wo [E, value_dim]
    """

    def __init__(self, cfg: ModelConfig, layer: int, w: dict[str, torch.Tensor], ops: KernelTable):
        g = cfg.gdn
        self.layer, self.g, self.eps, self.ops = layer, g, cfg.norm_eps, ops
        self.split = [g.conv_dim, g.value_dim, g.n_v_heads, g.n_v_heads]
        self.w_in, self.conv, self.wo = w["w_in"], w["conv"], w["wo"]
        self.a_neg, self.dt_bias, self.norm = w["a_neg"], w["dt_bias"], w["norm"]

    def _heads(self, mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor):
        """Conv output [N, conv_dim] and gate inputs [N, Hv] -> q, k [N, Hv, Dk] (l2-normed, q scaled,
        key heads repeated over their value heads), v [N, Hv, Dv] fp32, beta, decay [N, Hv]. The same
        calls for a prompt chunk, a batch of decode rows or a verify's tokens."""
        g = self.g
        return self.ops.gdn_heads(mixed, b, a, self.a_neg, self.dt_bias, g.n_k_heads, g.n_v_heads, g.k_head_dim,
                                  g.v_head_dim)

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        mixed, z, b, a = self.ops.linear(x, self.w_in).split(self.split, dim=-1)
        conv_state = ctx.cache.conv_state(self.layer)
        mixed, new_conv = self.ops.causal_conv(mixed, conv_state, self.conv)  # [T, conv_dim]
        conv_state.copy_(new_conv)
        q, k, v, beta, decay = self._heads(mixed, b, a)

        state = ctx.cache.ssm_state(self.layer)
        if ctx.recurrent:
            o, new_state = self.ops.gdn_recurrent(q, k, v, beta, decay, state)
        else:
            o, new_state = self.ops.gdn_prefill(q, k, v, beta, decay, state, ctx.pos0)
        state.copy_(new_state)
        if ctx.trail is not None:  # a verify column run alone (the row plan)
            ctx.trail.record(self.layer, ctx.column, conv_state, state)
        return self._output(o, z)

    def forward_segments(self, x: torch.Tensor, wave: Segments) -> torch.Tensor:
        """x [N, E]: prompt pieces of several sequences, piece i in rows wave.bounds[i], context wave.ctxs[i].
        Projections, norms and gates run over all N rows at once (row-wise ops); the conv and the chunked
        delta rule run each piece on its own sequence's state, with the arithmetic of its solo forward:
        in one launch per kernel where the states share a pool (wave.recurrent), else piece by piece."""
        mixed, z, b, a = self.ops.linear(x, self.w_in).split(self.split, dim=-1)
        return self._output(self._mix_pieces(mixed, b, a, wave), z)

    def forward_stacked(self, x: torch.Tensor, step: StackedStep) -> torch.Tensor:
        """The stacked batched decode: x [B, E], one generated token per sequence, each with its own
        cache. Projections run as one [B, E] matmul; the delta-rule states are stepped where they are in
        the pool (a graph's static step) or gathered, stepped and scattered (caches of their own)."""
        mixed, z, b, a = self.ops.linear(x, self.w_in).split(self.split, dim=-1)
        return self._output(self._mix_rows(mixed, b, a, step), z)

    def forward_mixed(self, x: torch.Tensor, step: StackedStep, wave: Segments) -> torch.Tensor:
        """x [B + N, E]: B decode rows (step), then N rows of prompt pieces (wave, rows counted from B).
        Projections, norms and gates over all rows; the recurrent part of each kind as its own forward runs it."""
        mixed, z, b, a = self.ops.linear(x, self.w_in).split(self.split, dim=-1)
        r, g = x.shape[0] - wave.n_rows, self.g
        # o [B + N, Hv, Dv] fp32: each kind writes its own rows (no join of two outputs, 29 MB a layer of 896 rows)
        o = torch.empty(x.shape[0], g.n_v_heads, g.v_head_dim, dtype=torch.float32, device=x.device)
        self._mix_rows(mixed[:r], b[:r], a[:r], step, o[:r])
        self._mix_pieces(mixed[r:], b[r:], a[r:], wave, o[r:])
        return self._output(o, z)

    def _output(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """The delta rule's output o [T, Hv, Dv], gated and normed by z [T, value_dim], projected -> [T, E]."""
        g, t = self.g, o.shape[0]
        y = self.ops.gated_rms_norm(o, z.reshape(t, g.n_v_heads, g.v_head_dim), self.norm, self.eps)
        return self.ops.linear(y.reshape(t, g.value_dim), self.wo)

    def _mix_pieces(self, mixed, b, a, wave: Segments, out: torch.Tensor | None = None) -> torch.Tensor:
        """Prompt pieces' conv and chunked delta rule -> o [N, Hv, Dv] (written into `out` where given)."""
        if wave.recurrent is None:
            return written(out, self._pieces_one_by_one(mixed, b, a, wave))
        pool = wave.rec
        mixed = self.ops.causal_conv_pieces(mixed, pool.conv[self.layer], self.conv, wave.recurrent)
        q, k, v, beta, decay = self._heads(mixed, b, a)
        return self.ops.gdn_prefill_pieces(q, k, v, beta, decay, pool.ssm[self.layer], wave.recurrent, out)

    def _pieces_one_by_one(self, mixed, b, a, wave: Segments) -> torch.Tensor:
        """The conv and the chunked delta rule a piece at a time (states in pools of their own) -> o [N, Hv, Dv]."""
        pieces = list(zip(wave.bounds, wave.ctxs))
        convolved = []
        for (lo, hi), ctx in pieces:
            conv_state = ctx.cache.conv_state(self.layer)
            out, new_conv = self.ops.causal_conv(mixed[lo:hi], conv_state, self.conv)
            conv_state.copy_(new_conv)
            convolved.append(out)
        q, k, v, beta, decay = self._heads(torch.cat(convolved), b, a)
        outs = []
        for (lo, hi), ctx in pieces:
            state = ctx.cache.ssm_state(self.layer)
            o, new_state = self.ops.gdn_prefill(q[lo:hi], k[lo:hi], v[lo:hi], beta[lo:hi], decay[lo:hi], state, ctx.pos0)
            state.copy_(new_state)
            outs.append(o)
        return torch.cat(outs)

    def _mix_rows(self, mixed, b, a, step: StackedStep, out: torch.Tensor | None = None) -> torch.Tensor:
        """Decode rows' conv step and delta-rule step, one token each -> o [B, Hv, Dv] (written into `out` where
        given)."""
        ctxs = step.ctxs
        if step.slots is not None:  # one pool, slots by index (a graph's static step): states stepped in place
            mixed = self.ops.causal_conv_step_into(mixed, step.rec.conv[self.layer], step.slots, self.conv)
        else:
            conv_states = torch.stack([c.cache.conv_state(self.layer) for c in ctxs])
            mixed, new_conv = self.ops.causal_conv_step(mixed, conv_states, self.conv)
        q, k, v, beta, decay = self._heads(mixed, b, a)
        if step.slots is not None:  # the states ([B, Hv, Dk, Dv] fp32, 2 MiB a row on the 9B) stepped in the pool
            return self.ops.delta_rule_step_into(q, k, v, beta, decay, step.rec.ssm[self.layer], step.slots, out)
        states = torch.stack([c.cache.ssm_state(self.layer) for c in ctxs])
        o, new_states = self.ops.delta_rule_step(q, k, v, beta, decay, states)
        for i, c in enumerate(ctxs):
            c.cache.conv_state(self.layer).copy_(new_conv[i])
            c.cache.ssm_state(self.layer).copy_(new_states[i])
        return written(out, o)

    def forward_tokens(self, x: torch.Tensor, step: StackedStep) -> torch.Tensor:
        """The verify body's GDN: x [N, E], the consecutive generated tokens of one sequence (ctxs[j] at
        pos0 + j) — or of several, each a run of rows with its own cache (the engine's batched verify) —
        each computed as decode computes it, in three calls per sequence instead of one per token:
        - projections, norms and gates stacked over all N rows (batch-invariant kernels: a row's bits are
          its B=1 call's);
        - the conv over a sequence's T tokens at once: per element the very multiply-adds of decode's
          causal_conv_step, in the same order (elementwise ops are position-invariant on the GPU);
        - the delta rule as one scan over a sequence's T tokens in order: decode's own kernel (T=1 per row
          there), so every token's step has decode's bits. The state after each token is kept for
          rollback (the sequence's trail)."""
        mixed, z, b, a = self.ops.linear(x, self.w_in).split(self.split, dim=-1)
        runs = _runs(step.ctxs)
        convolved = []
        for lo, hi in runs:
            cache, trail = step.ctxs[lo].cache, step.ctxs[lo].trail
            conv_state, part = cache.conv_state(self.layer), mixed[lo:hi]
            if trail is not None:  # conv state after token j = the Kc-1 raw inputs ending at j
                window = torch.cat((conv_state.to(part.dtype), part.t()), dim=1)  # [C, Kc-1+T]
                trail.record_conv_all(self.layer, window.unfold(1, conv_state.shape[-1], 1)[:, 1:].permute(1, 0, 2))
            out, new_conv = self.ops.causal_conv(part, conv_state, self.conv)  # [T, conv_dim]
            conv_state.copy_(new_conv)
            convolved.append(out)
        q, k, v, beta, decay = self._heads(joined(convolved), b, a)
        outs = []
        for lo, hi in runs:
            cache, trail = step.ctxs[lo].cache, step.ctxs[lo].trail
            state = cache.ssm_state(self.layer)
            o, states = self.ops.delta_rule_scan(q[None, lo:hi], k[None, lo:hi], v[None, lo:hi], beta[None, lo:hi],
                                                 decay[None, lo:hi], state[None], every=trail is not None)
            state.copy_(states[0, -1])
            if trail is not None:
                trail.record_ssm_all(self.layer, states[0])
            outs.append(o[0])
        return self._output(joined(outs), z)


def _runs(ctxs) -> list[tuple[int, int]]:
    """[lo, hi) of each run of consecutive contexts on one cache (one sequence's verify columns)."""
    runs, lo = [], 0
    for i in range(1, len(ctxs) + 1):
        if i == len(ctxs) or ctxs[i].cache is not ctxs[lo].cache:
            runs.append((lo, i))
            lo = i
    return runs
