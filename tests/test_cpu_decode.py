"""The CPU decode step's C kernels besides the linears (memra.kernels.cpu_decode, cpu_layer; MEMRA_CPU_DECODE).

- decode attention, RMSNorm and SwiGLU against their pure-torch twin (memra.kernels.decode_reference),
  bit for bit, through the AVX2 and the scalar loops;
- a row's attention does not depend on the rows beside it or on the thread count;
- a dense layer's one-call decode step (cpu_layer) has the op-by-op path's bits, on Q8_0 and Q4_K models
  with q/k norms, and a model's logits do not change with the thread count;
- the door: off, the torch reference runs; on, the plans are live (liveness) and the exactness gate is green.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from memra import counters
from memra.gate import run_battery
from memra.kernels import cpu_decode, cpu_qdot, decode_reference, reference

pytestmark = pytest.mark.skipif(cpu_qdot.library() is None, reason="no C++ compiler to build the kernels")


def rnd(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def pools(hkv, d, blocks=8, block=16, seed=1):
    return rnd(blocks, block, hkv, d, seed=seed), rnd(blocks, block, hkv, d, seed=seed + 1) * 2


def tables(positions, rd):
    inv = 1.0 / (10000 ** (torch.arange(0, rd, 2).float() / rd))
    return reference.rope_cos_sin(torch.tensor(positions), inv, torch.float32)


def threads(n):
    """torch's (and so the kernels') thread count set to n for a block, then put back."""
    class Threads:
        def __enter__(self):
            self.was = torch.get_num_threads()
            torch.set_num_threads(n)

        def __exit__(self, *exc):
            torch.set_num_threads(self.was)
    return Threads()


@pytest.mark.parametrize("hq,hkv,d,rd", [(8, 2, 64, 64), (4, 4, 128, 32), (6, 3, 16, 16)])
@pytest.mark.parametrize("avx2", [True, False])
def test_attention_is_its_twin_bit_for_bit(hq, hkv, d, rd, avx2):
    """Three rows of lengths 1, 37 and 70 over shuffled pool rows (GQA groups of 4, 1 and 2; a partial
    RoPE): the K/V written and every output equal the twin's, and a large score spread (exp's floor)."""
    kp, vp = pools(hkv, d)
    read = torch.randperm(kp.shape[0] * kp.shape[1], generator=torch.Generator().manual_seed(3))
    starts, lens = [0, 1, 38], [1, 37, 70]
    write = torch.stack([read[a + n - 1] for a, n in zip(starts, lens)])
    q, k, v = rnd(3, hq, d, seed=4), rnd(3, hkv, d, seed=5), rnd(3, hkv, d, seed=6)
    q[2, 0] *= 40  # one head whose scores span more than exp's range
    cos, sin = tables([0, 36, 69], rd)
    kp2, vp2 = kp.clone(), vp.clone()
    got = cpu_decode.attend_rows(q, k, v, cos, sin, kp, vp, write, read, torch.tensor(starts), torch.tensor(lens),
                                 0.125, avx2=avx2)
    want = decode_reference.attend_rows(q, k, v, cos, sin, kp2, vp2, write, read, starts, lens, 0.125)
    assert torch.equal(kp, kp2) and torch.equal(vp, vp2)
    assert torch.equal(got, want)
    ref = reference.paged_attention_rows(reference.apply_rope(q, cos, sin), kp, vp, read, torch.tensor(starts),
                                         torch.tensor(lens), 0.125)
    assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()  # the torch reference to fp32 rounding


def test_a_rows_attention_does_not_depend_on_its_batch_or_the_threads():
    kp, vp = pools(2, 64)
    read = torch.arange(80)
    q = rnd(4, 8, 64, seed=7)
    starts, lens = torch.tensor([0, 0, 0, 0]), torch.tensor([80, 5, 33, 1])
    together = cpu_decode.attend_rows(q, None, None, None, None, kp, vp, None, read, starts, lens, 0.125)
    for r in range(4):
        for n in (1, 2, 3):
            with threads(n):
                alone = cpu_decode.attend_rows(q[r : r + 1], None, None, None, None, kp, vp, None, read[: lens[r]],
                                               None, None, 0.125)
            assert torch.equal(alone[0], together[r])


@pytest.mark.parametrize("avx2", [True, False])
def test_rms_norm_and_swiglu_are_their_twin_bit_for_bit(avx2):
    x, add, w = rnd(5, 1024, seed=8) * 3, rnd(5, 1024, seed=9), rnd(1024, seed=10).abs()
    x[1] = 0  # a zero row: r = 1 / sqrt(eps)
    assert torch.equal(cpu_decode.rms_rows(x, w, 1e-6, avx2=avx2), decode_reference.rms_rows(x, w, 1e-6))
    total, normed = cpu_decode.rms_rows(x, w, 1e-5, add=add, avx2=avx2)
    assert torch.equal(total, x + add) and torch.equal(normed, decode_reference.rms_rows(x + add, w, 1e-5))
    gu = rnd(3, 2 * 3000, seed=11) * 30  # gates past exp's floor both ways; F not a multiple of 8
    got = cpu_decode.silu_mul_rows(gu, avx2=avx2)
    assert torch.equal(got, decode_reference.silu_mul(gu))
    assert (got - reference.silu_mul(gu)).abs().max() <= 1e-6 * got.abs().max()


def tiny_model(quant, settings=None):
    """A 2-layer Llama of 256 wide with q/k norms (Qwen3's attention), packed in `quant`, random norms."""
    import memra.random_model as rm
    from memra.model.hybrid import HybridModel

    cfg = rm._llama(2, 256, 4, 2, 512, 512)
    cfg = dataclasses.replace(cfg, attn=dataclasses.replace(cfg.attn, qk_norm=True))
    w = rm.random_weights(cfg, "cpu", torch.float32, quant=quant)
    for k in w:
        if k.endswith("norm"):
            w[k] = rnd(*w[k].shape, seed=len(k)).abs() + 0.5
    return HybridModel(cfg, w, torch.device("cpu"), torch.float32, settings=settings)


def decode(model, n=5, ids=(3, 1, 4, 1, 5, 9, 2, 6)):
    cache = model.new_cache(32)
    rows = [model.prime(list(ids), cache)]
    for _ in range(n):
        cache.reserve(1)
        rows.append(model.decode_step(int(rows[-1].argmax()), cache))
    return torch.stack(rows)


@pytest.mark.parametrize("quant", ["q8_0", "q4_k"])
def test_the_one_call_layer_has_the_op_by_op_bits_at_any_thread_count(quant):
    from memra.settings import Settings

    model = tiny_model(quant, Settings(cpu_decode=True))
    opwise = model.with_settings(model.settings)  # a view of the same weights, its layers run op by op
    for b in opwise.blocks:
        b.layer_plan = False
    before = counters.snapshot()["cpu_layer_steps"]
    with threads(2):
        fused = decode(model)
    assert counters.snapshot()["cpu_layer_steps"] - before == 2 * 5  # liveness: both layers, every step, one call
    assert torch.equal(fused, decode(opwise))
    with threads(1):
        assert torch.equal(fused, decode(model))
    torch_path = decode(model.with_doors(MEMRA_CPU_DECODE="0"))
    assert not torch.equal(fused, torch_path)  # the door changes the arithmetic ...
    assert (fused[0] - torch_path[0]).abs().max() <= 0.05 * torch_path[0].abs().max()  # ... not the model


def test_gate_all_green_with_the_door_open_and_its_canary_fails():
    from memra.settings import Settings

    model = tiny_model("q8_0", Settings(cpu_decode=True))
    lines = []
    assert run_battery(model, steps=4, batch=3, mode="strict", plen=12, out=lines.append), "\n".join(lines)
    assert lines[-1].startswith("ALL GREEN") and all(b.layer_plan for b in model.blocks)
    lines = []
    assert not run_battery(model.with_doors(MEMRA_GATE_CANARY="1"), steps=4, batch=3, mode="strict", plen=12,
                           out=lines.append)
    assert lines[-1].startswith("FAILED")


def test_a_packed_dense_model_decodes_its_rows_stacked_each_with_its_bits_alone():
    """memra.decode_plan.cpu_rows_invariant: with the door open, a packed dense model's step runs B rows in one
    forward (the weights read once for all of them, as llama.cpp's batched decode does) and each row keeps the
    bits it has alone, which are the row plan's (one C call a layer). Liveness: one stacked forward for the
    step, not one a row. Where a kernel is not held to rows alone (the door shut: torch's ops; an fp32 weight:
    MKL picks its kernel by M) the plan stays per row."""
    from memra.decode_plan import cpu_rows_invariant, decode_plan
    from memra.settings import Settings

    model = tiny_model("q8_0", Settings(cpu_decode=True))
    assert cpu_rows_invariant(model) and decode_plan(model) == "stacked"
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7, 9], [3, 2], [3, 8, 4, 6, 2, 6]]

    def run(m, group):
        caches = [m.new_cache(32) for _ in group]
        firsts = [int(m.prime(prompts[i], c).argmax()) for i, c in zip(group, caches)]
        for c in caches:
            c.reserve(1)
        return m.decode_step_batch(firsts, caches)

    before = counters.snapshot()["stacked_decode_forwards"]
    stacked = run(model, range(5))
    assert counters.snapshot()["stacked_decode_forwards"] - before == 1  # the five rows in one forward
    for i in range(5):
        assert torch.equal(stacked[i], run(model, [i])[0]), i  # alone: the row form, one C call a layer
    assert torch.equal(stacked, run(model.with_doors(MEMRA_DECODE_PLAN="row"), range(5)))
    from memra.gate.score_arm import run_score_battery

    assert run_score_battery(model, steps=8, out=lambda line: None)  # E9 on the stacked plan (E4: the gate test)
    shut = model.with_doors(MEMRA_CPU_DECODE="0")
    assert not cpu_rows_invariant(shut) and decode_plan(shut) == "row"
    # an fp32 weight on MKL (MEMRA_CPU_FLIN=0) is not held to its rows; on the row-invariant linear it is
    assert not cpu_rows_invariant(tiny_model(None, Settings(cpu_decode=True, cpu_flin=False)))
    assert cpu_rows_invariant(tiny_model(None, Settings(cpu_decode=True)))
