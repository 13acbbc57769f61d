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
