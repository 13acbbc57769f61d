"""The pieces' launches as a captured mixed step makes them (memra.mixed_graphs): the piece tables padded
with empty entries, the attention launched for a bound on its tiles, the GDN launches for a bound on
their chunks (zero-length chunks at the end of the cuts). The live pieces must keep the bits of the
exact launch, and the padding must write nothing: an empty piece leaves its slot's state alone.

On a CPU machine the kernels run in Triton's interpreter (conftest sets TRITON_INTERPRET);
MEMRA_TEST_DEVICE=cuda runs them compiled.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from memra.kernels.pieces import AttentionPieces, RecurrentPieces  # noqa: E402
from memra.kernels.triton import conv, gdn, prefill_attention  # noqa: E402

DEVICE = os.environ.get("MEMRA_TEST_DEVICE", "cpu")
ENTRIES = 8  # piece entries after padding
SPARE = 4  # slot no live piece names: the empty entries' (the scratch, in a captured step)


def rnd(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=DEVICE, dtype=dtype)


def _padded_attention(pieces: AttentionPieces, n_rows: int) -> AttentionPieces:
    table = torch.zeros(ENTRIES, 4, dtype=torch.int32, device=pieces.table.device)
    table[: len(pieces.spans)] = pieces.table
    table[len(pieces.spans) :, 0] = n_rows  # no tokens, so no tiles
    return AttentionPieces(pieces.spans, pieces.rows, table, n_rows // 64 + ENTRIES)


def _padded_recurrent(pieces: RecurrentPieces, n_rows: int, extra_chunks: int) -> RecurrentPieces:
    chunks = pieces.cuts.numel() - 1
    table = torch.zeros(ENTRIES, 5, dtype=torch.int32, device=pieces.table.device)
    table[: len(pieces.spans)] = pieces.table
    table[len(pieces.spans) :] = torch.tensor([n_rows, 0, SPARE, chunks, chunks], dtype=torch.int32, device=table.device)
    cuts = torch.cat((pieces.cuts, torch.full((extra_chunks,), n_rows, dtype=torch.int32, device=pieces.cuts.device)))
    return RecurrentPieces(pieces.spans, table, cuts)


def test_padded_attention_pieces_keep_the_live_pieces_bits():
    n_blocks, block, hkv, hq, d = 16, 16, 2, 4, 32
    k_pool, v_pool = rnd(n_blocks, block, hkv, d, seed=1), rnd(n_blocks, block, hkv, d, seed=2)
    tables = ([9, 2, 7, 0, 3], [11, 5, 1])
    spans = ((0, 70), (20, 41))  # (pos0, pos0 + tokens)
    read = [torch.tensor(tb, device=DEVICE)[torch.arange(b, device=DEVICE) // block] * block
            + torch.arange(b, device=DEVICE) % block for tb, (_, b) in zip(tables, spans)]
    sizes = [b - a for a, b in spans]
    q = rnd(sum(sizes) + 5, hq, d, seed=3)  # 5 rows past every piece, as a captured step's padding
    pieces = AttentionPieces.of([0, sizes[0]], [a for a, _ in spans], read)
    want = prefill_attention.prefill_attention_pieces(q, k_pool, v_pool, pieces, 0.2)
    padded = _padded_attention(pieces, q.shape[0])
    assert padded.tiles > pieces.tiles
    got = prefill_attention.prefill_attention_pieces(q, k_pool, v_pool, padded, 0.2)
    assert torch.equal(got[: sum(sizes)], want[: sum(sizes)])


def test_padded_gdn_pieces_keep_the_live_pieces_bits_and_leave_the_spare_slot_alone():
    sizes, pos0s, slots = [50, 140], [40, 0], [0, 2]
    t, h, dk, dv = sum(sizes), 2, 32, 48
    g = torch.Generator().manual_seed(4)
    q = torch.nn.functional.normalize(torch.randn(t, h, dk, generator=g), dim=-1).to(DEVICE) * dk ** -0.5
    k = torch.nn.functional.normalize(torch.randn(t, h, dk, generator=g), dim=-1).to(DEVICE)
    v, beta = torch.randn(t, h, dv, generator=g).to(DEVICE), torch.sigmoid(torch.randn(t, h, generator=g)).to(DEVICE)
    decay = -torch.rand(t, h, generator=g).to(DEVICE) * 0.5
    pool = torch.randn(5, h, dk, dv, generator=g).to(DEVICE) * 0.1
    pieces = RecurrentPieces.of([0, sizes[0]], sizes, pos0s, slots, pool.device)
    want_pool, got_pool = pool.clone(), pool.clone()
    want = gdn.gdn_prefill_pieces(q, k, v, beta, decay, want_pool, pieces)
    got = gdn.gdn_prefill_pieces(q, k, v, beta, decay, got_pool, _padded_recurrent(pieces, t, extra_chunks=6))
    assert torch.equal(got, want)
    assert torch.equal(got_pool, want_pool)
    assert torch.equal(got_pool[SPARE], pool[SPARE])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_padded_conv_pieces_keep_the_live_pieces_bits(dtype):
    sizes, slots, kc, c = [1, 40, 2], [2, 0, 3], 4, 96
    mixed = rnd(sum(sizes), c, dtype=dtype, seed=5)
    w, pool = rnd(c, kc, dtype=dtype, seed=6), rnd(5, c, kc - 1, dtype=dtype, seed=7)
    pieces = RecurrentPieces.of([0, 1, 41], sizes, [5, 0, 70], slots, pool.device)
    want_pool, got_pool = pool.clone(), pool.clone()
    want = conv.causal_conv_pieces(mixed, want_pool, w, pieces)
    got = conv.causal_conv_pieces(mixed, got_pool, w, _padded_recurrent(pieces, mixed.shape[0], extra_chunks=0))
    assert torch.equal(got, want)
    assert torch.equal(got_pool, want_pool)  # the empty entries' slot (SPARE) rewritten with its own values
