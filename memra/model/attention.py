"""Full (softmax) attention with paged KV: GQA, optional q/k RMSNorm, partial RoPE, optional output gate,
sliding window; per layer where layers differ (Gemma 4: head size, KV heads, K as V, V norm, KV shared
with an earlier layer, its own RoPE; Step: head count, a sigmoid gate per head)."""

from __future__ import annotations

import torch

from memra.config import ModelConfig
from memra.kernels.cuts import window_rows
from memra.kernels.table import KernelTable, written
from memra.model.context import Segments, StackedStep, StepContext, joined


class Attention:
    """Weights (canonical layout):
    wqkv [Qrows + 2*Hkv*D (+ Hq), E]  Qrows = Hq*D, or 2*Hq*D with an output gate (per head: D query rows,
         then D gate rows); no V rows where K is V, no K/V rows where the KV is shared; Hq head-gate rows last
    bqkv [same rows] | None     wo [E, Hq*D]     q_norm, k_norm [D] fp32 | None     v_norm [D] fp32 ones | None
    """

    def __init__(self, cfg: ModelConfig, layer: int, w: dict[str, torch.Tensor], ops: KernelTable):
        a = cfg.attn_of(layer)
        self.layer, self.cfg, self.ops = layer, cfg, ops
        self.n_heads, self.n_kv, self.head_dim = a.n_heads, a.n_kv_heads, a.head_dim
        self.q_rows = a.n_heads * a.head_dim * (2 if a.output_gate else 1)
        self.gated, self.head_gate, self.k_eq_v = a.output_gate, a.head_gate, a.k_eq_v
        self.scale = a.head_dim ** -0.5 if a.scale is None else a.scale
        self.wqkv, self.bqkv, self.wo = w["wqkv"], w.get("bqkv"), w["wo"]
        self.q_norm, self.k_norm, self.v_norm = w.get("q_norm"), w.get("k_norm"), w.get("v_norm")
        self.window = cfg.window(layer)  # sliding window (positions), or None: global
        self.kv_layer = layer if a.kv_from is None else a.kv_from  # whose K/V this layer reads
        self.shared_kv = a.kv_from is not None  # reads an earlier layer's K/V, writes none
        first, count, total = cfg.rope_slot(layer)
        # this layer's columns of the step's rotary tables (every RoPE joined; None: the whole table)
        self.rope_cols = None if count == total else torch.cat(
            (torch.arange(first, first + count), torch.arange(total + first, total + first + count)))
        self.fused = None  # one query a row: the op table's one-call decode attention? (decided at first use)

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        q, k, v, gate = self._project(x)
        # a generated token's RoPE, K/V write and attention in one call (a prompt token attends as prompts do: _attend)
        if ctx.n_tokens == 1 and ctx.recurrent and self._fused(q, ctx.cache.kv, ctx.cos):
            cos, sin = self._tables(ctx.cos, ctx.sin)
            kv, rows = ctx.cache.kv, self._decode_rows(ctx.kv_read_rows)
            k, v = (None, None) if self.shared_kv else (k, v)
            o = self.ops.decode_attention(q, k, v, cos, sin, kv.k[self.kv_layer], kv.v[self.kv_layer],
                                          ctx.kv_write_rows, rows, None, None, self.scale)
            return self._output(o.reshape(1, self.n_heads * self.head_dim), gate)
        q = self._rope_write(q, k, v, ctx.cos, ctx.sin, ctx.cache.kv, ctx.kv_write_rows)
        return self._output(self._attend(q, ctx), gate)

    def _fused(self, q: torch.Tensor, kv, cos: torch.Tensor) -> bool:
        if self.fused is None:
            self.fused = self.ops.fused_decode_attention(q, kv.k[self.kv_layer], cos)
        return self.fused

    def _decode_rows(self, read_rows: torch.Tensor) -> torch.Tensor:
        """The pool rows one query reads: its whole prefix, or the last W positions of it in a window."""
        return read_rows if self.window is None else read_rows[-self.window:]

    def forward_segments(self, x: torch.Tensor, wave: Segments) -> torch.Tensor:
        """x [N, E]: prompt pieces of several sequences (wave: their rows and contexts). Projections,
        norms, rope and the K/V writes run over all N rows at once (row-wise ops; one launch where the
        pieces share a KV pool, as in the engine); each piece attends over its own sequence's prefix,
        with exactly the shapes of its solo forward."""
        q, k, v, gate = self._project(x)
        return self._output(self._attend_pieces(q, k, v, wave), gate)

    def forward_mixed(self, x: torch.Tensor, step: StackedStep, wave: Segments) -> torch.Tensor:
        """x [B + N, E]: B decode rows (step), then N rows of prompt pieces (wave, rows counted from B).
        The projections run over all rows; each kind attends as its own forward does."""
        q, k, v, gate = self._project(x)
        b = x.shape[0] - wave.n_rows
        o = q.new_empty(x.shape[0], self.n_heads * self.head_dim)  # each kind writes its own rows: no join
        self._attend_rows(q[:b], k[:b], v[:b], step, o[:b])
        self._attend_pieces(q[b:], k[b:], v[b:], wave, o[b:])
        return self._output(o, gate)

    def _attend_pieces(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, wave: Segments,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        """q [N, Hq, D], k/v [N, Hkv, D] (not yet rotated) of a wave's pieces -> [N, Hq*D] (into `out` where
        given): every piece's K/V written, then each attends over its own sequence's prefix."""
        n = q.shape[0]
        pieces = list(zip(wave.bounds, wave.ctxs))
        if wave.kv_write_rows is not None:
            q = self._rope_write(q, k, v, wave.cos, wave.sin, wave.kv, wave.kv_write_rows)
        else:  # pools of their own: piece by piece
            q = joined([self._rope_write(q[a:b], k[a:b], v[a:b], c.cos, c.sin, c.cache.kv, c.kv_write_rows)
                        for (a, b), c in pieces])
        if wave.attn is None:  # pools of their own: each attends alone
            return written(out, joined([self._attend(q[a:b], c) for (a, b), c in pieces]))
        kv, into = wave.kv, None if out is None else out.view(q.shape)
        o = self.ops.prefill_attention_pieces(q, kv.k[self.kv_layer], kv.v[self.kv_layer], wave.attn, self.scale, self.window,
                                              into)
        return o.reshape(n, self.n_heads * self.head_dim)

    def forward_stacked(self, x: torch.Tensor, step: StackedStep) -> torch.Tensor:
        """x [B, E]: row i is one new token of step.ctxs[i]'s sequence — B sequences of a batched decode,
        or the T consecutive tokens of one sequence in a verify. Projections batched; attention row by
        row over each row's own paged prefix, one launch per KV pool (memra.kernels)."""
        q, k, v, gate = self._project(x)
        return self._output(self._attend_rows(q, k, v, step), gate)

    def _attend_rows(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: StackedStep,
                     out: torch.Tensor | None = None) -> torch.Tensor:
        """q [B, Hq, D], k/v [B, Hkv, D] (not yet rotated), one token per row -> [B, Hq*D] (into `out` where
        given). A pool's rows all write their K/V first, then each reads positions 0..its own in order. Writing
        early changes nothing a row reads: other rows write other sequences' blocks, or (verify) positions after
        this row's."""
        b, d = q.shape[0], self.head_dim
        if len(step.groups) == 1 and isinstance(step.groups[0].sel, slice):  # one pool (the engine's): no gathers
            g = step.groups[0]
            qr = self._rope_write(q, k, v, step.cos, step.sin, g.kv, g.write_rows)
            return self._rows(qr, g, None if out is None else out.view(q.shape)).reshape(b, self.n_heads * d)
        o = q.new_empty(q.shape) if out is None else out.view(q.shape)
        for g in step.groups:
            qr = self._rope_write(q[g.sel], k[g.sel], v[g.sel], step.cos[g.sel], step.sin[g.sel], g.kv, g.write_rows)
            o[g.sel] = self._rows(qr, g)
        return o.reshape(b, self.n_heads * d)

    def _rows(self, qr: torch.Tensor, g, out: torch.Tensor | None = None) -> torch.Tensor:
        """qr [n, Hq, D] (rotated) of a RowGroup's rows, each over its prefix -- with a sliding window, over
        the prefix's last W positions (the same cut a B=1 decode makes, so a row's bits stay its own). out: [n,
        Hq, D], where the output goes."""
        starts, lens, max_len = g.starts, g.lens, g.max_len
        if self.window is not None:
            starts, lens = window_rows(starts, lens, self.window)
            max_len = min(max_len, self.window)
        if self._fused(qr, g.kv, None):  # q rotated, K/V written: the kernel attends only
            return written(out, self.ops.decode_attention(qr, None, None, None, None, g.kv.k[self.kv_layer],
                                                          g.kv.v[self.kv_layer], None, g.read_rows, starts, lens,
                                                          self.scale))
        return self.ops.paged_attention_rows(qr, g.kv.k[self.kv_layer], g.kv.v[self.kv_layer], g.read_rows, starts, lens,
                                             self.scale, max_len, out)

    def _project(self, x: torch.Tensor):
        """x [T, E] -> q [T, Hq, D], k/v [T, Hkv, D] (normed, not yet rotated; empty where the KV is shared),
        gate [T, Hq, D] or [T, Hq, 1] (Step's head gate) | None (a view into the projection's output: read
        where it lies, never copied)."""
        t, d = x.shape[0], self.head_dim
        qkv = self.ops.linear(x, self.wqkv, self.bqkv)  # [T, Qrows + K rows + V rows (+ Hq)]
        kv_rows = 0 if self.shared_kv else self.n_kv * d
        parts = [self.q_rows, kv_rows, 0 if self.k_eq_v else kv_rows] + ([self.n_heads] if self.head_gate else [])
        q, k, v, *head_gate = qkv.split(parts, dim=-1)
        gate = head_gate[0].view(t, self.n_heads, 1) if head_gate else None
        if self.gated:
            q, gate = q.view(t, self.n_heads, 2 * d).split([d, d], dim=-1)  # gate interleaved per head
        q = q.reshape(t, self.n_heads, d)
        norm = lambda y, w: self.ops.rms_norm(y, w, self.cfg.norm_eps, self.cfg.zero_centered_norm)  # noqa: E731
        if self.q_norm is not None:
            q = norm(q, self.q_norm)
        if self.shared_kv:  # nothing to write: empty stand-ins, sliced by row like real K/V and never read
            return q, q.new_empty(t, 0), q.new_empty(t, 0), gate
        k = k.reshape(t, self.n_kv, d)
        v = k if self.k_eq_v else v.reshape(t, self.n_kv, d)  # Gemma 4: V is K's projection, before K's norm
        if self.k_norm is not None:
            k = norm(k, self.k_norm)
        if self.v_norm is not None:
            v = norm(v, self.v_norm)
        return q, k, v, gate

    def _rope_write(self, q, k, v, cos, sin, kv, rows) -> torch.Tensor:
        """Rotate q and k, write k and v to the pool rows `rows` [T] -> the rotated q (one launch on the GPU).
        A layer that shares an earlier layer's KV only rotates q."""
        cos, sin = self._tables(cos, sin)
        if self.shared_kv:
            return self.ops.apply_rope(q, cos, sin)
        return self.ops.rope_write_kv(q, k, v, cos, sin, kv.k[self.kv_layer], kv.v[self.kv_layer], rows)

    def _tables(self, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's RoPE: its columns of the step's joined tables (all of them where it has one RoPE)."""
        if self.rope_cols is None:
            return cos, sin
        if self.rope_cols.device != cos.device:
            self.rope_cols = self.rope_cols.to(cos.device)
        return cos.index_select(-1, self.rope_cols), sin.index_select(-1, self.rope_cols)

    def _attend(self, q: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """Attend over this sequence's whole prefix in order (its new K/V already written)."""
        t, d = q.shape[0], self.head_dim
        kv = ctx.cache.kv
        # A generated token (the recurrent form: decode, a verify column) takes the decode kernels, which read
        # the prefix (its last W positions) in order, whatever the batch. A prompt token takes the prefill
        # kernel even alone: where a prime is one forward per chunk (the invariant path), a prompt of 64k + 1
        # tokens cut at 64k (a prefix-cache hit, a snapshot stop, the token budget) primes its last token alone,
        # and it must get the bits it gets inside the one-shot prime's forward (E5, E8).
        if t == 1 and ctx.recurrent and self._fused(q, kv, None):  # the CPU's C kernel, q already rotated
            o = self.ops.decode_attention(q, None, None, None, None, kv.k[self.kv_layer], kv.v[self.kv_layer], None,
                                          self._decode_rows(ctx.kv_read_rows), None, None, self.scale)
        elif t == 1 and ctx.recurrent:
            rows = self._decode_rows(ctx.kv_read_rows)
            o = self.ops.paged_decode_attention(q[0], kv.k[self.kv_layer], kv.v[self.kv_layer], rows, self.scale)
        else:
            o = self.ops.prefill_attention(q, kv.k[self.kv_layer], kv.v[self.kv_layer], ctx.kv_read_rows, ctx.pos0, self.scale,
                                           self.window)
        return o.reshape(t, self.n_heads * d)

    def _output(self, o: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        """o [T, Hq*D], gated by sigmoid(gate [T, Hq, D]) where the model has an output gate -> [T, E]."""
        if gate is not None:
            t = o.shape[0]
            o = (o.view(t, self.n_heads, self.head_dim) * torch.sigmoid(gate)).reshape(t, -1)
        return self.ops.linear(o, self.wo)
