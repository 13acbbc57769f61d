"""Several sequences' prompt pieces in one prefill launch: where each piece sits, as a kernel reads it.

A wave of cross-request prefill (memra.model.context.Segments) stacks prompt pieces of different
sequences in the rows of one forward. The row-wise work (projections, norms, rope) runs over all rows
at once; attention over each piece's own prefix is per sequence. Launched piece by piece it costs a
launch per piece per layer, and on a GPU that host time, not the arithmetic, was most of a prefilling
engine step. AttentionPieces and RecurrentPieces describe the pieces once per wave (one upload each),
so one launch per layer serves them all (attention; GDN's conv, its state step, and the chunked delta
rule's three launches), each piece's programs computing what its solo launch's programs compute.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from memra.kernels.cuts import aligned_cuts
from memra.kernels.reference import GDN_CHUNK
from memra.upload import upload_parts, upload_values

ATTENTION_TILE = 64  # queries per program of the pieces' attention launch (its BLOCK_M)


@dataclass(frozen=True)
class AttentionPieces:
    """Prompt pieces of several sequences sharing one KV pool, for one prefill-attention launch."""

    # per piece: (first row in the wave, tokens, pos0, where its prefix starts in rows)
    spans: tuple[tuple[int, int, int, int], ...]
    rows: torch.Tensor  # [sum of pos0 + tokens] the pieces' flat KV-pool rows (each its whole prefix, in order), joined
    table: torch.Tensor  # [P, 4] int32 on the device: the spans, as the kernel reads them
    tiles: int  # query tiles of every piece (the launch's programs along the pieces); a bound, in a captured step

    @classmethod
    def of(cls, firsts: list[int], pos0s: list[int], read_rows: list[torch.Tensor]) -> "AttentionPieces":
        """Piece i: its first row in the wave, its position, its prefix's pool rows [pos0 + tokens]."""
        spans, at = [], 0
        for first, pos0, rows in zip(firsts, pos0s, read_rows):
            spans.append((first, rows.numel() - pos0, pos0, at))
            at += rows.numel()
        rows = read_rows[0] if len(read_rows) == 1 else torch.cat(read_rows)
        table = upload_values([x for span in spans for x in span], torch.int32, rows.device).view(-1, 4)
        return cls(tuple(spans), rows, table, sum(-(-t // ATTENTION_TILE) for _, t, _, _ in spans))


@dataclass(frozen=True)
class RecurrentPieces:
    """Prompt pieces of several sequences whose GDN states sit in one recurrent pool, in the contiguous
    rows of one wave: each piece chunked at absolute multiples of GDN_CHUNK, as its solo prime is."""

    spans: tuple[tuple[int, int, int, int], ...]  # per piece: (first row in the wave, tokens, pos0, slot)
    table: torch.Tensor  # [P, 5] int32: (first row, tokens, slot, first chunk, end chunk)
    cuts: torch.Tensor  # [chunks + 1] int32: every chunk's first row in the wave, then the wave's row count

    @classmethod
    def of(cls, firsts: list[int], sizes: list[int], pos0s: list[int], slots: list[int],
           device: torch.device) -> "RecurrentPieces":
        table, cuts = recurrent_rows(firsts, sizes, pos0s, slots)
        cuts.append(firsts[-1] + sizes[-1])
        table_t, cuts_t = upload_parts([[x for row in table for x in row], cuts], torch.int32, device)
        return cls(tuple(zip(firsts, sizes, pos0s, slots)), table_t.view(-1, 5), cuts_t)


def recurrent_rows(firsts: list[int], sizes: list[int], pos0s: list[int],
                   slots: list[int]) -> tuple[list[tuple[int, int, int, int, int]], list[int]]:
    """RecurrentPieces' table rows (first row, tokens, slot, first chunk, end chunk) of pieces in the
    contiguous rows of one wave, and every chunk's first row (without the wave's end)."""
    table, cuts, end = [], [], firsts[0]
    for first, t, pos0, slot in zip(firsts, sizes, pos0s, slots):
        if first != end:  # a chunk ends where the next begins: the pieces must be contiguous
            raise ValueError("RecurrentPieces: the pieces must fill the wave's rows in order")
        chunks = aligned_cuts(t, pos0, GDN_CHUNK)
        table.append((first, t, slot, len(cuts), len(cuts) + len(chunks)))
        cuts += [first + a for a, _ in chunks]
        end = first + t
    return table, cuts
