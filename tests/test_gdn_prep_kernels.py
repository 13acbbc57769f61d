"""GDN's token preparation in Triton: the causal conv (memra.kernels.triton.conv) and the heads
(memra.kernels.triton.gdn_heads) against their twins (reference.causal_conv / causal_conv_step /
gdn_heads: within a rounding — Triton's exp), and against themselves (bit for bit): a token's bits do not
depend on the call, and a decode step, a verify's run of tokens and a prompt agree. On CPU the kernels
run in Triton's interpreter (tests/conftest.py); MEMRA_TEST_DEVICE=cuda compiles them."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from memra.kernels import reference  # noqa: E402
from memra.kernels.triton import conv as ck  # noqa: E402
from memra.kernels.triton import gdn_heads as gh  # noqa: E402

DEVICE = os.environ.get("MEMRA_TEST_DEVICE", "cpu")
HK, HV, DK, DV = 2, 6, 32, 24  # three value heads per key head; Dv not a power of two


def inputs(n, dtype=torch.bfloat16, seed=0):
    """The projection's output as the model splits it: mixed, b, a are column slices of one wide row."""
    g = torch.Generator().manual_seed(seed)
    conv = 2 * HK * DK + HV * DV
    wide = (torch.randn(n, conv + 7 + 2 * HV, generator=g) * 2).to(device=DEVICE, dtype=dtype)
    mixed, _, b, a = wide.split([conv, 7, HV, HV], dim=-1)
    a_neg = -torch.rand(HV, generator=g).to(DEVICE) * 4
    dt_bias = (torch.randn(HV, generator=g) * 3).to(DEVICE)
    return mixed.contiguous(), b, a, a_neg, dt_bias


def test_heads_match_the_twin():
    mixed, b, a, a_neg, dt_bias = inputs(37)
    got = gh.gdn_heads(mixed, b, a, a_neg, dt_bias, HK, HV, DK, DV)
    want = reference.gdn_heads(mixed, b, a, a_neg, dt_bias, HK, HV, DK, DV)
    for name, x, y in zip(("q", "k", "v", "beta", "decay"), got, want):
        assert x.dtype == torch.float32 and x.shape == y.shape, name
        err = ((x - y).abs().max() / y.abs().max()).item()
        assert err <= 4e-6, f"{name}: relative error {err:.3g}"
    assert torch.equal(got[2], want[2])  # v is a cast: exact


def test_softplus_keeps_its_tails():
    """Far below zero softplus(x) ~ e^x, which log(1 + e^x) would round to 0; above 20 it is x. (1e-5:
    on a GPU Triton's exp and log are the hardware's approximations, some ulps off.)"""
    x = torch.tensor([-60.0, -30.0, -17.0, -3.0, 0.0, 5.0, 19.9, 25.0, 80.0])
    hv = x.numel()  # one token, one key head over nine value heads: decay = -softplus(x) per head
    a = x[None, :].to(DEVICE)
    decay = gh.gdn_heads(torch.zeros(1, 2 * DK + hv * DV, device=DEVICE), a, a, -torch.ones(hv, device=DEVICE),
                         torch.zeros(hv, device=DEVICE), 1, hv, DK, DV)[4][0]
    assert torch.allclose(decay.double().cpu(), -torch.nn.functional.softplus(x.double()), rtol=1e-5, atol=0)


def test_a_token_does_not_depend_on_the_call():
    mixed, b, a, a_neg, dt_bias = inputs(70, seed=3)
    full = gh.gdn_heads(mixed, b, a, a_neg, dt_bias, HK, HV, DK, DV)
    for rows in (slice(0, 1), slice(5, 6), slice(20, 64)):
        part = gh.gdn_heads(mixed[rows], b[rows], a[rows], a_neg, dt_bias, HK, HV, DK, DV)
        for x, y in zip(part, full):
            assert torch.equal(x, y[rows])
    transposed = mixed.t().contiguous().t()  # as the conv over a prompt returns it: columns of unit stride
    for x, y in zip(gh.gdn_heads(transposed, b, a, a_neg, dt_bias, HK, HV, DK, DV), full):
        assert torch.equal(x, y)


def conv_inputs(t, c=300, kc=4, dtype=torch.bfloat16, seed=10):
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: (torch.randn(*shape, generator=g) * 2).to(device=DEVICE, dtype=dtype)  # noqa: E731
    return r(t, c), r(c, kc - 1), r(c, kc)


@pytest.mark.parametrize("t", [1, 2, 3, 9])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_matches_the_twin(dtype, t):
    """Prompts shorter than the window (the new state keeps some of the old one) and longer; u a column
    slice of a wider projection, as the model's split of w_in gives it."""
    u, state, w = conv_inputs(t, dtype=dtype)
    u = torch.cat((u, torch.zeros_like(u)), dim=1)[:, : u.shape[1]]  # row stride 2C, as a split view's
    out, new = ck.causal_conv(u, state, w)
    want, want_new = reference.causal_conv(u, state, w)
    assert torch.equal(new, want_new)  # the window's last inputs: a copy
    err = ((out.float() - want.float()).abs().max() / want.float().abs().max()).item()
    assert err <= (2 ** -8 if dtype == torch.bfloat16 else 1e-6), f"relative error {err:.3g}"


def test_decode_steps_verify_tokens_and_a_prompt_convolve_alike():
    """T steps of one row, its state in a pool slot, give the conv over the T tokens bit for bit (the
    verify's run of tokens, and a prompt), and leave the slot holding the conv's new state; the step's
    rows do not depend on each other."""
    u, state, w = conv_inputs(9, seed=11)
    whole, new = ck.causal_conv(u, state, w)
    pool = torch.zeros(4, *state.shape, dtype=state.dtype, device=DEVICE)
    pool[2] = state
    slot = torch.tensor([2], device=DEVICE)
    steps = torch.cat([ck.causal_conv_step_into(u[i : i + 1], pool, slot, w) for i in range(u.shape[0])])
    assert torch.equal(steps, whole) and torch.equal(pool[2], new)
    rows, others = conv_inputs(3, seed=12)[0], torch.randn(4, *state.shape, generator=torch.Generator().manual_seed(13))
    pool = others.to(device=DEVICE, dtype=state.dtype)
    alone = [ck.causal_conv_step(rows[i : i + 1], pool[s : s + 1], w) for i, s in enumerate((3, 0, 1))]
    table = torch.tensor([[9, 3], [9, 0], [9, 1]], device=DEVICE)  # slots as a graph passes them: a column
    together = ck.causal_conv_step_into(rows, pool, table[:, 1], w)
    assert torch.equal(together, torch.cat([o for o, _ in alone]))
    assert all(torch.equal(pool[s], st[0]) for s, (_, st) in zip((3, 0, 1), alone))
    assert torch.equal(pool[2], others[2].to(device=DEVICE, dtype=state.dtype))  # a slot no row named: untouched


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_pieces_of_several_sequences_convolve_as_they_would_alone(dtype):
    """Cross-request prefill: pieces of three sequences (1 and 2 tokens: shorter than the window, so
    the new saved inputs mix old ones and new; and 40 tokens) in one wave, their saved inputs in a
    pool's slots: each piece's outputs and new saved inputs are the bits of its own causal_conv call,
    the pool's other slots are untouched, and the twin's piece-by-piece definition agrees."""
    from memra.kernels.pieces import RecurrentPieces

    sizes, slots, kc = [1, 40, 2], [2, 0, 3], 4
    mixed, *_ = inputs(sum(sizes), dtype, seed=9)
    c = mixed.shape[1]
    g = torch.Generator().manual_seed(10)
    w = torch.randn(c, kc, generator=g).to(device=DEVICE, dtype=dtype)
    pool = torch.randn(5, c, kc - 1, generator=g).to(device=DEVICE, dtype=dtype)
    pieces = RecurrentPieces.of([0, 1, 41], sizes, [5, 0, 70], slots, pool.device)
    before, twin_pool = pool.clone(), pool.clone()
    out = ck.causal_conv_pieces(mixed, pool, w, pieces)
    twin = reference.causal_conv_pieces(mixed, twin_pool, w, pieces)
    for first, t, _, slot in pieces.spans:
        solo, state = ck.causal_conv(mixed[first : first + t], before[slot], w)
        assert torch.equal(out[first : first + t], solo)
        assert torch.equal(pool[slot], state)
    assert torch.equal(pool, twin_pool)  # saved inputs are copies: exact
    err = ((out.float() - twin.float()).abs().max() / twin.float().abs().max()).item()
    assert err <= (2 ** -8 if dtype == torch.bfloat16 else 1e-6), f"relative error {err:.3g}"
    for slot in (1, 4):
        assert torch.equal(pool[slot], before[slot])
