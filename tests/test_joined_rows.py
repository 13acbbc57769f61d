"""memra.engine.sampler.joined_rows: the rows a step's pick reads, joined as torch.cat joins them, without the copy
where the read-out (memra.graphs.widened) already holds them in order."""

from __future__ import annotations

import torch

from memra.engine.sampler import joined_rows
from memra.graphs import widened


def test_rows_in_order_are_a_view_and_others_a_copy_with_the_cats_bits():
    buf = torch.randn(9, 11, dtype=torch.bfloat16)  # a captured step's logits: 5 decode rows, then 4 pieces' last rows
    got = widened(buf[:5], buf[6:9])  # [8, 11] fp32: the decode rows, then pieces 0..2's last rows
    decoded, lasts = got[:5], list(got[5:])
    cases = {"in order": [decoded, lasts[0][None], lasts[1][None]],  # the third piece goes on to its next chunk
             "one piece": [lasts[2][None]],
             "a gap": [decoded, lasts[1][None]],  # the first piece goes on: its row sits between
             "a fork": [decoded, lasts[0][None], lasts[0][None]]}  # n > 1: one prompt's row twice
    for name, parts in cases.items():
        joined = joined_rows(parts)
        assert torch.equal(joined, torch.cat(parts)), name
        assert (joined.data_ptr() == got.data_ptr() + (0 if name != "one piece" else 7 * 11 * 4)) == (
            name in ("in order", "one piece")), name  # the liveness: the view path ran where it can, only there


def test_blocks_adjacent_in_memory_but_of_two_storages_are_copied():
    """Two tensors that lie end to end without sharing a storage (CUDA's caching allocator hands out neighbouring
    blocks; here two buffers over one bytearray) are joined by a copy: a view over the first's storage would run
    past its end (a GPU run of the speculative path hit exactly that)."""
    vocab = 16
    memory = bytearray(2 * vocab * 4)
    first = torch.frombuffer(memory, dtype=torch.float32, count=vocab).view(1, vocab)
    second = torch.frombuffer(memory, dtype=torch.float32, count=vocab, offset=vocab * 4).view(1, vocab)
    assert second.data_ptr() == first.data_ptr() + vocab * 4  # adjacent, as the failing case was
    assert first.untyped_storage().data_ptr() != second.untyped_storage().data_ptr()
    first.fill_(1.0)
    second.fill_(2.0)
    joined = joined_rows([first, second])
    assert torch.equal(joined, torch.cat([first, second]))
    assert joined.data_ptr() != first.data_ptr()  # a copy of its own
