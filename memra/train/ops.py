"""The training forward's kernel table: memra.kernels.reference's ops (every one autograd-capable torch), with
a sequence's K/V and GDN states held in `Box`es instead of the cache pools, so nothing is written in place.

The model's own layers (memra.model.block / attention / gdn) run unchanged over it: they call
`ops.rope_write_kv` with the pool tensors a step context names, read `ctx.cache.conv_state(layer)` and
`ssm_state(layer)`, and `.copy_` a new state into them. A `TrainCache` hands out boxes there; a box's `copy_`
rebinds it to the new tensor (autograd keeps every version it needs), and the ops below unwrap boxes and call
the reference op that the pool-backed path calls, on the same values.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from memra.kernels import reference
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
            self._ssm[layer] = Box(torch.zeros(g.n_v_heads, g.k_head_dim, g.v_head_dim, dtype=torch.float32,
                                               device=self.device))
        return self._ssm[layer]


def _append(box: Box, rows: torch.Tensor) -> None:
    """K or V rows [T, Hkv, D] after the ones the box holds (positions in order)."""
    box.t = rows if box.t is None else torch.cat((box.t, rows))


class TrainOps(KernelTable):
    """reference's ops on any device (never the Triton kernels, which have no backward), boxes for pools."""

    @classmethod
    def make(cls) -> "TrainOps":
        return cls(invariant=False, triton=False, exact=True, gdn_kernel=False, sample_kernel=False)

    def rope_write_kv(self, q, k, v, cos, sin, k_pool, v_pool, rows):
        _append(k_pool, reference.apply_rope(k, cos, sin))
        _append(v_pool, v)
        return reference.apply_rope(q, cos, sin)

    def prefill_attention(self, q, k_pool, v_pool, rows, pos0, scale, window=None):
        lo = window_start(pos0, window)  # rows are positions here: the reference's pool read, as a slice
        return reference.causal_attention(q, k_pool.t[lo : pos0 + q.shape[0]], v_pool.t[lo : pos0 + q.shape[0]],
                                          pos0 - lo, scale, window)

    def paged_decode_attention(self, q, k_pool, v_pool, rows, scale):
        return reference.causal_attention(q[None], k_pool.t[rows], v_pool.t[rows], rows.numel() - 1, scale)[0]

    def causal_conv(self, u, state, w):
        return reference.causal_conv(u, state.t, w)

    def gdn_prefill(self, q, k, v, beta, g, state, pos0):
        return reference.gdn_prefill(q, k, v, beta, g, state.t, pos0)

    def gdn_recurrent(self, q, k, v, beta, g, state):
        return reference.gdn_recurrent(q, k, v, beta, g, state.t)


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
