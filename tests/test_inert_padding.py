"""A captured step's padding rows on an inert slot (MEMRA_INERT_PADDING; memra.kernels.slots): the Triton GDN and
conv step kernels leave such a row's state alone, the twins step the scratch slot it names as before, and no live
row's output or state moves a bit. On CPU the kernels run in Triton's interpreter; MEMRA_TEST_DEVICE=cuda
compiles them and replays a graphed decode step with a padding row under both settings."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from conftest import DEVICE, hf_dir  # noqa: E402
from memra import counters  # noqa: E402
from memra.graphs import host_rows, reserve_scratch, scratch_of  # noqa: E402
from memra.kernels import reference  # noqa: E402
from memra.kernels.slots import INERT_SLOT, state_slots  # noqa: E402
from memra.kernels.triton import conv as ck  # noqa: E402
from memra.kernels.triton import gdn as tk  # noqa: E402

SCRATCH = 1  # the pools' scratch slot in these tests
SLOTS = [4, INERT_SLOT + SCRATCH, 0, INERT_SLOT + SCRATCH]  # two live rows, two padding rows
LIVE = [0, 2]  # their rows


def rnd(*shape, seed, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device=DEVICE, dtype=dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes (torch.equal on them holds where the values are NaN too: an unwritten pool slot)."""
    return t.contiguous().view(torch.uint8)


def test_the_marker_comes_off_for_the_twins():
    slots = torch.tensor(SLOTS)
    assert state_slots(slots).tolist() == [4, SCRATCH, 0, SCRATCH]


def test_the_gdn_step_leaves_an_inert_rows_state_alone_and_the_live_rows_bits_as_they_were():
    b, h, dk, dv, n_slots = 4, 2, 16, 40, 6
    q, k = (reference.l2_normalize(rnd(b, h, dk, seed=s)) for s in (1, 2))
    v, beta = rnd(b, h, dv, seed=3), torch.sigmoid(rnd(b, h, seed=4))
    g = -torch.rand(b, h, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    pool = rnd(n_slots, h, dk, dv, seed=6)
    before = pool.clone()
    o = tk.delta_rule_step_into(q, k, v, beta, g, pool, torch.tensor(SLOTS, device=DEVICE))
    alone = before.clone()
    o_live = tk.delta_rule_step_into(*(x[LIVE] for x in (q, k, v, beta, g)), alone, torch.tensor([4, 0], device=DEVICE))
    assert torch.equal(o[LIVE], o_live) and torch.equal(bits(pool), bits(alone))  # the scratch slot untouched
    assert torch.isfinite(o).all()  # the padding rows' outputs come from a zero state
    twin = before.clone()  # the twin steps the scratch slot the padding rows name, as before the marker
    o_twin = reference.delta_rule_step_into(q, k, v, beta, g, twin, torch.tensor(SLOTS, device=DEVICE))
    assert (o_twin[LIVE] - o_live).abs().max() < 1e-5 and not torch.equal(twin[SCRATCH], before[SCRATCH])


def test_skipping_the_inert_rows_zeroes_their_output_and_moves_no_live_bit():
    """MEMRA_INERT_SKIP: an inert row's programs walk none of its tokens. Its output is zeros (the liveness: without
    the skip the same rows' outputs, from a zero state, are not), and the live rows' outputs and the pool's bits are
    those of the launch without it."""
    b, h, dk, dv, n_slots = 4, 2, 16, 40, 6
    q, k = (reference.l2_normalize(rnd(b, h, dk, seed=s)) for s in (11, 12))
    v, beta = rnd(b, h, dv, seed=13), torch.sigmoid(rnd(b, h, seed=14))
    g = -torch.rand(b, h, generator=torch.Generator().manual_seed(15)).to(DEVICE)
    slots = torch.tensor(SLOTS, device=DEVICE)
    pools, outs = [], []
    for skip in (False, True):
        pools.append(rnd(n_slots, h, dk, dv, seed=16))
        outs.append(tk.delta_rule_step_into(q, k, v, beta, g, pools[-1], slots, skip))
    inert = [i for i in range(b) if i not in LIVE]
    assert torch.equal(outs[0][LIVE], outs[1][LIVE]) and torch.equal(bits(pools[0]), bits(pools[1]))
    assert torch.equal(outs[1][inert], torch.zeros_like(outs[1][inert])) and outs[0][inert].abs().max() > 0


def test_the_table_hands_the_skip_to_the_triton_step_only():
    from memra.kernels.table import KernelTable
    from memra.settings import Settings

    table = KernelTable.build("cpu", Settings.from_env({}))  # open by default
    assert table.inert_skip and not KernelTable.build("cpu", Settings.from_env({"MEMRA_INERT_SKIP": "0"})).inert_skip
    b, h, dk, dv = 4, 2, 16, 40  # on CPU the table's step is a twin, which takes no skip: it steps the scratch slot
    q, k = (reference.l2_normalize(rnd(b, h, dk, seed=s).cpu()) for s in (21, 22))
    pool = rnd(6, h, dk, dv, seed=23).cpu()
    before = pool.clone()
    o = table.delta_rule_step_into(q, k, rnd(b, h, dv, seed=24).cpu(), torch.full((b, h), 0.5), torch.full((b, h), -0.1),
                                   pool, torch.tensor(SLOTS))
    assert o[[1, 3]].abs().max() > 0 and not torch.equal(pool[SCRATCH], before[SCRATCH])


def test_the_conv_step_leaves_an_inert_rows_saved_inputs_alone_and_the_live_rows_bits_as_they_were():
    c, kc, n_slots = 300, 4, 6  # channels past one program's block
    u, w = rnd(4, c, seed=7, dtype=torch.bfloat16), rnd(c, kc, seed=8, dtype=torch.bfloat16)
    pool = rnd(n_slots, c, kc - 1, seed=9, dtype=torch.bfloat16)
    before = pool.clone()
    out = ck.causal_conv_step_into(u, pool, torch.tensor(SLOTS, device=DEVICE), w)
    alone = before.clone()
    out_live = ck.causal_conv_step_into(u[LIVE], alone, torch.tensor([4, 0], device=DEVICE), w)
    assert torch.equal(out[LIVE], out_live) and torch.equal(bits(pool), bits(alone))
    twin = before.clone()
    reference.causal_conv_step_into(u, twin, torch.tensor(SLOTS, device=DEVICE), w)
    assert torch.equal(twin[[4, 0]], pool[[4, 0]]) and not torch.equal(twin[SCRATCH], before[SCRATCH])


def test_host_rows_mark_the_padding_rows_only_behind_the_door(load_model):
    model = load_model(hf_dir("qwen3_5"))
    caches = [model.new_cache(64) for _ in range(2)]
    try:
        for inert, want in ((False, SCRATCH), (True, INERT_SLOT + SCRATCH)):
            rows = host_rows(caches, 4, 2, (3, SCRATCH), inert)
            assert rows[:2, 1].tolist() == [c.slot for c in caches] and rows[2:, 1].tolist() == [want, want]
    finally:
        for c in caches:
            c.free()


@pytest.mark.cuda
@pytest.mark.skipif(DEVICE != "cuda", reason="a graphed decode needs the GPU (MEMRA_TEST_DEVICE=cuda)")
def test_a_graphed_decode_keeps_its_bits_and_leaves_the_scratch_state_alone_only_when_inert(load_model):
    """Three rows replay the 4-row bucket's graph, one padding row. Both settings give the same logits and the
    same live states; the scratch slot's GDN and conv states stay as they were only with the door open (with
    it shut the padding row steps them: the canary that the test can tell). MEMRA_INERT_SKIP=1 on top (the padding
    row's GDN programs return at once) gives the same logits and states again."""
    base = load_model(hf_dir("qwen3_5"), dtype="bfloat16")
    got = {}
    for inert, skip in (("0", "0"), ("1", "0"), ("1", "1")):
        model = base.with_doors(MEMRA_INERT_PADDING=inert, MEMRA_INERT_SKIP=skip)
        caches = [model.new_cache(128) for _ in range(3)]
        reserve_scratch(model, caches[0].kv, caches[0].rec)
        rec, slot = caches[0].rec, scratch_of(caches[0].kv, caches[0].rec, model.graph_scratch)[1]
        model.prime_batch([[3 + i, 9, 27, 5][: 2 + i] for i in range(3)], caches)
        scratch = [bits(t[slot]).clone() for table in (rec.ssm, rec.conv) for t in table.values()]
        before = counters.snapshot()
        logits = model.decode_step_batch([11, 12, 13], caches)
        assert counters.delta(before).get("graph_captures", 0) + counters.delta(before).get("graph_replays", 0) >= 1
        after = [bits(t[slot]) for table in (rec.ssm, rec.conv) for t in table.values()]
        live = [bits(t[c.slot]).clone() for c in caches for table in (rec.ssm, rec.conv) for t in table.values()]
        got[inert + skip] = (logits.clone(), live, all(torch.equal(a, b) for a, b in zip(scratch, after)))
        for c in caches:
            c.free()
    for door in ("10", "11"):
        assert torch.equal(got["00"][0], got[door][0]) and all(torch.equal(a, b) for a, b in zip(got["00"][1], got[door][1]))
        assert got[door][2]
    assert not got["00"][2]
