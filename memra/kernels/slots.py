"""The recurrent slot that a captured step's padding rows name (MEMRA_INERT_PADDING; memra.graphs.host_rows).

A graph replays a bucket of Bp rows for B live ones (memra.graphs). The Bp - B padding rows name the pools'
scratch slot, so the recurrent step kernels read and write a whole state for each of them, all at the same
addresses. That is harmless to the bits but not to the time: on one H100 the Qwen3.5-9B mixed step of 258 live
rows in a 384-row bucket spent 13.75 ms in the GDN state step against 10.14 ms for 256 rows and no padding,
and 2.07 against 0.44 ms in the conv step (tools/gpu_profile_steps.py, 2026-12-07). The padding is the
suspect, not yet the proven cause.

With the door open a padding row names INERT_SLOT + the scratch slot instead. The Triton step kernels
(triton.gdn.delta_rule_step_into, triton.conv.causal_conv_step_into) see an inert row and leave the state
alone: they neither read nor write it, and the row's output (which nothing reads) is computed from a zero
state. Every other implementation (the torch twins, the C kernels) steps the scratch slot the row names
(`state_slots`), as before. Either way no live row's state or output changes.
"""

from __future__ import annotations

INERT_SLOT = 1 << 40  # past every pool's slot count; a padding row's slot is this plus the scratch slot


def state_slots(slots):
    """The slots as the twins index the pool: an inert row's marker taken off (its scratch slot stepped as
    before), every live slot unchanged. slots: an int64 tensor or array."""
    return slots % INERT_SLOT
