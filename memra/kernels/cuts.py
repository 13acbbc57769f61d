"""Where a token sequence is cut into forwards: at absolute multiples of a fixed size, so the pieces a
token lands in do not depend on how the tokens were handed in (the exact path's prefill, memra/step.py,
and GDN's chunked prefill, reference.gdn_prefill and its Triton twin, both cut here)."""

from __future__ import annotations

import torch

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


# --- sliding windows: the part of a prefix a query can see (a query at p sees p-W+1..p) ---


def window_start(pos0: int, window: int | None) -> int:
    """The first position any of the queries at pos0.. can see: 0, or pos0 - W + 1 with a window."""
    return 0 if window is None else max(0, pos0 - window + 1)


def window_rows(starts: torch.Tensor, lens: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode row's prefix cut to its sliding window: (starts, lens) [R] of whole prefixes -> those of
    their last `window` positions (a row at position p reads p-W+1..p, as causal_attention's mask says)."""
    cut = (lens - window).clamp(min=0)
    return starts + cut, lens - cut
