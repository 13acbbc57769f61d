"""The training forward's kernel table: memra.kernels.reference's ops (every one autograd-capable torch), with
a sequence's K/V and GDN states held in `Box`es instead of the cache pools, so nothing is written in place.

The model's own layers (memra.model.block / attention / gdn) run unchanged over it: they call
`ops.rope_write_kv` with the pool tensors a step context names, read `ctx.cache.conv_state(layer)` and
`ssm_state(layer)`, and `.copy_` a new state into them. A `TrainCache` hands out boxes there; a box's `copy_`
rebinds it to the new tensor (autograd keeps every version it needs), and the ops below unwrap boxes and call
the reference op that the pool-backed path calls, on the same values.

Where the sampler's table runs the CPU's C kernels (MEMRA_CPU_DECODE: RMSNorm and SwiGLU over any rows, a
generated token's decode attention, GDN's q / k norms and a generated token's delta-rule step),
`TrainOps.mirror(model.ops)` runs them too, so the walk in the sampler's
grouping gives the sampler's bits: each through `CKernel`, whose forward is the C call itself and whose backward
is the gradient of the op's torch form (reference), recomputed (the two agree to fp32 rounding:
memra.kernels.decode_reference).
"""

from __future__ import annotations

from collections import defaultdict

import torch

from memra.kernels import cpu_decode, cpu_flin, cpu_gdn, reference
from memra.kernels.cuts import window_start
from memra.kernels.table import KernelTable


class Box:
    """A state a layer reads and replaces (`copy_` rebinds, never writes in place)."""

    def __init__(self, t: torch.Tensor | None = None):
        self.t = t

    def copy_(self, t: torch.Tensor) -> "Box":
        self.t = t
        return self


class _Kv:
    def __init__(self):
        self.k: dict[int, Box] = defaultdict(Box)
        self.v: dict[int, Box] = defaultdict(Box)


class TrainCache:
    """One sequence's state during one layer walk: K/V rows in position order, GDN conv and delta-rule states
    (zeros at the sequence's start, as a fresh cache slot holds them)."""

    rec = None

    def __init__(self, cfg, dtype: torch.dtype, device: torch.device):
        self.cfg, self.dtype, self.device = cfg, dtype, device
        self.kv = _Kv()
        self._conv: dict[int, Box] = {}
        self._ssm: dict[int, Box] = {}

    def conv_state(self, layer: int) -> Box:
        if layer not in self._conv:
            g = self.cfg.gdn
            self._conv[layer] = Box(torch.zeros(g.conv_dim, g.conv_kernel - 1, dtype=self.dtype, device=self.device))
        return self._conv[layer]

    def ssm_state(self, layer: int) -> Box:
        if layer not in self._ssm:
            g = self.cfg.gdn
            self._ssm[layer] = Box(torch.zeros(g.n_v_heads, g.k_head_dim, g.v_head_dim, dtype=g.state_torch_dtype,
                                               device=self.device))
        return self._ssm[layer]


def _append(box: Box, rows: torch.Tensor) -> None:
    """K or V rows [T, Hkv, D] after the ones the box holds (positions in order)."""
    box.t = rows if box.t is None else torch.cat((box.t, rows))


class CKernel(torch.autograd.Function):
    """Forward: `fast(*xs)` (a C kernel: no autograd of its own) on the inputs' values. Backward: the gradient
    of `ref(*xs)` (the same op in torch), recomputed at those inputs."""

    @staticmethod
    def forward(ctx, fast, ref, *xs):
        ctx.ref = ref
        ctx.save_for_backward(*xs)
        return fast(*xs)

    @staticmethod
    def backward(ctx, *grads):
        xs = [x.detach().requires_grad_(need) for x, need in zip(ctx.saved_tensors, ctx.needs_input_grad[2:])]
        wanted = [x for x in xs if x.requires_grad]
        with torch.enable_grad():
            out = ctx.ref(*xs)
        out = out if isinstance(out, tuple) else (out,)
        got = iter(torch.autograd.grad(out, wanted, grads, allow_unused=True) if wanted else ())
        return (None, None, *(next(got) if x.requires_grad else None for x in xs))


def _c(fast, ref, *xs):
    """fast(*xs) with ref's gradient where autograd records; the C call alone where it does not."""
    if torch.is_grad_enabled() and any(x.requires_grad for x in xs):
        return CKernel.apply(fast, ref, *xs)
    return fast(*xs)


class TrainOps(KernelTable):
    """reference's ops on any device (never the Triton kernels, which have no backward), boxes for pools; and
    the CPU's C kernels where `cpu_ops` (mirror)."""

    @classmethod
    def make(cls, cpu_ops: bool = False, flin: bool = False) -> "TrainOps":
        return cls(invariant=False, triton=False, exact=True, gdn_kernel=False, sample_kernel=False, cpu_ops=cpu_ops,
                   flin=flin)

    @classmethod
    def mirror(cls, table: KernelTable) -> "TrainOps":
        """The walk's table for a model whose sampler runs `table`: its C kernels where it has them."""
        return cls.make(cpu_ops=table.cpu_ops, flin=table.flin)

    def linear(self, x, w, b=None):
        """The sampler's row-invariant fp32 linear where it runs one (cpu_flin), with torch's gradient."""
        if self.flin and not self._gpu(x) and isinstance(w, torch.Tensor) and w.dtype == x.dtype == torch.float32:
            if b is None:
                return _c(lambda x, w: cpu_flin.linear(x.detach(), w.detach()), reference.linear, x, w)
            return _c(lambda x, w, b: cpu_flin.linear(x.detach(), w.detach(), b.detach()), reference.linear, x, w, b)
        return super().linear(x, w, b)

    def rms_norm(self, x, w, eps, zero_centered):
        if self._cpu_ops(x) and cpu_decode.rows_ok(x) and w.dtype == torch.float32:  # KernelTable.rms_norm's test
            return _c(lambda x, w: cpu_decode.rms_rows(x, w, eps),
                      lambda x, w: reference.rms_norm(x, w, eps, zero_centered), x, w)
        return reference.rms_norm(x, w, eps, zero_centered)

    def add_rms_norm(self, h, delta, w, eps, zero_centered):
        if self._cpu_ops(h) and cpu_decode.rows_ok(h) and delta.dtype == w.dtype == torch.float32:
            return _c(lambda h, d, w: cpu_decode.rms_rows(h, w, eps, add=d),
                      lambda h, d, w: reference.add_rms_norm(h, d, w, eps, zero_centered), h, delta, w)
        return reference.add_rms_norm(h, delta, w, eps, zero_centered)

    def silu_mul(self, gate_up):
        if self._cpu_ops(gate_up) and cpu_decode.rows_ok(gate_up):
            return _c(cpu_decode.silu_mul_rows, reference.silu_mul, gate_up)
        return reference.silu_mul(gate_up)

    def fused_decode_attention(self, q, k_pool, cos) -> bool:
        return self._cpu_ops(q) and k_pool.t is not None and cpu_decode.supports(q, k_pool.t, cos)

    def decode_attention(self, q, k, v, cos, sin, k_pool, v_pool, write_rows, read_rows, starts, lens, scale):
        """One generated token (R = 1) over the boxes' positions read_rows, as cpu_decode.attend_rows: its RoPE
        and K/V write are torch's bits (reference.rope_write_kv), so they run here and the kernel attends."""
        assert q.shape[0] == 1 and starts is None, "the walk runs one generated token a decode step"
        if k is not None:
            q = self.rope_write_kv(q, k, v, cos, sin, k_pool, v_pool, write_rows)
        elif cos is not None:
            q = reference.apply_rope(q, cos, sin)
        keys, values = k_pool.t, v_pool.t
        fast = lambda q, k, v: cpu_decode.attend_rows(q.contiguous(), None, None, None, None, k.contiguous(),  # noqa: E731
                                                      v.contiguous(), None, read_rows, None, None, scale)
        ref = lambda q, k, v: reference.causal_attention(q, k[read_rows], v[read_rows], read_rows.numel() - 1, scale)  # noqa: E731
        return _c(fast, ref, q, keys, values)

    def rope_write_kv(self, q, k, v, cos, sin, k_pool, v_pool, rows):
        _append(k_pool, reference.apply_rope(k, cos, sin))
        _append(v_pool, v)
        return reference.apply_rope(q, cos, sin)

    def prefill_attention(self, q, k_pool, v_pool, rows, pos0, scale, window=None):
        lo = window_start(pos0, window)  # rows are positions here: the reference's pool read, as a slice
        return reference.causal_attention(q, k_pool.t[lo : pos0 + q.shape[0]], v_pool.t[lo : pos0 + q.shape[0]],
                                          pos0 - lo, scale, window)

    def paged_decode_attention(self, q, k_pool, v_pool, rows, scale):
        # rows: the last rows.numel() positions, up to the one just appended (the box holds positions 0.. in
        # order): a slice, the same values and layout as the reference's gather, without its copy
        lo = k_pool.t.shape[0] - rows.numel()
        return reference.causal_attention(q[None], k_pool.t[lo:], v_pool.t[lo:], rows.numel() - 1, scale)[0]

    def causal_conv(self, u, state, w):
        return reference.causal_conv(u, state.t, w)

    def gdn_prefill(self, q, k, v, beta, g, state, pos0):
        return reference.gdn_prefill(q, k, v, beta, g, state.t, pos0)

    def gdn_heads(self, mixed, b, a, a_neg, dt_bias, n_k_heads, n_v_heads, dk, dv):
        """As the sampler's table: q / k normed in C where it runs them (every token, prompts too), v and the
        gates in torch."""
        if not self._cpu_gdn(mixed, dk):
            return reference.gdn_heads(mixed, b, a, a_neg, dt_bias, n_k_heads, n_v_heads, dk, dv)
        q, k = _c(lambda m: cpu_gdn.heads_rows(m, n_k_heads, n_v_heads, dk),
                  lambda m: reference.gdn_heads(m, b, a, a_neg, dt_bias, n_k_heads, n_v_heads, dk, dv)[:2], mixed)
        v = mixed[:, 2 * n_k_heads * dk:].reshape(mixed.shape[0], n_v_heads, dv).float()
        return (q, k, v, *cpu_gdn.gates_rows(b, a, a_neg, dt_bias))

    def delta_rule_step(self, q, k, v, beta, g, s):
        """A generated token's delta-rule step: the sampler's C step where it runs it (on a copy of the state;
        KernelTable.delta_rule_step), with the torch step's gradient."""
        if self._cpu_gdn(q, q.shape[-1]) and s.dtype == torch.float32:
            return _c(lambda *xs: KernelTable.delta_rule_step(self, *xs), reference.delta_rule_step, q, k, v, beta, g, s)
        return reference.delta_rule_step(q, k, v, beta, g, s)

    def gdn_recurrent(self, q, k, v, beta, g, state):
        return reference.gdn_recurrent(q, k, v, beta, g, state.t, step=self.delta_rule_step)


class SamplerValues(torch.autograd.Function):
    """Forward: the sampler's logprobs (computed without autograd, memra.train.exact). Backward: the gradient
    reaches the differentiable walk's logprobs of the same tokens (memra.train.walk), which are the same
    function of the weights computed in another order (their values agree to float rounding; a test holds
    the gradients to a float64 reference)."""

    @staticmethod
    def forward(ctx, walked: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
        return exact.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None
