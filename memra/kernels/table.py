"""The op table a model calls, decided once when the model is loaded (KernelTable.build) and frozen.
Which implementation runs is decided here and nowhere else, because exactness depends on it:

- CPU, and CUDA with MEMRA_EXACT=0: the pure-torch reference (cuBLAS / ATen on CUDA), whose bits
  may depend on how many rows share a call.
- CUDA in exact mode with Triton present (and MEMRA_TRITON not 0): the batch-invariant Triton twins
  for every op whose torch form picks its algorithm from the row count (matmuls, row norms, the
  delta-rule step, decode attention). Elementwise ops stay in torch (the self-test checks that they
  give a value the same bits wherever it sits), but for SwiGLU's activation: one launch for torch's
  two, with torch's bits.

`invariant` says whether the second table is live; the decode plan uses it to decide whether B rows
may run as one stacked forward (memra.decode_plan).

`moe_experts` runs as grouped matmuls (memra.kernels.triton.moe) wherever the invariant kernels run:
the same bits as the per-expert loop over the invariant linear, without the loop's host round trip.

`linear` also takes a GGUF weight packed in a split layout (memra.kernels.split): the same choice,
between the fused dequantizing kernel (memra.kernels.triton.quant) and the tiled twin (quant.tiled_linear,
which decodes a tile of rows at a time into a reused buffer: the meaning of quant.reference_linear).

Each fast kernel (memra.kernels.triton, one module per family) has its pure-torch twin in
memra.kernels.reference, and a test between them. Dependencies point one way: the table imports the
families and the twins; the families import only the twins (reference, quant, split, cuts) and each other's
shared helpers; memra.kernels.exact (the self-test) imports the table.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from memra.kernels import cpu_decode, cpu_flin, cpu_gdn, cpu_qdot, quant, reference, split
from memra.kernels.slots import state_slots
from memra.kernels.triton_twins import triton_module, triton_ops
from memra.sampling import device_sample

GEMV_ROWS = 16  # the rows of triton.linear.LINEAR_BUCKETS' first bucket (its GEMV-shaped tile)

# The families the table calls as modules (attributes looked up per call), importable wherever
# triton_ops() is not None: each needs only Triton.
LINEAR_FAMILIES = {"bucket": "linear", "persistent": "linear_persistent", "shaped": "linear_shaped",
                   "cublas": "linear_cublas"}


def written(out: torch.Tensor | None, o: torch.Tensor) -> torch.Tensor:
    """o, or o copied into the caller's `out` where it gave one (the paths whose kernels cannot write there)."""
    return o if out is None else out.copy_(o)


def linear_module(family: str):
    """The module of a dense linear family (KernelTable.linear_family): its `linear` and `linear_silu_mul`."""
    return triton_module(LINEAR_FAMILIES[family])


@dataclass(frozen=True)
class KernelTable:
    """Which kernel every op runs for one model: fixed at load from its device and Settings."""

    invariant: bool  # the batch-invariant Triton kernels (matmuls, norms, delta rule, attention)
    triton: bool  # Triton is present and allowed (MEMRA_TRITON): the fused elementwise kernels (RoPE)
    exact: bool  # the exact path (MEMRA_EXACT)
    gdn_kernel: bool  # GDN's chunked prefill in Triton (MEMRA_GDN_KERNEL)
    sample_kernel: bool  # a batch's seeded sampling in one Triton launch (MEMRA_SAMPLE_KERNEL)
    sample_split: bool = True  # its rows' vocabularies in parts, then a combine launch (MEMRA_SAMPLE_SPLIT)
    sample_prune: bool = False  # blocks that cannot hold a row's best skip the exact scores (MEMRA_SAMPLE_PRUNE)
    rope_tile: bool = True  # the fused RoPE's programs take several heads each (MEMRA_ROPE_TILE)
    attn_short_rows: bool = False  # a split attention launch's one-split rows skip its combine (MEMRA_ATTN_SHORT_ROWS)
    attn_skip_empty: bool = True  # ... and its splits past a row's prefix write and read no partials (MEMRA_ATTN_SKIP_EMPTY)
    attn_split_walk: bool = True  # ... and where rows are many, a program walks its row's splits (MEMRA_ATTN_SPLIT_WALK)
    attn_walk_combine: bool = False  # ... and merges them itself, no combine launch (MEMRA_ATTN_WALK_COMBINE)
    inert_skip: bool = True  # the GDN step's programs of an inert padding row return at once (MEMRA_INERT_SKIP)
    moe_fused_act: bool = True  # the grouped experts' SwiGLU in their gate/up launch (MEMRA_MOE_FUSED_ACT)
    moe_fused_gate: bool = False  # the shared expert's sigmoid gate in their combine (MEMRA_MOE_FUSED_GATE)
    moe_front: bool = False  # router, shared gate and shared gate/up in one decode launch (MEMRA_MOE_FRONT)
    qdot: bool = False  # packed CPU linears as integer block dot products (MEMRA_CPU_QDOT; cpu_qdot)
    cpu_ops: bool = False  # CPU fp32 norms, SwiGLU and decode attention in C (MEMRA_CPU_DECODE; cpu_decode)
    flin: bool = False  # CPU fp32 dense linears on the row-invariant C kernel (MEMRA_CPU_FLIN; cpu_flin)
    persistent_linear: bool = False  # dense linears past 256 rows on the persistent kernel (MEMRA_LINEAR_PERSISTENT)
    shaped_linear: bool = False  # their tiles chosen from N and K as well as M (MEMRA_LINEAR_SHAPED)
    cublas_linear: bool = False  # past 64 rows on cuBLASLt without split-K, held to Triton's bits (MEMRA_LINEAR_CUBLAS)
    batched_logprobs: bool = False  # the sampler's logprobs over every asking row at once (MEMRA_BATCHED_LOGPROBS)
    # the decoded-tile buffer of this model's packed CPU linears (quant.Scratch)
    scratch: quant.Scratch = field(default_factory=quant.Scratch, compare=False, repr=False)

    @classmethod
    def build(cls, device: torch.device | str, settings) -> "KernelTable":
        cuda, cpu = torch.device(device).type == "cuda", torch.device(device).type == "cpu"
        triton = cuda and settings.triton and triton_ops() is not None
        persistent = triton and settings.exact and settings.linear_persistent
        if persistent:  # the descriptors' scratch, in the loading thread's context (others install it at launch)
            linear_module("persistent").install_scratch()
        return cls(invariant=triton and settings.exact, triton=triton, exact=settings.exact,
                   persistent_linear=persistent, shaped_linear=persistent and settings.linear_shaped,
                   cublas_linear=triton and settings.exact and settings.linear_cublas,
                   batched_logprobs=cuda and settings.batched_logprobs,
                   gdn_kernel=triton and settings.exact and settings.gdn_kernel,
                   sample_kernel=cuda and settings.sample_kernel and triton_ops() is not None,
                   sample_split=settings.sample_split, sample_prune=settings.sample_prune, rope_tile=settings.rope_tile,
                   attn_short_rows=settings.attn_short_rows, attn_skip_empty=settings.attn_skip_empty,
                   attn_split_walk=settings.attn_split_walk, attn_walk_combine=settings.attn_walk_combine,
                   inert_skip=settings.inert_skip,
                   moe_fused_act=settings.moe_fused_act, moe_fused_gate=settings.moe_fused_gate, moe_front=settings.moe_front,
                   qdot=cpu and settings.cpu_qdot, cpu_ops=cpu and settings.cpu_decode and cpu_qdot.library() is not None,
                   flin=cpu and settings.cpu_flin and settings.exact and cpu_qdot.library() is not None)

    # --- ops with no fast twin: elementwise, or never batch-shaped ---
    causal_attention = staticmethod(reference.causal_attention)
    gdn_chunk = staticmethod(reference.gdn_chunk)
    rope_cos_sin = staticmethod(reference.rope_cos_sin)

    def _gpu(self, x: torch.Tensor) -> bool:
        """Is x where the GPU kernels run? (CUDA; tests/test_interpreted_model.py answers yes for CPU
        tensors, to run the GPU path's kernels in Triton's interpreter.)"""
        return x.is_cuda

    def _impl(self, x: torch.Tensor):
        return triton_ops() if self.invariant and self._gpu(x) else reference

    def triton_path(self, x: torch.Tensor) -> bool:
        """Do the invariant Triton kernels take x here? (for a model's own layout choices, memra.model.ffn)"""
        return self._impl(x) is not reference

    def _cpu_ops(self, x) -> bool:
        """The C kernels of memra.kernels.cpu_decode run here (CPU, MEMRA_CPU_DECODE, the library built)."""
        return self.cpu_ops and not self._gpu(x)

    def grouped_moe_weights(self, w_gate_up) -> bool:
        """Do experts held as `w_gate_up` run as grouped matmuls here (no host sync, so a MoE step can be
        graphed)? Packed (GGUF) experts, and the torch table, take the per-expert loop."""
        return self.invariant and isinstance(w_gate_up, torch.Tensor)

    def _triton_on(self, x) -> bool:
        """Triton runs here (CUDA, allowed), in the exact and the fast path alike: for the kernels whose
        values are each a function of one token's inputs, so their bits never depend on the batch."""
        return self.triton and self._gpu(x)

    def _fused_rope(self, x) -> bool:
        # One fused launch instead of five (triton.rope) on 16-bit activations.
        return self._triton_on(x) and x.dtype in (torch.bfloat16, torch.float16)

    def _rope_heads(self) -> int:
        # heads a fused RoPE program takes (triton.rope.ROPE_TILE_HEADS behind MEMRA_ROPE_TILE): never the bits
        return triton_module("rope").ROPE_TILE_HEADS if self.rope_tile else 1

    def apply_rope(self, x, cos, sin):
        if self._fused_rope(x):
            return triton_ops().apply_rope(x, cos, sin, self._rope_heads())
        return reference.apply_rope(x, cos, sin)

    def rope_write_kv(self, q, k, v, cos, sin, k_pool, v_pool, rows):
        """Rotated q; k rotated and v written to the pool rows. Where the fused rope runs, one launch
        with its bits (apply_rope, then a copy); elsewhere the twin, which is that composition."""
        if self._fused_rope(q):
            return triton_ops().rope_write_kv(q, k, v, cos, sin, k_pool, v_pool, rows, self._rope_heads())
        return reference.rope_write_kv(q, k, v, cos, sin, k_pool, v_pool, rows)

    def linear(self, x, w, b=None):
        if isinstance(w, split.SPLIT_TYPES):  # packed: the fused kernel, or decoded a tile at a time
            if self._impl(x) is reference:
                if self.qdot and x.device.type == "cpu" and cpu_qdot.supports(w) and cpu_qdot.library() is not None:
                    return cpu_qdot.linear(x, w, b)
                return quant.tiled_linear(x, w, b, self.scratch, self.linear)  # tiles: the plain weight's linear
            return triton_module("quant").linear(x, w, b)
        if self.flin and not self._gpu(x) and cpu_flin.supports(x, w):  # CPU fp32: a row's bits at any row count
            return cpu_flin.linear(x, w, b)
        if self._impl(x) is reference:
            return reference.linear(x, w, b)
        return self._dense().linear(x, w, b)

    @property
    def linear_family(self) -> str:
        """The invariant dense linears' family (LINEAR_FAMILIES; the self-test's key): 'bucket' triton.linear,
        'persistent' its large calls persistent, 'shaped' the tiles chosen from the whole shape, 'cublas'
        cuBLASLt without split-K past 64 rows (configured, and its rows held to the Triton kernel's on the model's
        shapes, at load: memra.model.hybrid)."""
        return ("cublas" if self.cublas_linear else "shaped" if self.shaped_linear
                else "persistent" if self.persistent_linear else "bucket")

    def _dense(self):
        return linear_module(self.linear_family)

    def linear_add(self, x, w, residual):
        """residual + linear(x, w), with the bits of the two ops apart: the add in the invariant
        kernel's epilogue where it runs on a plain weight (one launch), else the two ops."""
        if isinstance(w, torch.Tensor) and self._impl(x) is not reference:
            return self._dense().linear(x, w, residual=residual)
        return residual + self.linear(x, w)

    def silu_mul(self, gate_up):
        """SwiGLU's activation: one Triton launch with torch's bits where the invariant kernels run
        (triton.activation), torch's two elementwise kernels elsewhere."""
        if self._cpu_ops(gate_up) and cpu_decode.rows_ok(gate_up):
            return cpu_decode.silu_mul_rows(gate_up)
        return self._impl(gate_up).silu_mul(gate_up)

    def linear_silu_mul(self, x, w_gate_up):
        """silu_mul(linear(x, w_gate_up)), with the bits of the two ops apart: the activation in the
        invariant projection's epilogue where it runs on a plain weight (one launch, no [T, 2F]
        product in memory), else the two ops. Not in the GEMV bucket (M <= 16): its 16-column tile is
        the narrowest, so a fused program there reads twice a plain one's bytes and half as many
        programs stream the weight (Llama-3-8B B=1 on the H200: 195.8 tok/s fused, 206.4 apart)."""
        rows = x.numel() // x.shape[-1]
        if isinstance(w_gate_up, torch.Tensor) and self._impl(x) is not reference and rows > GEMV_ROWS:
            return self._dense().linear_silu_mul(x, w_gate_up)
        return self.silu_mul(self.linear(x, w_gate_up))

    def rms_norm(self, x, w, eps, zero_centered):
        # On CPU in fp32 (MEMRA_CPU_DECODE) one C call whose order is its own (decode_reference.rms_rows):
        # in fp32 the two styles of norm are the same product (reference.rms_norm).
        if self._cpu_ops(x) and cpu_decode.rows_ok(x) and w.dtype == torch.float32:
            return cpu_decode.rms_rows(x, w, eps)
        return self._impl(x).rms_norm(x, w, eps, zero_centered)

    def add_rms_norm(self, h, delta, w, eps, zero_centered):
        if self._cpu_ops(h) and cpu_decode.rows_ok(h) and delta.dtype == w.dtype == torch.float32:
            return cpu_decode.rms_rows(h, w, eps, add=delta)
        return self._impl(h).add_rms_norm(h, delta, w, eps, zero_centered)

    def _conv(self, u):
        # the same for every GDN path of the model (triton.conv: a prompt's, a verify's and a decode
        # step's tokens then share their bits)
        return triton_module("conv") if self._triton_on(u) else reference

    def causal_conv(self, u, state, w):
        return self._conv(u).causal_conv(u, state, w)

    def causal_conv_pieces(self, u, pool, w, pieces):
        """causal_conv of several sequences' pieces (memra.kernels.pieces.RecurrentPieces), their saved
        inputs stepped in the pool: two launches for the wave."""
        return self._conv(u).causal_conv_pieces(u, pool, w, pieces)

    def causal_conv_step(self, u, states, w):
        return self._conv(u).causal_conv_step(u, states, w)

    def causal_conv_step_into(self, u, pool, slots, w):
        return self._conv(u).causal_conv_step_into(u, pool, slots, w)

    def gdn_heads(self, mixed, b, a, a_neg, dt_bias, n_k_heads, n_v_heads, dk, dv):
        """reference.gdn_heads; one Triton launch wherever Triton runs on CUDA (triton.gdn_heads), which
        every GDN path of a model then shares."""
        if self._triton_on(mixed):
            return triton_module("gdn_heads").gdn_heads(mixed, b, a, a_neg, dt_bias, n_k_heads, n_v_heads, dk, dv)
        if self._cpu_gdn(mixed, dk):  # q / k in C (cpu_gdn), v and the gates as the reference makes them
            q, k = cpu_gdn.heads_rows(mixed, n_k_heads, n_v_heads, dk)
            v = mixed[:, 2 * n_k_heads * dk:].reshape(mixed.shape[0], n_v_heads, dv).float()
            return (q, k, v, *cpu_gdn.gates_rows(b, a, a_neg, dt_bias))
        return reference.gdn_heads(mixed, b, a, a_neg, dt_bias, n_k_heads, n_v_heads, dk, dv)

    def _cpu_gdn(self, x, dk) -> bool:
        """GDN's q / k norms and its delta-rule steps in C (memra.kernels.cpu_gdn): CPU, MEMRA_CPU_DECODE, fp32.
        Decided by the model's dtype and head size, so every recurrent path of a model takes the same kernels."""
        return self._cpu_ops(x) and cpu_gdn.supports(x, dk)

    def gated_rms_norm(self, o, z, w, eps):
        return self._impl(z).gated_rms_norm(o, z, w, eps)

    def delta_rule_step(self, q, k, v, beta, g, s):
        if self._cpu_gdn(q, q.shape[-1]) and s.dtype == torch.float32:  # one C call, on a copy of the states
            new = s.contiguous().clone()
            lead = q.shape[:-2]
            o = cpu_gdn.step_rows(*(t.reshape(-1, *t.shape[len(lead):]) for t in (q, k, v, beta, g)),
                                  new.view(-1, *s.shape[-3:]))
            return o.view(*lead, *o.shape[1:]), new
        return self._impl(q).delta_rule_step(q, k, v, beta, g, s)

    def delta_rule_step_into(self, q, k, v, beta, g, pool, slots, out=None):
        """delta_rule_step on pool[slots], in place -> o: the graphed decode's states never leave the pool.
        out [B, H, Dv] fp32: where o goes (a mixed step's rows of one buffer for its decode rows and pieces)."""
        if self._cpu_gdn(q, q.shape[-1]) and pool.dtype == torch.float32 and pool.is_contiguous():
            return written(out, cpu_gdn.step_rows(q, k, v, beta, g, pool, state_slots(slots)))  # inert: scratch slot
        if self._impl(q) is reference:  # the twin steps an inert row's scratch slot
            return written(out, reference.delta_rule_step_into(q, k, v, beta, g, pool, slots))
        return triton_ops().delta_rule_step_into(q, k, v, beta, g, pool, slots, self.inert_skip, out)  # MEMRA_INERT_SKIP

    def delta_rule_scan(self, q, k, v, beta, g, s, every: bool = True):  # every=False: the C scan keeps the last
        if self._cpu_gdn(q, q.shape[-1]) and s.dtype == torch.float32:  # decode's own step, token after token
            return cpu_gdn.scan(q, k, v, beta, g, s, every)
        return self._impl(q).delta_rule_scan(q, k, v, beta, g, s)

    def _chunked_gdn(self, q):
        # The Triton form where the invariant kernels run (MEMRA_GDN_KERNEL=0 is the door back): same chunks
        # at the same absolute cuts as the reference's loop, so a token's bits still do not depend on its piece.
        return triton_module("gdn") if self.gdn_kernel and self._gpu(q) else reference

    def gdn_prefill(self, q, k, v, beta, g, state, pos0):
        return self._chunked_gdn(q).gdn_prefill(q, k, v, beta, g, state, pos0)

    def gdn_prefill_pieces(self, q, k, v, beta, g, pool, pieces, out=None):
        """gdn_prefill of several sequences' pieces (memra.kernels.pieces.RecurrentPieces), the states
        stepped in the pool [slots, Hv, Dk, Dv]: one launch pair for the wave where gdn_prefill is Triton. out: as
        delta_rule_step_into's."""
        if self._chunked_gdn(q) is reference:
            return written(out, reference.gdn_prefill_pieces(q, k, v, beta, g, pool, pieces))
        return triton_module("gdn").gdn_prefill_pieces(q, k, v, beta, g, pool, pieces, out)

    def gdn_recurrent(self, q, k, v, beta, g, state):
        if self._cpu_gdn(q, q.shape[-1]) and state.dtype == torch.float32 and state.is_contiguous():
            # B=1 decode: the state stepped where it lies, token by token (the caller's copy_ is then a no-op)
            outs = [cpu_gdn.step_rows(q[t:t + 1], k[t:t + 1], v[t:t + 1], beta[t:t + 1], g[t:t + 1], state[None])
                    for t in range(q.shape[0])]
            return torch.cat(outs), state
        return reference.gdn_recurrent(q, k, v, beta, g, state, step=self.delta_rule_step)

    def paged_attention_rows(self, q, k_pool, v_pool, rows, starts, lens, scale, max_len=None, out=None):
        # Attention has no cuBLAS form to compare against, so the fast path (MEMRA_EXACT=0) uses the paged
        # kernel too where Triton runs; its reference twin walks rows on the host and cannot be graphed.
        fast_cuda = self._gpu(q) and not self.exact and self.triton
        impl = triton_ops() if fast_cuda else self._impl(q)
        if impl is reference:  # the definition: row by row, no splits
            return written(out, reference.paged_attention_rows(q, k_pool, v_pool, rows, starts, lens, scale))
        return impl.paged_attention_rows(q, k_pool, v_pool, rows, starts, lens, scale, max_len, self.attn_short_rows, out,
                                         self.attn_skip_empty, self.attn_split_walk, self.attn_walk_combine)

    def fused_decode_attention(self, q, k_pool, cos) -> bool:
        """Does decode attention (one query a row) run as cpu_decode's one call, RoPE and K/V write in it?
        Decided per layer at its first call: on CPU with MEMRA_CPU_DECODE, the library built, fp32."""
        return self._cpu_ops(q) and cpu_decode.supports(q, k_pool, cos)

    def decode_attention(self, q, k, v, cos, sin, k_pool, v_pool, write_rows, read_rows, starts, lens, scale):
        """cpu_decode.attend_rows: q [R, Hq, D], k / v [R, Hkv, D] | None (unrotated; written to write_rows),
        cos / sin [R, Rd] -> [R, Hq, D] (each row over read_rows[starts[r]:][:lens[r]], or all of it)."""
        return cpu_decode.attend_rows(q, k, v, cos, sin, k_pool, v_pool, write_rows, read_rows, starts, lens, scale)

    def prefill_attention(self, q, k_pool, v_pool, rows, pos0, scale, window=None):
        return self._impl(q).prefill_attention(q, k_pool, v_pool, rows, pos0, scale, window)

    def prefill_attention_pieces(self, q, k_pool, v_pool, pieces, scale, window=None, out=None):
        """prefill_attention of several sequences' pieces (memra.kernels.pieces.AttentionPieces): one launch.
        out [N, Hq, D]: where the output goes (a mixed step's rows of one buffer for its decode rows and pieces)."""
        if self._impl(q) is reference:
            return written(out, reference.prefill_attention_pieces(q, k_pool, v_pool, pieces, scale, window))
        return triton_ops().prefill_attention_pieces(q, k_pool, v_pool, pieces, scale, window, out)

    def paged_decode_attention(self, q, k_pool, v_pool, rows, scale):
        return self._impl(q).paged_decode_attention(q, k_pool, v_pool, rows, scale)

    def sample_batch(self, logits, samps):
        """Each row's device_sample token, for logits [B, V] -> int64 [B] on the device. One Triton launch
        for the batch on CUDA (memra.kernels.triton.sampling; MEMRA_SAMPLE_KERNEL=0 turns it off), else
        device_sample row by row. On an H200 the launch gave device_sample's token in 128 of 128 rows of a
        248k vocabulary, in 5.8 ms against 45 ms row by row."""
        if self.sample_kernel and self._gpu(logits):
            return triton_module("sampling").sample_batch(logits, list(samps), self.sample_split, self.sample_prune)
        return torch.stack([device_sample(row, s) for row, s in zip(logits, samps)])

    def moe_route(self, router_logits, top_k, normalize, dtype, bias=None):
        """(weights, ids) of each token's experts: where the grouped MoE runs, two launches that also
        order each row's ids as moe_experts sums them (triton.moe.moe_route), else the reference. With a
        choice bias (Step's sigmoid routing) the reference's row-wise ops, each row's ids then sorted."""
        if bias is not None:
            weights, ids = reference.moe_route(router_logits, top_k, normalize, dtype, bias)
            ids, order = ids.sort(dim=-1)  # ascending, as the grouped kernels sum them
            return weights.gather(1, order), ids
        if self.invariant and self._gpu(router_logits):
            return triton_module("moe").moe_route(router_logits, top_k, normalize, dtype)
        return reference.moe_route(router_logits, top_k, normalize, dtype)

    def moe_experts(self, x, weights, ids, w_gate_up, w_down, shared=None, residual=None, act=None, scale=1.0,
                    shared_gate=None):
        """residual + (the routed experts' weighted sum (times `scale`) + shared), each add where given: in
        the grouped kernels' combine where they run (the adds' bits; ids from moe_route above, ascending),
        else torch's adds. shared_gate [T, 1]: the shared expert's gate logits, `shared` taken as
        torch.sigmoid(shared_gate) * shared (in the combine with MEMRA_MOE_FUSED_GATE, with those bits). `act`
        (Step's clamped SwiGLU) in place of SwiGLU; with it or a `scale`, the grouped kernels give the routed
        sum and torch makes the adds, in the reference's order (no host sync either way, so a Step step is
        captured as a Qwen MoE step is)."""
        grouped = self.grouped_moe_weights(w_gate_up) and self._gpu(x)
        if shared_gate is not None and not (grouped and self.moe_fused_gate and act is None and scale == 1.0):
            shared, shared_gate = torch.sigmoid(shared_gate) * shared, None  # torch's two launches
        if grouped:
            if act is None and scale == 1.0:
                return triton_module("moe").moe_experts(x, weights, ids, w_gate_up, w_down, shared=shared,
                                                        residual=residual, ascending=True, fused_act=self.moe_fused_act,
                                                        shared_gate=shared_gate)
            out = triton_module("moe").moe_experts(x, weights, ids, w_gate_up, w_down, ascending=True, act=act)
        else:
            out = reference.moe_experts(x, weights, ids, w_gate_up, w_down, linear_fn=self.linear,
                                         silu_mul_fn=act or self.silu_mul)
        out = out if scale == 1.0 else out * scale
        out = out if shared is None else out + shared
        return out if residual is None else residual + out
