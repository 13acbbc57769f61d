"""The grouped MoE kernels (memra.kernels.triton.moe) against the per-expert loop they replace.

Bits: with the invariant linear (triton.linear.linear) inside the loop, the grouped path must give the
loop's bits exactly, and a token's output must not depend on the other tokens of the call. Against
the pure-torch loop (torch's matmuls sum in another order) the tolerance is the linear tests' one.
On CPU the kernels run in Triton's interpreter (tests/conftest.py); MEMRA_TEST_DEVICE=cuda compiles them.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from memra.kernels import reference  # noqa: E402
from memra.kernels.triton import linear as tk  # noqa: E402
from memra.kernels.triton.activation import silu_mul  # noqa: E402
from memra.kernels.triton import moe as mk  # noqa: E402

DEVICE = os.environ.get("MEMRA_TEST_DEVICE", "cpu")
# Against the fp32 loop: bf16 rounds four times on the way (gate_up, SiLU*up, down, each partial sum),
# each up to 2^-9 of the value, and the largest values of those intermediates sit above the output's.
TOL = {torch.float32: 2e-5, torch.bfloat16: 2 ** -5}


def rnd(*shape, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(device=DEVICE, dtype=dtype)


def layer(dtype, n_experts=6, e=64, f=48, seed=0):
    return (rnd(n_experts, 2 * f, e, dtype=dtype, seed=seed, scale=0.2),
            rnd(n_experts, e, f, dtype=dtype, seed=seed + 1, scale=0.2),
            rnd(n_experts, e, dtype=dtype, seed=seed + 2))


def route(x, router, top_k):
    return reference.moe_route(reference.linear(x.float(), router.float()), top_k, True, x.dtype)


def same_bits(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def test_plan_covers_every_pair_once_in_single_expert_tiles():
    g = torch.Generator().manual_seed(3)
    ids = torch.stack([torch.randperm(9, generator=g)[:3] for _ in range(23)]).sort(dim=1).values.to(DEVICE)
    plan = mk.plan_groups(ids, 9, (4, 16, 16, 4, 1))
    flat = ids.reshape(-1).cpu()
    seen = torch.zeros(flat.numel(), dtype=torch.int64)
    for e_, a, b in zip(plan.tile_expert.tolist(), plan.tile_start.tolist(), plan.tile_stop.tolist()):
        assert b - a <= 4
        for p in range(a, b):
            pair = int((plan.sorted_pos.cpu() == p).nonzero())  # the (t, j) pair at sorted position p
            assert flat[pair] == e_ and int(plan.token_of[p]) == pair // 3
            seen[pair] += 1
    assert torch.equal(seen, torch.ones_like(seen))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("top_k", [1, 3])
def test_grouped_equals_the_expert_loop_bit_for_bit(dtype, top_k):
    w_gate_up, w_down, router = layer(dtype)
    x = rnd(11, 64, dtype=dtype, seed=7)
    weights, ids = route(x, router, top_k)
    got = mk.moe_experts(x, weights, ids, w_gate_up, w_down)
    same_bits(got, reference.moe_experts(x, weights, ids, w_gate_up, w_down, linear_fn=tk.linear, silu_mul_fn=silu_mul))
    want = reference.moe_experts(x.float(), weights.float(), ids, w_gate_up.float(), w_down.float())
    err = ((got.float() - want).abs().max() / want.abs().max()).item()
    assert err <= TOL[dtype], f"relative error {err:.3g} against the pure-torch loop"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_token_does_not_depend_on_its_batchmates(dtype):
    w_gate_up, w_down, router = layer(dtype, n_experts=5, seed=10)
    x = rnd(40, 64, dtype=dtype, seed=11)
    weights, ids = route(x, router, 2)
    full = mk.moe_experts(x, weights, ids, w_gate_up, w_down)
    for rows in ([0], [17], [3, 4, 5], list(range(20, 40))):
        for per_pair in (False, True):  # a tile per expert's pairs, or per pair (a decode step's plan)
            same_bits(mk.moe_experts(x[rows], weights[rows], ids[rows], w_gate_up, w_down, per_pair), full[rows])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_activation_in_the_gate_up_launch_keeps_the_bits(dtype):
    """MEMRA_MOE_FUSED_ACT: SwiGLU's activation in the grouped gate/up launch's epilogue, against the launch then
    silu_mul, bit for bit: per expert's pairs and per pair, with the combine's two adds; and the fused launch
    alone against the two (liveness: its output is [P, F], the activation's)."""
    w_gate_up, w_down, router = layer(dtype, n_experts=5, seed=20)
    x, shared, residual = (rnd(13, 64, dtype=dtype, seed=s) for s in (21, 22, 23))
    weights, ids = route(x, router, 2)
    for per_pair in (False, True):
        want = mk.moe_experts(x, weights, ids, w_gate_up, w_down, per_pair, shared=shared, residual=residual)
        same_bits(mk.moe_experts(x, weights, ids, w_gate_up, w_down, per_pair, shared=shared, residual=residual,
                                 fused_act=True), want)
    plan = mk.plan_groups(ids, 5, mk.tile_config(26, 5, x.element_size()))
    fused = mk.grouped_linear(x, w_gate_up, plan, gather=True, swiglu=True)
    assert fused.shape == (26, 48)
    same_bits(fused, silu_mul(mk.grouped_linear(x, w_gate_up, plan, gather=True)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_shared_experts_gate_in_the_combine_keeps_torchs_bits(dtype):
    """MEMRA_MOE_FUSED_GATE: the shared expert scaled by sigmoid(its gate logit) in the combine, against torch's
    `torch.sigmoid(g) * shared` handed to the combine, per expert's pairs and per pair, with the residual add.
    bf16: the same bits here (the sigmoid's fp32 value rounds to bf16 the same way whichever exp computed it).
    fp32: the interpreter's exp is numpy's, torch's CPU sigmoid another, so up to one ulp of the gate apart;
    on the GPU both take CUDA's expf, and tests/test_cuda_kernels.py holds the bits in both dtypes.
    Liveness: the gate moves the output (logits of both signs, up to about 6)."""
    w_gate_up, w_down, router = layer(dtype, n_experts=5, seed=40)
    x, shared, residual = (rnd(13, 64, dtype=dtype, seed=s) for s in (41, 42, 43))
    gate = rnd(13, 1, dtype=dtype, seed=44, scale=3.0)
    weights, ids = route(x, router, 2)
    for per_pair in (False, True):
        want = mk.moe_experts(x, weights, ids, w_gate_up, w_down, per_pair, shared=torch.sigmoid(gate) * shared,
                              residual=residual)
        got = mk.moe_experts(x, weights, ids, w_gate_up, w_down, per_pair, shared=shared, residual=residual,
                             shared_gate=gate)
        if dtype == torch.bfloat16:
            same_bits(got, want)
        else:
            assert (got - want).abs().max() <= 4 * torch.finfo(dtype).eps * want.abs().max()
        ungated = mk.moe_experts(x, weights, ids, w_gate_up, w_down, per_pair, shared=shared, residual=residual)
        assert not torch.equal(got, ungated)


def test_a_few_rows_take_a_tile_per_pair_with_the_loops_bits():
    """The default for a decode step of a 256-expert layer: no sort, no tile table; still the loop's bits,
    with two rows sharing an expert."""
    w_gate_up, w_down, _ = layer(torch.bfloat16, n_experts=16, seed=30)
    x = rnd(2, 64, dtype=torch.bfloat16, seed=31)
    ids = torch.tensor([[1, 4], [4, 9]], device=DEVICE)
    weights = torch.tensor([[0.7, 0.3], [0.25, 0.75]], device=DEVICE, dtype=torch.bfloat16)
    plan = mk.plan_pairs(ids, (1, 16, 16, 4, 1))
    assert plan.per_pair and plan.tile_expert.tolist() == [1, 4, 4, 9] and plan.pairs == 4  # no tables: no launches
    same_bits(mk.moe_experts(x, weights, ids, w_gate_up, w_down),  # 4 pairs x 4 <= 16 experts: per pair
              reference.moe_experts(x, weights, ids, w_gate_up, w_down, linear_fn=tk.linear, silu_mul_fn=silu_mul))


def test_slot_order_does_not_matter():
    """Routers hand slots in weight order; the kernels add them in expert order, as the loop does."""
    w_gate_up, w_down, router = layer(torch.bfloat16, seed=20)
    x = rnd(6, 64, dtype=torch.bfloat16, seed=21)
    weights, ids = route(x, router, 3)
    flipped = mk.moe_experts(x, weights.flip(1), ids.flip(1), w_gate_up, w_down)
    same_bits(flipped, mk.moe_experts(x, weights, ids, w_gate_up, w_down))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_combine_takes_the_blocks_two_adds_with_their_bits(dtype):
    """residual + (experts + shared) in the combine: the bits of the loop's sum and torch's two adds,
    with a tile per expert and a tile per pair."""
    w_gate_up, w_down, router = layer(dtype, seed=50)
    x = rnd(9, 64, dtype=dtype, seed=51)
    shared, residual = rnd(9, 64, dtype=dtype, seed=52), rnd(9, 64, dtype=dtype, seed=53, scale=8.0)
    weights, ids = route(x, router, 2)
    loop = reference.moe_experts(x, weights, ids, w_gate_up, w_down, linear_fn=tk.linear, silu_mul_fn=silu_mul)
    for per_pair in (False, True):
        got = mk.moe_experts(x, weights, ids, w_gate_up, w_down, per_pair, shared=shared, residual=residual)
        same_bits(got, residual + (loop + shared))
        same_bits(mk.moe_experts(x, weights, ids, w_gate_up, w_down, per_pair, shared=shared), loop + shared)


@pytest.mark.parametrize("normalize", [True, False])
def test_the_route_kernel_chooses_the_references_experts_in_ascending_order(normalize):
    """moe_route in two launches: each row's experts are the reference's top k (among equal ones the
    lower ids, where torch.topk's choice is unspecified),
    written in ascending id with their weights (to the dtype's last place: the renormalising sum adds
    in another order); a row's choice alone is its choice in the call; the grouped FFN over them is
    the FFN over the reference's routing."""
    logits = rnd(37, 40, dtype=torch.float32, seed=40, scale=3.0)
    logits[3, :] = 0.5  # every expert tied: the lowest ids
    weights, ids = mk.moe_route(logits, 6, normalize, torch.bfloat16)
    ref_w, ref_ids = reference.moe_route(logits, 6, normalize, torch.bfloat16)
    order = ref_ids.sort(dim=1)
    others = [r for r in range(37) if r != 3]  # row 3: torch.topk picks among ties as it likes
    assert torch.equal(ids[others], order.values[others])
    assert ids[3].tolist() == list(range(6))
    want = ref_w.gather(1, order.indices).float()[others]
    assert ((weights[others].float() - want).abs() <= want.abs() * 2 ** -7).all()
    alone_w, alone_ids = mk.moe_route(logits[5:6].clone(), 6, normalize, torch.bfloat16)
    same_bits(alone_w, weights[5:6])
    assert torch.equal(alone_ids, ids[5:6])
    w_gate_up, w_down, _ = layer(torch.bfloat16, n_experts=40, seed=41)
    x = rnd(37, 64, dtype=torch.bfloat16, seed=42)
    same_bits(mk.moe_experts(x, weights, ids, w_gate_up, w_down, ascending=True),
              mk.moe_experts(x, weights, ids, w_gate_up, w_down))
