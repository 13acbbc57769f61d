"""An fp32 model on the row-invariant linear (MEMRA_CPU_FLIN) decodes its rows stacked on CPU
(memra.decode_plan.cpu_rows_invariant): every row keeps the bits it has alone, GDN hybrids included (their gates
run in whole vectors: cpu_gdn.gates_rows), and the plan's on-model check fails where a row's gates do not."""

import pytest
import torch

from memra import counters
from memra.decode_plan import cpu_rows_invariant, decode_plan, verify_plan
from memra.kernels import cpu_flin, cpu_gdn, cpu_qdot, reference
from memra.settings import Settings

pytestmark = pytest.mark.skipif(cpu_qdot.library() is None, reason="no C++ compiler: the CPU kernels are off")


def hybrid(settings):
    """A 4-layer Qwen3.5 shape (three GDN layers, one attention), 64 wide, 4 value heads (the demo's: a
    row's gates are 4 values, all in torch's scalar tail when the row is alone), fp32."""
    import memra.random_model as rm
    from memra.model.hybrid import HybridModel

    cfg = rm._hybrid(4, 64, 2, 1, 32, 2, 4, 32, 128, 256)
    torch.manual_seed(0)
    return HybridModel(cfg, rm.random_weights(cfg, "cpu", torch.float32), torch.device("cpu"), torch.float32,
                       settings=settings)


def steps(model, group, prompts, n=2):
    caches = [model.new_cache(32) for _ in group]
    toks = [int(model.prime(prompts[i], c).argmax()) for i, c in zip(group, caches)]
    rows = []
    for _ in range(n):
        for c in caches:
            c.reserve(1)
        rows.append(model.decode_step_batch(toks, caches))
        toks = [int(r.argmax()) for r in rows[-1]]
    for c in caches:
        c.free()
    return torch.stack(rows, dim=1)  # [B, n, V]


def test_a_hybrids_rows_decode_stacked_with_their_bits_alone():
    model = hybrid(Settings())
    assert cpu_rows_invariant(model) and decode_plan(model) == "stacked"
    prompts = [[(7 * i + j) % 200 + 1 for j in range(2 + i % 9)] for i in range(20)]
    before, stacked_before = cpu_flin.outputs(cpu_flin.level()), counters.snapshot()["stacked_decode_forwards"]
    together = steps(model, range(20), prompts)
    assert counters.snapshot()["stacked_decode_forwards"] - stacked_before == 2  # the 20 rows, one forward a step
    assert cpu_flin.outputs(cpu_flin.level()) > before  # liveness: the linears ran on the C kernel
    for i in (0, 7, 19):
        assert torch.equal(steps(model, [i], prompts)[0], together[i]), i
    shut = model.with_doors(MEMRA_CPU_FLIN="0")  # MKL's linears: each row alone
    assert not cpu_rows_invariant(shut) and decode_plan(shut) == "row"


def test_the_plans_check_fails_on_gates_with_a_scalar_tail(monkeypatch):
    """The canary: torch's own gates (reference.gdn_gates: a lone row's four gates in scalar code, a batch's in
    Sleef vectors) change a row's bits with the batch, and verify_plan's 8 rows see it."""
    monkeypatch.setattr(cpu_gdn, "gates_rows", reference.gdn_gates)
    assert not verify_plan(hybrid(Settings()), "stacked")
    monkeypatch.undo()
    assert verify_plan(hybrid(Settings()), "stacked")


def test_gates_rows_bits_do_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(0)
    b, a = torch.randn(48, 4, generator=g) * 3, torch.randn(48, 4, generator=g) * 3
    a_neg, dt_bias = -torch.rand(4, generator=g) * 4, torch.randn(4, generator=g)
    beta, decay = cpu_gdn.gates_rows(b, a, a_neg, dt_bias)
    ref_beta, ref_decay = reference.gdn_gates(b, a, a_neg, dt_bias)
    assert torch.allclose(beta, ref_beta, rtol=1e-6) and torch.allclose(decay, ref_decay, rtol=1e-6)
    changed = 0
    for i in range(48):
        one = cpu_gdn.gates_rows(b[i : i + 1], a[i : i + 1], a_neg, dt_bias)
        assert torch.equal(one[0][0], beta[i]) and torch.equal(one[1][0], decay[i]), i
        ref_one = reference.gdn_gates(b[i : i + 1], a[i : i + 1], a_neg, dt_bias)
        changed += not (torch.equal(ref_one[0][0], ref_beta[i]) and torch.equal(ref_one[1][0], ref_decay[i]))
    assert changed  # the canary: torch's gates over the same rows do change with the batch


@pytest.mark.parametrize("half", [1, 3, 8, 12, 32])
def test_rotary_tables_are_elementwise_in_the_position(half):
    """A verify's columns (HybridModel.column_contexts) and a prefill wave take their rows of one table for
    all positions; a decode step makes its own one-row table: torch's CPU cos / sin must give a position the
    same bits either way (they run whole and partial vectors lane by lane)."""
    inv_freq = 1.0 / (10000 ** (torch.arange(half).float() / half))
    pos = torch.arange(0, 3000)
    cos, sin = reference.rope_cos_sin(pos, inv_freq, torch.float32)
    for i in range(0, 3000, 37):
        c1, s1 = reference.rope_cos_sin(pos[i : i + 1], inv_freq, torch.float32)
        assert torch.equal(c1[0], cos[i]) and torch.equal(s1[0], sin[i]), i
