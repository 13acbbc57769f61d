"""The batched verify (memra.verify_batch.decode_step_t_batch): several sequences' speculative verifies, rows
of different lengths in one forward, each column bit-identical to decode_step on its own sequence (E4),
with each sequence's GDN trail for its rollback. On CPU (the row plan) the bits are checked on every
fixture architecture and the stacked wiring is checked on the non-exact path to fp32 rounding; with
MEMRA_TEST_DEVICE=cuda the same test holds the stacked plan's bits on the GPU."""

from __future__ import annotations

import pytest
import torch

from conftest import DEVICE, HF_ARCHS, hf_dir
from memra import counters
from memra.errors import ContextOverflowError, MemraError
from memra.state_trail import StateTrail
from memra.verify_batch import decode_step_t_batch

PROMPTS = [[5, 17, 99, 3, 250, 7], [8, 9, 10, 11, 5, 17, 99, 4, 4, 4, 4, 1, 2], [40, 41]]
CHUNKS = [[12, 40, 41, 300], [7], [2, 77, 78, 79, 80, 81]]  # T = 4, 1, 6 side by side


def _primed(model, ctx=64):
    caches = [model.new_cache(ctx) for _ in PROMPTS]
    for p, c in zip(PROMPTS, caches):
        model.prime(p, c)
    return caches


def _state(model, c):
    return [c.conv_state(i).clone() for i in model.cfg.gdn_layers] + [c.ssm_state(i).clone() for i in model.cfg.gdn_layers]


@pytest.mark.parametrize("arch", HF_ARCHS)
def test_every_row_of_a_batched_verify_is_its_decode_steps_to_the_bit(load_model, arch):
    model = load_model(hf_dir(arch))
    plain = _primed(model)
    ref = [[model.decode_step(t, c) for t in chunk] for chunk, c in zip(CHUNKS, plain)]
    caches, trails = _primed(model), [StateTrail() for _ in PROMPTS]
    before = counters.snapshot()
    out = decode_step_t_batch(model, CHUNKS, caches, trails)
    moved = counters.delta(before)
    assert moved["spec_verify_batch_rows"] == len(PROMPTS) and moved["spec_verify_forwards"] == 1  # one forward
    for i, ((logits, h_seed), rows) in enumerate(zip(out, ref)):
        assert logits.shape == (len(CHUNKS[i]), model.cfg.vocab_size) and h_seed.shape[0] == len(CHUNKS[i])
        for j, row in enumerate(rows):
            assert torch.equal(logits[j], row), f"{arch}: row {i} column {j} differs from decode_step"
        assert caches[i].pos == plain[i].pos
        assert all(torch.equal(a, b) for a, b in zip(_state(model, caches[i]), _state(model, plain[i])))
    # each sequence's trail rolls it back to the plain state after its first column
    if model.cfg.gdn_layers:
        c, pos0 = caches[2], plain[2].pos - len(CHUNKS[2])
        c.rollback(pos0, 1, trails[2])
        again = _primed(model)[2]
        model.decode_step(CHUNKS[2][0], again)
        assert all(torch.equal(a, b) for a, b in zip(_state(model, c), _state(model, again)))


@pytest.mark.skipif(DEVICE != "cpu", reason="the non-exact path's agreement; the GPU checks the stacked bits above")
@pytest.mark.parametrize("arch", ["llama", "qwen3_5", "qwen3_5_moe"])
def test_the_stacked_batched_verify_is_wired_like_decode(load_model, arch):
    """MEMRA_EXACT=0 runs the stacked plan on CPU (torch kernels, whose rows change bits with M): the batched
    forward must agree with decode to fp32 rounding — each row attends its own prefix, GDN steps its own state."""
    model = load_model(hf_dir(arch)).with_doors(MEMRA_EXACT="0")
    ref = [[model.decode_step(t, c) for t in chunk] for chunk, c in zip(CHUNKS, _primed(model))]
    out = decode_step_t_batch(model, CHUNKS, _primed(model), [StateTrail() for _ in PROMPTS])
    for (logits, _), rows in zip(out, ref):
        for j, row in enumerate(rows):
            assert ((logits[j] - row).abs().max() / row.abs().max()).item() < 1e-4


def test_a_batched_verify_refuses_before_any_cache_moves(load_model):
    model = load_model(hf_dir("qwen3_5"))
    caches = _primed(model, ctx=16)  # the second prompt (13 tokens) has room for 3 more
    pos = [c.pos for c in caches]
    with pytest.raises(ContextOverflowError, match="row 1"):
        decode_step_t_batch(model, [[1, 2], [1, 2, 3, 4], [1]], caches, [None] * 3)
    with pytest.raises(MemraError, match="same cache twice"):
        decode_step_t_batch(model, [[1], [2]], [caches[0], caches[0]], [None, None])
    with pytest.raises(MemraError, match="one of each"):
        decode_step_t_batch(model, [[1]], caches, [None] * 3)
    assert [c.pos for c in caches] == pos
