"""MEMRA_MOE_FRONT: a MoE layer's router, shared-expert gate and shared gate/up laid out as one tensor at load
(memra.model.ffn.merge_moe_fronts) and, with the door open, read in one launch at decode rows.

The layout changes no value; the one launch gives each part its own call's bits where the Triton kernel's tile
is the M bucket's whatever the weight's other rows (up to GEMV_ROWS rows). On CPU the GPU path's kernels run in
Triton's interpreter (its dot summed in float64 per tile, tests/conftest.py); MEMRA_TEST_DEVICE=cuda runs the
model comparison for real (tests/test_cuda_kernels.py holds the combine's gate bits)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from conftest import gpu_kernel_table, hf_dir
from cuda_marks import cuda_only
from memra import counters
from memra.model.ffn import FRONT, front_of, merge_moe_fronts

PROMPTS = [[5, 6, 7, 8, 9], [12, 13]]
DOORS = ({"MEMRA_MOE_FRONT": "0"}, {"MEMRA_MOE_FRONT": "1"}, {"MEMRA_MOE_FRONT": "1", "MEMRA_MOE_FUSED_GATE": "1"})


def _layer(rows=(6, 1, 8), e=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {f"layers.0.moe.{n}": torch.randn(r, e, generator=g) for n, r in zip(FRONT, rows)}


def test_the_three_weights_become_views_of_one_tensor_with_their_values():
    w = _layer()
    before = {k: v.clone() for k, v in w.items()}
    assert merge_moe_fronts(w) == 1
    front = front_of({k.rsplit(".", 1)[-1]: v for k, v in w.items()})
    assert front is not None and front.shape == (15, 4)
    assert all(torch.equal(w[k], before[k]) and w[k].is_contiguous() for k in w)
    w["layers.0.moe.router"].add_(1.0)  # an in-place update (memra.weights.update) writes the one tensor
    assert torch.equal(front[:6], before["layers.0.moe.router"] + 1.0)


def test_weights_that_do_not_fit_stay_apart_and_others_views_are_not_taken_for_a_front():
    w = _layer()
    w["layers.0.moe.shared_gate"] = w["layers.0.moe.shared_gate"].double()  # another dtype: apart
    assert merge_moe_fronts(w) == 0
    flat = torch.randn(40)  # a loader's one buffer: views of it, but not laid out as a front
    parts = {"router": flat[:24].view(6, 4), "shared_gate": flat[24:28].view(1, 4),
             "shared_gate_up": flat[32:40].view(2, 4)}
    assert front_of(parts) is None
    assert front_of({n: _layer()[f"layers.0.moe.{n}"] for n in FRONT}) is None  # plain tensors


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the interpreter runs the Triton kernels on CPU tensors")
def test_one_launch_for_the_front_keeps_a_models_bits(monkeypatch):
    """The qwen3_5_moe fixture on the GPU path's kernels (interpreted): prime and two decode steps give the same
    logits with the door shut and open; the merged path ran only with it open (counter), and the gate went
    through the combine with MEMRA_MOE_FUSED_GATE too."""
    from memra.kernels.table import KernelTable
    from memra.loading.checkpoint import load

    table = gpu_kernel_table()
    monkeypatch.setattr(KernelTable, "build", classmethod(lambda cls, device, settings: dataclasses.replace(
        table, moe_front=settings.moe_front, moe_fused_gate=settings.moe_fused_gate)))
    base = load(hf_dir("qwen3_5_moe"), device="cpu", tokenizer=False)  # merged at load: the table is invariant
    assert all(b.ffn.front is not None for b in base.blocks)
    got = []
    for doors in DOORS:
        model = base.with_doors(MEMRA_DECODE_PLAN="row", **doors)
        before = counters.snapshot()
        caches = [model.new_cache(32) for _ in PROMPTS]
        rows = [model.prime(p, c) for p, c in zip(PROMPTS, caches)]
        rows += [model.decode_step_batch([1 + s, 2 + s], caches) for s in range(2)]
        got.append(torch.cat([r.reshape(-1) for r in rows]))
        merged = counters.delta(before).get("moe_front_merged", 0)
        assert (merged > 0) == (doors["MEMRA_MOE_FRONT"] == "1"), (doors, merged)
    assert torch.equal(got[0], got[1]), "one launch for the front moved a model's logits"
    assert (got[2] - got[0]).abs().max() <= 1e-5 * got[0].abs().max()  # fp32: the interpreter's exp (numpy's)


@cuda_only
def test_one_launch_for_the_front_keeps_a_models_bits_on_the_gpu():
    """The same on a GPU, in bf16 (the qwen3_5_moe fixture, loaded on the exact CUDA path, so merged at load):
    the door shut, open, and open with MEMRA_MOE_FUSED_GATE give the same logits, bit for bit; the merged
    path ran with the door open (counter)."""
    import memra

    base = memra.load(hf_dir("qwen3_5_moe"), device="cuda", dtype="bfloat16", tokenizer=False)
    assert all(b.ffn.front is not None for b in base.blocks)
    got = []
    for doors in DOORS:
        model = base.with_doors(**doors)
        before = counters.snapshot()
        caches = [model.new_cache(64) for _ in range(4)]
        rows = list(model.prime_batch([[3 + i, 9, 27, 5, 11][: 2 + i] for i in range(4)], caches))
        rows += [model.decode_step_batch([20 + s + i for i in range(4)], caches) for s in range(2)]
        got.append(torch.cat([r.float().reshape(-1) for r in rows]))
        assert (counters.delta(before).get("moe_front_merged", 0) > 0) == (doors["MEMRA_MOE_FRONT"] == "1")
        for c in caches:
            c.free()
    assert torch.equal(got[0], got[1]) and torch.equal(got[0], got[2]), "the front's one launch moved the logits"

