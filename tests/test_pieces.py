"""The wave descriptions the prefill kernels read (memra.kernels.pieces): where each piece's rows,
prefix and chunks are, as one upload."""

from __future__ import annotations

import pytest
import torch

from memra.kernels.pieces import AttentionPieces, RecurrentPieces


def test_attention_pieces_place_each_prefix_after_the_last():
    read = [torch.arange(10, 15), torch.arange(40, 43)]  # prefixes of 5 and 3 positions
    pieces = AttentionPieces.of([0, 2], [3, 0], read)
    assert pieces.spans == ((0, 2, 3, 0), (2, 3, 0, 5))  # (first row, tokens, pos0, prefix offset)
    assert pieces.table.tolist() == [list(s) for s in pieces.spans]
    assert torch.equal(pieces.rows, torch.cat(read))


def test_recurrent_pieces_cut_chunks_at_absolute_multiples_of_64():
    # a piece at position 40 of 100 tokens: chunks end where its positions reach 64 and 128
    pieces = RecurrentPieces.of([0, 1], [1, 100], [5, 40], [3, 0], torch.device("cpu"))
    assert pieces.table.tolist() == [[0, 1, 3, 0, 1], [1, 100, 0, 1, 4]]
    assert pieces.cuts.tolist() == [0, 1, 1 + 24, 1 + 88, 101]


def test_recurrent_pieces_must_fill_the_rows_in_order():
    with pytest.raises(ValueError, match="contiguous|in order"):
        RecurrentPieces.of([0, 5], [3, 2], [0, 0], [0, 1], torch.device("cpu"))


@pytest.mark.parametrize("pieces", [1, 2, 3, 4, 7])
def test_recurrent_pieces_tables_are_16_byte_aligned_for_every_piece_count(pieces):
    """The table and the chunk cuts start on 16 bytes whatever the piece count, so a wave of any width
    runs the kernel variant the warm-up compiled (Triton specializes on pointer alignment)."""
    sizes = [30 + 4 * i for i in range(pieces)]  # one chunk each
    firsts = [sum(sizes[:i]) for i in range(pieces)]
    p = RecurrentPieces.of(firsts, sizes, [0] * pieces, list(range(pieces)), torch.device("cpu"))
    assert p.table.data_ptr() % 16 == 0 and p.cuts.data_ptr() % 16 == 0
    assert p.cuts.tolist() == firsts + [sum(sizes)] and p.table[:, 1].tolist() == sizes
