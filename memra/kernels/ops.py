"""The op table the model calls. Which implementation runs is decided here and nowhere else,
because exactness depends on it:

- CPU, and CUDA with MEMRA_EXACT=0: the pure-torch reference (cuBLAS / ATen on CUDA), whose bits
  may depend on how many rows share a call.
- CUDA in exact mode with Triton present (and MEMRA_TRITON not 0): the batch-invariant Triton twins
  for every op whose torch form picks its algorithm from the row count (matmuls, row norms, the
  delta-rule step, decode attention). Elementwise ops stay in torch: the self-test checks that they
  give a value the same bits wherever it sits.

`invariant_kernels(device)` says whether the second table is live; the decode plan uses it to
decide whether B rows may run as one stacked forward (memra.decode_plan).

`moe_experts` runs as grouped matmuls (memra.kernels.moe_triton) wherever the invariant kernels run:
the same bits as the per-expert loop over the invariant linear, without the loop's host round trip.

`linear` also takes a GGUF-packed weight (memra.kernels.quant.QuantWeight): the same choice, between
the fused dequantizing kernels (quant_triton) and their pure-torch twin (quant.reference_linear).
"""

from __future__ import annotations

import functools

import torch

from memra import doors
from memra.kernels import quant, reference
from memra.kernels.reference import (  # ops with no fast twin: elementwise, or never batch-shaped
    causal_attention,
    causal_conv,
    causal_conv_step,
    gdn_chunk,
    gdn_gates,
    moe_route,
    rope_cos_sin,
    silu_mul,
)

__all__ = [
    "add_rms_norm", "apply_rope", "causal_attention", "causal_conv", "causal_conv_step", "delta_rule_scan", "delta_rule_step", "gated_rms_norm",
    "gdn_chunk", "gdn_gates", "gdn_prefill", "gdn_recurrent", "grouped_moe", "invariant_kernels", "l2_normalize", "linear", "moe_experts",
    "moe_route", "paged_attention_rows", "paged_decode_attention", "prefill_attention", "rms_norm", "rope_cos_sin",
    "sample_batch", "silu_mul",
]


@functools.cache
def _triton():
    """The Triton module, or None where Triton is not installed (CPU-only machines)."""
    try:
        from memra.kernels import triton_ops
    except ImportError:
        return None
    return triton_ops


def invariant_kernels(device: torch.device | str) -> bool:
    """Are the batch-invariant kernels the ones that run on this device now?"""
    return (torch.device(device).type == "cuda" and doors.flag("MEMRA_TRITON", True) and doors.exact_mode()
            and _triton() is not None)


def _impl(x: torch.Tensor):
    return _triton() if x.is_cuda and invariant_kernels(x.device) else reference


@functools.cache
def _quant_triton():
    from memra.kernels import quant_triton  # importable wherever triton_ops is (both need only Triton)

    return quant_triton


def apply_rope(x, cos, sin):
    # One fused launch instead of five (triton_ops._rope_kernel) wherever Triton runs on 16-bit
    # activations, in the exact and the fast path alike: elementwise, so its bits never depend on the batch.
    if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and doors.flag("MEMRA_TRITON", True) and _triton() is not None:
        return _triton().apply_rope(x, cos, sin)
    return reference.apply_rope(x, cos, sin)


def linear(x, w, b=None):
    if isinstance(w, quant.QuantWeight):  # packed GGUF bytes: the fused kernel, or its twin
        return (quant if _impl(x) is reference else _quant_triton()).linear(x, w, b)
    return _impl(x).linear(x, w, b)


def rms_norm(x, w, eps, zero_centered):
    return _impl(x).rms_norm(x, w, eps, zero_centered)


def add_rms_norm(h, delta, w, eps, zero_centered):
    return _impl(h).add_rms_norm(h, delta, w, eps, zero_centered)


def l2_normalize(x, eps=1e-6):
    return _impl(x).l2_normalize(x, eps)


def gated_rms_norm(o, z, w, eps):
    return _impl(z).gated_rms_norm(o, z, w, eps)


def delta_rule_step(q, k, v, beta, g, s):
    return _impl(q).delta_rule_step(q, k, v, beta, g, s)


def delta_rule_scan(q, k, v, beta, g, s):
    return _impl(q).delta_rule_scan(q, k, v, beta, g, s)


@functools.cache
def _gdn_triton():
    from memra.kernels import gdn_triton

    return gdn_triton


def gdn_prefill(q, k, v, beta, g, state, pos0):
    # The Triton form where the invariant kernels run (MEMRA_GDN_KERNEL=0 is the door back): same chunks
    # at the same absolute cuts as the reference's loop, so a token's bits still do not depend on its piece.
    if q.is_cuda and invariant_kernels(q.device) and doors.gdn_kernel():
        return _gdn_triton().gdn_prefill(q, k, v, beta, g, state, pos0)
    return reference.gdn_prefill(q, k, v, beta, g, state, pos0)


def gdn_recurrent(q, k, v, beta, g, state):
    return reference.gdn_recurrent(q, k, v, beta, g, state, step=delta_rule_step)


def paged_attention_rows(q, k_pool, v_pool, rows, starts, lens, scale, max_len=None):
    # Attention has no cuBLAS form to compare against, so the fast path (MEMRA_EXACT=0) uses the paged
    # kernel too where Triton runs; its reference twin walks rows on the host and cannot be graphed.
    fast_cuda = q.is_cuda and not doors.exact_mode() and doors.flag("MEMRA_TRITON", True) and _triton() is not None
    impl = _triton() if fast_cuda else _impl(q)
    if impl is reference:  # the definition: row by row, no splits
        return reference.paged_attention_rows(q, k_pool, v_pool, rows, starts, lens, scale)
    return impl.paged_attention_rows(q, k_pool, v_pool, rows, starts, lens, scale, max_len)


def prefill_attention(q, k_pool, v_pool, rows, pos0, scale):
    return _impl(q).prefill_attention(q, k_pool, v_pool, rows, pos0, scale)


def paged_decode_attention(q, k_pool, v_pool, rows, scale):
    return _impl(q).paged_decode_attention(q, k_pool, v_pool, rows, scale)


def sample_batch(logits, samps):
    """Each row's device_sample token, for logits [B, V] -> int64 [B] on the device. One Triton launch
    for the batch on CUDA (memra.kernels.sample_triton; MEMRA_SAMPLE_KERNEL=0 turns it off), else
    device_sample row by row. On an H200 the launch gave device_sample's token in 128 of 128 rows of a
    248k vocabulary, in 5.8 ms against 45 ms row by row (tools/gpu_kernel_check.py)."""
    from memra.sampling import device_sample

    if logits.is_cuda and doors.sample_kernel() and _triton() is not None:
        from memra.kernels import sample_triton

        return sample_triton.sample_batch(logits, list(samps))
    return torch.stack([device_sample(row, s) for row, s in zip(logits, samps)])


@functools.cache
def _moe_triton():
    from memra.kernels import moe_triton

    return moe_triton


def grouped_moe(device: torch.device | str) -> bool:
    """Does the MoE FFN run as grouped matmuls here (no host sync, so a MoE step can be graphed)?"""
    return invariant_kernels(device)


def moe_experts(x, weights, ids, w_gate_up, w_down):
    if x.is_cuda and grouped_moe(x.device) and not isinstance(w_gate_up, quant.QuantWeight):
        return _moe_triton().moe_experts(x, weights, ids, w_gate_up, w_down)
    return reference.moe_experts(x, weights, ids, w_gate_up, w_down, linear_fn=linear)
