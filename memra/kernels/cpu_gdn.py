"""GDN's decode step on CPU in C (memra/kernels/cpu/decode.cpp, in cpu_qdot's library), behind MEMRA_CPU_DECODE.

The torch form of one token of the gated delta rule (reference.delta_rule_step) is five ops over the state
[H, Dk, Dv] plus the l2 norms and head repeat of gdn_heads: on a small hybrid each is a few microseconds of
dispatch over a few KB. Here q / k's norms are one call (heads_rows) and the delta rule one call for every
row and head of a layer (step_rows), the state stepped where it lies (a sequence's cache or a pool slot).
The orders are decode_reference's (gdn_heads_rows, delta_rule_step), so a row's bits depend on its own
inputs and state alone: not on the batch, the rows beside it or the thread count. Every recurrent path of a
model (a decode step, a batch of them, a verify's scan) runs these same two calls, so they share bits.
"""

from __future__ import annotations

import torch

from memra import counters
from memra.kernels import cpu_qdot


def supports(x: torch.Tensor, dk: int) -> bool:
    """fp32 on CPU with key heads a multiple of 8 wide (the norm's eight lanes)."""
    return x.dtype == torch.float32 and x.device.type == "cpu" and dk % 8 == 0 and x.numel() > 0


def heads_rows(mixed: torch.Tensor, n_k_heads: int, n_v_heads: int, dk: int, eps: float = 1e-6):
    """mixed [N, C] (q | k | v conv outputs) -> q, k [N, Hv, Dk]: l2-normed, q * Dk^-0.5, each key head
    on its value heads (decode_reference.gdn_heads_rows' bits)."""
    lib = cpu_qdot.library()
    mixed = mixed.contiguous()
    n = mixed.shape[0]
    q, k = torch.empty(n, n_v_heads, dk), torch.empty(n, n_v_heads, dk)
    lib.memra_gdn_heads_rows(mixed.data_ptr(), n, mixed.shape[1], n_k_heads, n_v_heads, dk, eps,
                             float(torch.tensor(dk ** -0.5, dtype=torch.float32)), q.data_ptr(), k.data_ptr(),
                             lib.avx2)
    return q, k


FULL = 64  # elements of torch's widest unrolled vector loop on a CPU (2 x 16 fp32 lanes at AVX-512), twice over


def gates_rows(b: torch.Tensor, a: torch.Tensor, a_neg: torch.Tensor, dt_bias: torch.Tensor):
    """reference.gdn_gates (beta = sigmoid(b), decay = a_neg * softplus(a + dt_bias)) for b, a [N, Hv], with a
    row's bits whatever N. torch's CPU sigmoid and softplus run whole vectors (Sleef) and finish a call's last
    elements one by one in scalar code (another exp): at N = 1 a row of Hv = 4 gates is all tail, among many
    rows it is vector code. Here the gates run as one flat call padded to a multiple of FULL elements, so every
    gate is in a whole vector whatever N (tests/test_cpu_flin_plan.py: a row alone and among 40)."""
    n, h = b.shape
    pad = -(n * h) % FULL
    flat = lambda t: torch.cat((t.reshape(-1), t.new_zeros(pad)))  # noqa: E731  [n*h + pad] contiguous fp32
    beta = torch.sigmoid(flat(b.float()))[: n * h].view(n, h)
    decay = a_neg * torch.nn.functional.softplus(flat(a.float() + dt_bias))[: n * h].view(n, h)
    return beta, decay


def step_rows(q, k, v, beta, g, states: torch.Tensor, slots: torch.Tensor | None = None) -> torch.Tensor:
    """One token of the delta rule, the states stepped in place: q, k [R, H, Dk], v [R, H, Dv], beta, g
    [R, H] fp32; states [R, H, Dk, Dv] (slots None) or a pool [slots, H, Dk, Dv] read at slots [R] ->
    o [R, H, Dv] (decode_reference.delta_rule_step's bits)."""
    lib = cpu_qdot.library()
    r, h, dk = q.shape
    dv = v.shape[-1]
    assert states.is_contiguous() and states.dtype == torch.float32 and states.shape[-3:] == (h, dk, dv)
    q, k, v, beta, g = (t.float().contiguous() for t in (q, k, v, beta, g))
    slots = None if slots is None else slots.to(torch.int64).contiguous()
    o = torch.empty(r, h, dv)
    lib.memra_delta_rows(q.data_ptr(), k.data_ptr(), v.data_ptr(), beta.data_ptr(), g.data_ptr(), states.data_ptr(),
                         None if slots is None else slots.data_ptr(), r, h, dk, dv, o.data_ptr(),
                         torch.get_num_threads())
    counters.bump("cpu_gdn_steps")
    return o


def scan_rows(q, k, v, beta, g, state: torch.Tensor, every: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """A sequence's T tokens of the delta rule in one call, each token step_rows' arithmetic (so its bits):
    q, k [T, H, Dk], v [T, H, Dv], beta, g [T, H]; state [H, Dk, Dv] fp32 (not changed) -> (o [T, H, Dv],
    the state after each token [T, H, Dk, Dv]; every=False: after the last only, [1, H, Dk, Dv])."""
    lib = cpu_qdot.library()
    t, h, dk = q.shape
    dv = v.shape[-1]
    q, k, v, beta, g = (x.float().contiguous() for x in (q, k, v, beta, g))
    s = state.float().contiguous().clone()
    o, states = torch.empty(t, h, dv), (torch.empty(t, h, dk, dv) if every else None)
    lib.memra_delta_scan(q.data_ptr(), k.data_ptr(), v.data_ptr(), beta.data_ptr(), g.data_ptr(), s.data_ptr(), t, h,
                         dk, dv, o.data_ptr(), None if states is None else states.data_ptr(), torch.get_num_threads())
    counters.bump("cpu_gdn_steps", t)
    return o, (states if every else s[None])


def scan(q, k, v, beta, g, s, every: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """reference.delta_rule_scan's shapes (n sequences x T tokens: q, k [n, T, H, Dk], ...; s [n, H, Dk, Dv]),
    each sequence in one scan_rows call (a verify's tokens: decode's bits) -> (o [n, T, H, Dv], the states
    [n, T, H, Dk, Dv]; every=False: [n, 1, H, Dk, Dv], the last)."""
    outs = [scan_rows(q[i], k[i], v[i], beta[i], g[i], s[i], every) for i in range(q.shape[0])]
    if len(outs) == 1:  # a verify's one sequence: no copy of its states
        return outs[0][0][None], outs[0][1][None]
    return torch.stack([o for o, _ in outs]), torch.stack([st for _, st in outs])
