"""GDN's CPU decode kernels (memra.kernels.cpu_gdn; MEMRA_CPU_DECODE) against their pure-torch twin
(memra.kernels.decode_reference.gdn_heads_rows, delta_rule_step), bit for bit:

- q / k's l2 norms and head repeat, and one token of the delta rule with the state stepped in place;
- a row's bits do not depend on the rows beside it, its pool slot or the thread count;
- the door: a Qwen3.5-shaped model's decode runs the kernels (liveness) and its logits do not change with
  the thread count; with the door shut the torch reference runs.
"""

from __future__ import annotations

import pytest
import torch

from memra.kernels import cpu_gdn, cpu_qdot, decode_reference, reference
from test_cpu_decode import decode, rnd, threads  # the dense kernels' test helpers

pytestmark = pytest.mark.skipif(cpu_qdot.library() is None, reason="no C++ compiler to build the kernels")




def inputs(r, hk, hv, dk, dv, seed=0):
    """Conv outputs, gates (the model's own: reference.gdn_gates) and states for r rows."""
    mixed = rnd(r, 2 * hk * dk + hv * dv, seed=seed)
    beta, g = reference.gdn_gates(rnd(r, hv, seed=seed + 1), rnd(r, hv, seed=seed + 2) * 3,
                                  -torch.rand(hv, generator=torch.Generator().manual_seed(seed + 3)) * 4,
                                  rnd(hv, seed=seed + 4))
    g[0, 0] = -100.0  # below exp's floor: the state is wiped
    return mixed, beta, g, rnd(r, hv, dk, dv, seed=seed + 5)


@pytest.mark.parametrize("hk,hv,dk,dv", [(2, 4, 16, 8), (2, 2, 32, 24), (1, 3, 8, 16)])
def test_gdn_heads_and_delta_step_are_their_twin_bit_for_bit(hk, hv, dk, dv):
    mixed, beta, g, s = inputs(3, hk, hv, dk, dv)
    q, k = cpu_gdn.heads_rows(mixed, hk, hv, dk)
    tq, tk = decode_reference.gdn_heads_rows(mixed, hk, hv, dk)
    assert torch.equal(q, tq) and torch.equal(k, tk)
    assert torch.allclose(q, reference.gdn_heads(mixed, beta, beta, torch.zeros(hv), torch.zeros(hv), hk, hv, dk, dv)[0],
                          atol=1e-6)  # the torch reference's values, to rounding
    v = mixed[:, 2 * hk * dk:].reshape(3, hv, dv)
    state = s.clone()
    o = cpu_gdn.step_rows(q, k, v, beta, g, state)
    to, ts = decode_reference.delta_rule_step(tq, tk, v, beta, g, s)
    assert torch.equal(o, to) and torch.equal(state, ts)
    ro, rs = reference.delta_rule_step(tq, tk, v, beta, g, s)
    assert torch.allclose(o, ro, atol=1e-5) and torch.allclose(state, rs, atol=1e-5)
    assert not torch.equal(o, ro)  # canary: the twin is not torch's order, so the comparison can fail


def test_a_rows_delta_step_does_not_depend_on_its_batch_slot_or_the_threads():
    hk, hv, dk, dv = 2, 4, 16, 16
    mixed, beta, g, s = inputs(5, hk, hv, dk, dv, seed=7)
    q, k = cpu_gdn.heads_rows(mixed, hk, hv, dk)
    v = mixed[:, 2 * hk * dk:].reshape(5, hv, dv)
    alone = s[3:4].clone()
    with threads(1):
        o1 = cpu_gdn.step_rows(q[3:4], k[3:4], v[3:4], beta[3:4], g[3:4], alone)
    pool = torch.zeros(9, hv, dk, dv)
    slots = torch.tensor([8, 0, 5, 2, 6])
    pool[slots] = s
    with threads(2):
        o5 = cpu_gdn.step_rows(q, k, v, beta, g, pool, slots)
    assert torch.equal(o5[3], o1[0]) and torch.equal(pool[2], alone[0])
    assert torch.equal(pool[1], torch.zeros(hv, dk, dv))  # slots not named are untouched


def tiny_hybrid(settings, quant=None):
    """A 4-layer Qwen3.5 shape (three GDN layers, one attention) of 128 wide, fp32."""
    import memra.random_model as rm
    from memra.model.hybrid import HybridModel

    cfg = rm._hybrid(4, 128, 2, 1, 64, 2, 4, 32, 256, 512)
    torch.manual_seed(0)
    w = rm.random_weights(cfg, "cpu", torch.float32, quant=quant)
    return HybridModel(cfg, w, torch.device("cpu"), torch.float32, settings=settings)


@pytest.mark.parametrize("quant", [None, "q8_0"])
def test_a_hybrids_decode_runs_the_kernels_at_any_thread_count(quant):
    from memra import counters
    from memra.settings import Settings

    from memra.decode_plan import decode_plan

    model = tiny_hybrid(Settings(cpu_decode=True), quant)
    decode_plan(model)  # the plan's on-model check (its own steps) before the count
    before = counters.snapshot()["cpu_gdn_steps"]
    with threads(2):
        on = decode(model)
    assert counters.snapshot()["cpu_gdn_steps"] - before == 3 * 5  # liveness: three GDN layers, every step
    with threads(1):
        assert torch.equal(on, decode(model))
    before = counters.snapshot()["cpu_gdn_steps"]
    off = decode(model.with_doors(MEMRA_CPU_DECODE="0"))
    assert counters.snapshot()["cpu_gdn_steps"] == before  # door shut: the torch reference
    assert not torch.equal(on, off) and (on - off).abs().max() <= 0.05 * off.abs().max()


def test_gate_all_green_on_a_hybrid_with_the_door_open():
    """Batch, chunking, verify (the delta rule's scan) and cache state against B=1, strict, on the C kernels."""
    from memra.gate import run_battery
    from memra.settings import Settings

    from memra import counters

    model = tiny_hybrid(Settings(cpu_decode=True))
    lines = []
    before = counters.snapshot()["cpu_gdn_steps"]
    assert run_battery(model, steps=4, batch=3, mode="strict", plen=12, out=lines.append), "\n".join(lines)
    assert lines[-1].startswith("ALL GREEN") and counters.snapshot()["cpu_gdn_steps"] - before > 100


def test_a_qwen35_gguf_with_one_value_head_a_key_head_keeps_ssm_out_packed(tmp_path):
    """qwen35 files tile ssm_out's value-head columns; with r = 1 the tiled order is the grouped one, so
    the loader keeps it packed (not decoded to fp32: 3.6x its bytes, read every token) with the bits of
    the file decoded at load through the tiled twin."""
    import shutil
    from pathlib import Path

    import transformers

    from memra.convert import convert
    from memra.kernels.split import Q8Split
    from memra.loading.checkpoint import load

    src = tmp_path / "hf"
    shutil.copytree(Path(__file__).parent / "fixtures" / "hf" / "qwen3_5", src,
                    ignore=shutil.ignore_patterns("*.safetensors"))
    cfg = transformers.AutoConfig.from_pretrained(src)
    cfg.update(dict(linear_num_value_heads=cfg.linear_num_key_heads, hidden_size=64))
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(src)
    path = convert(src, tmp_path / "r1-q8_0.gguf", "q8_0")
    packed, plain = (load(path, device="cpu", tokenizer=False, packed_weights=p) for p in (None, False))
    wos = [k for k in packed._weights if k.endswith("gdn.wo")]
    assert wos and all(isinstance(packed._weights[k], Q8Split) for k in wos)
    packed = packed.with_doors(MEMRA_CPU_QDOT="0")
    ids = list(range(10, 22))
    ca, cb = packed.new_cache(64), plain.new_cache(64)
    a, b = packed.prime(ids, ca), plain.prime(ids, cb)
    assert torch.equal(a, b)
    for _ in range(3):
        tok = int(a.argmax())
        ca.reserve(1)
        cb.reserve(1)
        a, b = packed.decode_step(tok, ca), plain.decode_step(tok, cb)
        assert torch.equal(a, b)


@pytest.mark.parametrize("quant", [None, "q8_0"])
def test_b8_decode_rows_are_their_b1_rows_with_the_door_open(quant):
    """Eight sequences decoded together (decode_step_batch: one stacked forward in fp32) give each row the
    logits it gets decoded alone, bit for bit, for three steps, on the C kernels."""
    from memra import counters
    from memra.settings import Settings

    from memra.decode_plan import decode_plan

    model = tiny_hybrid(Settings(cpu_decode=True), quant)
    # fp32 (every linear on cpu_flin) stacks the rows: one C call a GDN layer for all of them; the packed hybrid
    # keeps the row plan (cpu_rows_invariant), one call a row
    stacked = decode_plan(model) == "stacked"
    assert stacked == (quant is None)
    prompts = [[3 + i, 1, 4, 1 + i, 5, 9 - i] for i in range(8)]
    together, alone = [model.new_cache(32) for _ in prompts], [model.new_cache(32) for _ in prompts]
    toks = [int(model.prime(p, c).argmax()) for p, c in zip(prompts, together)]
    for p, c in zip(prompts, alone):
        model.prime(p, c)
    for _ in range(3):
        for c in together + alone:
            c.reserve(1)
        before = counters.snapshot()["cpu_gdn_steps"]
        rows = model.decode_step_batch(toks, together)
        # liveness: the C step ran for every GDN layer, once for the eight rows or once a row
        assert counters.snapshot()["cpu_gdn_steps"] - before == (3 if stacked else 8 * 3)
        solo = torch.stack([model.decode_step(t, c) for t, c in zip(toks, alone)])
        assert torch.equal(rows, solo)
        toks = [int(r.argmax()) for r in rows]


def test_a_verifys_scan_is_decodes_steps_bit_for_bit():
    """cpu_gdn.scan_rows (a sequence's T tokens in one C call: the verify's delta rule) gives every token the
    output and state of step_rows one token at a time (decode), and leaves the caller's state alone."""
    hk, hv, dk, dv, t = 2, 4, 16, 8, 6
    mixed, beta, g, s = inputs(t, hk, hv, dk, dv, seed=7)
    q, k = cpu_gdn.heads_rows(mixed, hk, hv, dk)
    v = mixed[:, 2 * hk * dk :].reshape(t, hv, dv).contiguous()
    start = s[0].clone()
    o, states = cpu_gdn.scan_rows(q, k, v, beta, g, start)
    assert torch.equal(start, s[0])
    state = s[0].clone()[None]
    for j in range(t):
        oj = cpu_gdn.step_rows(q[j : j + 1], k[j : j + 1], v[j : j + 1], beta[j : j + 1], g[j : j + 1], state)
        assert torch.equal(oj[0], o[j]) and torch.equal(state[0], states[j]), j
    o2, states2 = cpu_gdn.scan(q[None], k[None], v[None], beta[None], g[None], s[:1])
    assert torch.equal(o2[0], o) and torch.equal(states2[0], states)
    o3, last = cpu_gdn.scan_rows(q, k, v, beta, g, start, every=False)  # the last state alone: the same bits
    assert torch.equal(o3, o) and torch.equal(last[0], states[-1]) and torch.equal(start, s[0])
