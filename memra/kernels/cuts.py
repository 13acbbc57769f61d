"""Where a token sequence is cut into forwards: at absolute multiples of a fixed size, so the pieces a
token lands in do not depend on how the tokens were handed in (the exact path's prefill, memra/step.py,
and GDN's chunked prefill, reference.gdn_prefill and its Triton twin, both cut here)."""

from __future__ import annotations

TILE = 64  # prefill forward size on the exact path; equals the GDN chunk so cuts line up
# Decode attention splits a long prefix at multiples of this many positions (more programs for a few
# long rows; memra.kernels.triton.attention). Fixed: where a row's prefix is cut cannot depend on the call.
ATTN_SPLIT = 512


def aligned_cuts(n: int, pos0: int, size: int = TILE) -> list[tuple[int, int]]:
    """Split n tokens starting at absolute position pos0 into [start, stop) pieces of at most `size`,
    cut where the absolute position is a multiple of `size` (so the cuts do not depend on how the
    tokens were handed in, as long as every hand-in boundary is itself a multiple of `size`)."""
    cuts, start = [], 0
    while start < n:
        stop = min(n, start + size - (pos0 + start) % size)
        cuts.append((start, stop))
        start = stop
    return cuts
