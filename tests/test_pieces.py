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
