"""The captured mixed step (memra.mixed_graphs) is the mixed step, and so the two calls, bit for bit.

On CPU (CI) there are no graphs, but the static step is ordinary code: run eagerly on the fast path
(torch's kernels) it must agree with the eager mixed step to fp32 rounding (1e-4 relative: the padded
rows change how the CPU's matmul blocks its sums), which checks its bookkeeping — the packed buffer,
the padding piece and the empty ones on the scratch block and slot, the chunk cuts, whose rows come
back. On the GPU (MEMRA_TEST_DEVICE=cuda, the invariant kernels) the replayed graph is held to the two
separate calls (decode_step_batch, prime_batch) with torch.equal: logits and every cache byte.
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import DEVICE, HYBRID_ARCHS, hf_dir, rel_err
from memra import counters, step
from memra.gate.prime_batch_arm import cache_bits
from memra.graphs import SPLIT_BLOCKS, reserve_scratch, scratch_of, table_blocks
from memra.mixed_graphs import PIECES, StaticMixed, graphed_mixed, token_bucket, token_buckets

RUNNING = [9, 70, 3]  # the decoding sequences' prompt lengths
NEW = [5, 130, 64, 33]  # the prompts the step prefills: 232 tokens, the 256-token bucket
PRIMED = 70  # NEW[2] continues a prompt already primed this far (a piece at an unaligned position)
cuda_only = pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need the GPU (run with MEMRA_TEST_DEVICE=cuda)")


def _ids(n: int, salt: int, vocab: int) -> list[int]:
    return [(5 * salt + 11 * j + 2) % vocab for j in range(n)]


def _ready(model, new=NEW, ctx=512, primed=PRIMED):
    """RUNNING primed and decoded once, NEW's caches opened (the pools' scratch set aside first, as a
    server does; the third primed `primed` tokens already), every cache of `ctx` positions. -> (running
    caches, new caches, the prompts, the decode ids on the device)."""
    vocab = model.cfg.vocab_size
    probe = model.new_cache(ctx)
    reserve_scratch(model, probe.kv, probe.rec)
    probe.free()
    running = [model.new_cache(ctx) for _ in RUNNING]
    model.prime_batch([_ids(n, i, vocab) for i, n in enumerate(RUNNING)], running)
    model.decode_step_batch([7, 8, 9], running)
    new_caches = [model.new_cache(ctx) for _ in new]
    if len(new) > 2:
        model.prime(_ids(primed, 99, vocab), new_caches[2])
    prompts = [_ids(n, 10 + i, vocab) for i, n in enumerate(new)]
    return running, new_caches, prompts, torch.tensor([4, 5, 6], device=model.device)


def _pieces(model, prompts, caches):
    for p, c in zip(prompts, caches):
        c.reserve(len(p))
    return [torch.tensor(p, device=model.device) for p in prompts]


@pytest.mark.skipif(DEVICE == "cuda", reason="on the GPU the captured step is held to the two calls' bits below")
@pytest.mark.parametrize("arch, nb, decode_nb, inert", [("llama", 32, None, "0"), *((a, 32, None, "0") for a in HYBRID_ARCHS),
                                                        ("qwen3_5", 64, 8, "0"), ("qwen3_5", 32, None, "1")])
def test_the_static_mixed_step_run_eagerly_is_the_mixed_step(load_model, arch, nb, decode_nb, inert):
    """decode_nb: the decode rows' table of a width of their own (MEMRA_MIXED_DECODE_WIDTH), narrower than the
    pieces' (here 8 blocks, which hold every running row; the pieces' 64 reach past one attention split).
    inert: the padding decode row on an inert slot (MEMRA_INERT_PADDING), which the twins step as the scratch."""
    model = load_model(hf_dir(arch)).with_doors(MEMRA_EXACT="0", MEMRA_MIXED_STEP="1", MEMRA_CUDA_GRAPHS="0",
                                                MEMRA_INERT_PADDING=inert)
    running, new, prompts, ids = _ready(model)
    want_running, want_new, _, _ = _ready(model)
    want, want_lasts = step.mixed_step(model, ids, want_running, prompts, want_new)

    pieces = _pieces(model, prompts, new)
    for c in running:
        c.reserve(1)
    static = StaticMixed(model, running[0].kv, running[0].rec, 4, token_bucket(sum(NEW)), nb, decode_nb)
    assert static.nb == nb and static.decode_nb == (decode_nb or nb) and table_blocks(512) == 32
    got, lasts = static.run(ids, running, pieces, new, scratch_of(running[0].kv, running[0].rec, model.graph_scratch))
    for c in running:
        c.pos += 1
    for p, c in zip(pieces, new):
        c.pos += p.numel()
    assert static.bucket == 4 and static.tokens == 256  # an inert decode row and a 24-token padding piece
    assert got.shape == want.shape and rel_err(got, want) < 1e-4
    assert all(rel_err(a, b) < 1e-4 for a, b in zip(lasts, want_lasts))
    for c, w in zip(running + new, want_running + want_new):
        assert c.pos == w.pos
        assert all(rel_err(a, b) < 1e-4 if b.abs().max() > 0 else torch.equal(a, b)
                   for a, b in zip(cache_bits(c, model.cfg.n_layers), cache_bits(w, model.cfg.n_layers)))


def test_token_buckets_and_what_declines(load_model):
    assert [token_bucket(n) for n in (1, 64, 65, 232, 512)] == [64, 64, 128, 256, 512] and token_bucket(513) is None
    assert token_buckets(1024) == (64, 128, 256, 512, 1024) and token_bucket(513, 2048) == 1024  # MEMRA_MIXED_TOKENS
    assert token_bucket(1025, 2048) == 2048 and token_bucket(2049, 2048) is None
    model = load_model(hf_dir("llama")).with_doors(MEMRA_EXACT="0")
    running, new, prompts, ids = _ready(model)
    if DEVICE != "cuda":  # no graphs off the GPU: the engine mixes eagerly there, or makes the two calls
        assert graphed_mixed(model, ids, running, _pieces(model, prompts, new), new) is None


def _two_calls_and_graphed(model, new, **ready):
    running, caches, prompts, ids = _ready(model, new, **ready)
    want_running, want_caches, _, _ = _ready(model, new, **ready)
    want, want_lasts = model.decode_step_batch(ids, want_running), model.prime_batch(prompts, want_caches)
    before = counters.snapshot()
    got, lasts = step.mixed_step(model, ids, running, prompts, caches)
    delta = counters.delta(before)
    pairs = [(got, want), *zip(lasts, want_lasts)]
    trunk = model.cfg.n_layers
    pairs += [p for c, w in zip(running + caches, want_running + want_caches)
              for p in zip(cache_bits(c, trunk), cache_bits(w, trunk))]
    equal = all(torch.equal(a, b) for a, b in pairs) and [c.pos for c in running + caches] == [
        c.pos for c in want_running + want_caches]
    return delta, equal


@cuda_only
@pytest.mark.parametrize("arch", ["llama", *HYBRID_ARCHS])
def test_the_graphed_mixed_step_has_the_two_calls_bits(load_model, arch):
    model = load_model(hf_dir(arch), dtype="bfloat16")  # MEMRA_MIXED_STEP=auto: mixed only where graphed
    assert model.executor.mixes_steps and not model.executor.mixes_eagerly
    first, equal = _two_calls_and_graphed(model, NEW)
    assert equal and first["mixed_steps"] == 1 and first["graph_captures"] >= 1
    again, equal = _two_calls_and_graphed(model, NEW)  # the same buckets: replayed with new inputs
    assert equal and again["mixed_steps"] == 1 and again["graph_replays"] >= 1
    assert not again.get("graph_captures")
    fewer, equal = _two_calls_and_graphed(model, [40, 2])  # the 64-token bucket, a 22-token padding piece
    assert equal and fewer["mixed_steps"] == 1
    single, equal = _two_calls_and_graphed(model, [5, 1])  # a 1-token piece attends as every prompt token does
    assert equal and single["mixed_steps"] == 1


def _longer(src, tmp_path, positions=1024):
    """The fixture with room for `positions` (its own 512 stop short of a second attention split): its
    files linked, its config copied with max_position_embeddings raised."""
    dst = tmp_path / src.name
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).symlink_to(f.resolve())
    (dst / "config.json").unlink()
    cfg = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": positions}))
    return dst


@cuda_only
def test_the_decode_rows_own_table_width_keeps_the_two_calls_bits(load_model, tmp_path):
    """MEMRA_MIXED_DECODE_WIDTH (on by default): a prompt piece past one attention split (64 tokens from position
    480) makes the pieces' table full width while the decode rows keep one split's: the step has the two calls'
    bits, and the graph it ran is keyed by both widths (liveness: the narrow decode table ran)."""
    model = load_model(_longer(hf_dir("llama"), tmp_path), dtype="bfloat16")
    delta, equal = _two_calls_and_graphed(model, NEW, ctx=1024, primed=480)
    split = [k for k in model.mixed_graphs if k.decode_blocks != k.table_blocks]
    assert equal and delta["mixed_steps"] == 1 and split and all(k.decode_blocks == SPLIT_BLOCKS for k in split)


@cuda_only
def test_a_larger_token_bucket_keeps_the_two_calls_bits(load_model, tmp_path):
    """MEMRA_MIXED_TOKENS=2048: 550 prompt tokens (past the default 512 bucket) replay the 1,024-token graph,
    whose padding piece reaches past one split, so the pieces read a wider table than the narrow step's;
    the step has the two calls' bits (liveness: a graph of that bucket ran)."""
    model = load_model(_longer(hf_dir("llama"), tmp_path), dtype="bfloat16").with_doors(MEMRA_MIXED_TOKENS="2048")
    delta, equal = _two_calls_and_graphed(model, [300, 250], ctx=1024)
    keys = [k for k in model.mixed_graphs if k.tokens == 1024]
    assert equal and delta["mixed_steps"] == 1 and keys and all(k.table_blocks >= 64 for k in keys)


@cuda_only
def test_a_step_no_graph_fits_makes_the_two_calls(load_model):
    model = load_model(hf_dir("llama"), dtype="bfloat16")
    for new in ([300, 250], [3] * PIECES):  # past every token bucket; too many pieces
        delta, equal = _two_calls_and_graphed(model, new)
        assert equal and not delta.get("mixed_steps"), new
