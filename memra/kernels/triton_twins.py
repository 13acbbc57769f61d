"""The Triton families as the kernel table loads them (memra.kernels.table): imported on first use, not at the top,
since Triton is optional (absent on CPU-only machines, where the table never asks for them) and importing it
costs a CPU run time."""

from __future__ import annotations

import functools
import importlib
import types


@functools.cache
def triton_ops() -> types.SimpleNamespace | None:
    """The Triton twins of the batch-shaped ops under memra.kernels.reference's names (so the table can
    call either through one `_impl`), or None where Triton is not installed (CPU-only machines)."""
    try:
        from memra.kernels.triton import activation, attention, common, gdn, linear, norm, prefill_attention, rope
    except ImportError:
        return None
    common.count_compiles()
    return types.SimpleNamespace(
        linear=linear.linear, silu_mul=activation.silu_mul,
        rms_norm=norm.rms_norm, add_rms_norm=norm.add_rms_norm,
        gated_rms_norm=norm.gated_rms_norm,
        apply_rope=rope.apply_rope, rope_write_kv=rope.rope_write_kv,
        delta_rule_step=gdn.delta_rule_step, delta_rule_step_into=gdn.delta_rule_step_into,
        delta_rule_scan=gdn.delta_rule_scan,
        paged_attention_rows=attention.paged_attention_rows, paged_decode_attention=attention.paged_decode_attention,
        prefill_attention=prefill_attention.prefill_attention,
        prefill_attention_pieces=prefill_attention.prefill_attention_pieces,
    )


@functools.cache
def triton_module(name: str):
    """memra.kernels.triton.<name>, imported on first use (wherever the table asks for one, Triton is present)."""
    return importlib.import_module(f"memra.kernels.triton.{name}")
