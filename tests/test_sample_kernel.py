"""The one-launch batch sampler (memra.kernels.triton.sampling) against device_sample, row by row: the
same token for greedy rows, plain seeded sampling and every filter, over many (seed, step) pairs. On
CPU the kernel runs in Triton's interpreter (tests/conftest.py)."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from memra.kernels.triton import sampling as sample_triton  # noqa: E402
from memra.sampling import DevSamp, device_sample  # noqa: E402

DEVICE = os.environ.get("MEMRA_TEST_DEVICE", "cpu")


def test_batch_sampler_chooses_device_samples_tokens():
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(12, 3001, generator=g) * 3).to(DEVICE)
    logits[3, 100] = logits[3, 2000] = logits[3].max() + 1  # a tie: the first index wins, as torch.argmax
    specs = [DevSamp(0.0, 0, 0), DevSamp(0.7, 11, 3), DevSamp(1.3, 5, 0), DevSamp(0.0, 0, 0),
             DevSamp(1.0, 2**63 + 5, 2**40), DevSamp(0.9, 7, 1, top_k=40), DevSamp(1.1, 8, 2, top_p=0.8),
             DevSamp(0.8, 9, 4, min_p=0.05), DevSamp(1.0, 3, 9, top_k=100, top_p=0.95, min_p=0.01),
             DevSamp(2.0, 1, 1), DevSamp(0.5, 1, 2), DevSamp(0.5, 1, 3)]
    for step in range(4):  # new counters: new noise
        specs = [DevSamp(s.temperature, s.seed, s.ctr + step, s.top_k, s.top_p, s.min_p) for s in specs]
        got = sample_triton.sample_batch(logits, specs).tolist()
        assert got == [int(device_sample(logits[i], s)) for i, s in enumerate(specs)]
    assert got[3] == 100


def test_a_row_does_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 777, generator=g).to(DEVICE)
    specs = [DevSamp(1.0, 42, i) for i in range(5)]
    whole = sample_triton.sample_batch(logits, specs)
    for i in range(5):
        assert int(sample_triton.sample_batch(logits[i : i + 1].clone(), specs[i : i + 1])[0]) == int(whole[i])


def test_split_rows_choose_the_unsplit_walks_tokens():
    """MEMRA_SAMPLE_SPLIT: each row's vocabulary over several programs, then the combine. The same token as
    device_sample in every row, with maxima tied inside a part, across parts and at a part's first index."""
    g = torch.Generator().manual_seed(2)
    v = 20_000  # 20 blocks: 5 parts of 4 at 7 rows (sample_triton.split_span)
    logits = (torch.randn(7, v, generator=g) * 2).to(DEVICE)
    span = sample_triton.split_span(7, v)
    assert (span, -(-v // span)) == (4 * sample_triton.SAMPLE_BLOCK, 5)
    top = logits.max() + 1
    logits[0, [9_000, 17_000]] = top  # parts 2 and 4: the earlier part's index
    logits[1, [span + 5, span + 700]] = top  # inside part 1: the first index
    logits[2, [span, 3 * span]] = top  # a part's first entry
    logits[3, : span + 1] = float("-inf")  # a part with nothing allowed in it
    specs = [DevSamp(0.0, 0, 0), DevSamp(0.0, 0, 0), DevSamp(0.0, 0, 0), DevSamp(1.0, 4, 2),
             DevSamp(0.7, 11, 3, top_k=40), DevSamp(1.2, 5, 0, top_p=0.9), DevSamp(0.0, 0, 0)]
    for step in range(3):
        specs = [DevSamp(s.temperature, s.seed, s.ctr + step, s.top_k, s.top_p, s.min_p) for s in specs]
        got = sample_triton.sample_batch(logits, specs, split=True).tolist()
        assert got == sample_triton.sample_batch(logits, specs).tolist()
        assert got == [int(device_sample(logits[i], s)) for i, s in enumerate(specs)]
    assert got[:3] == [9_000, span + 5, span]


def test_split_span_follows_the_rows():
    block = sample_triton.SAMPLE_BLOCK
    # one row of Llama-3's 126 blocks: aimed at 31 parts of SPLIT_MIN_BLOCKS or more, so 26 parts of 5
    assert sample_triton.split_span(1, 128_256) == 5 * block
    assert -(-128_256 // sample_triton.split_span(256, 128_256)) == 4  # 4 parts a row: 1,024 programs
    assert sample_triton.split_span(2048, 128_256) >= 128_256  # rows enough: one part
    assert sample_triton.split_span(1, 3_000) >= 3_000  # under SPLIT_MIN_BLOCKS blocks: one part


def test_pruned_walk_chooses_device_samples_tokens_and_skips_blocks():
    """MEMRA_SAMPLE_PRUNE: blocks whose fp32 ceiling stays below the row's best skip the exact fp64 scores. The
    same token as device_sample in every row (ties, a masked-off stretch, filters, a tiny and a large temperature,
    greedy rows, split or not); the count of skipped blocks proves the skip ran; with a negative slack (the
    canary: blocks skipped that could hold the best) the tokens change."""
    g = torch.Generator().manual_seed(3)
    v = 20_000
    logits = (torch.randn(9, v, generator=g) * 3).to(DEVICE)
    logits[1, [700, 15_000]] = logits[1].max() + 40  # a tie far above the rest: the noise decides
    logits[2, :12_000] = float("-inf")  # blocks with nothing allowed
    logits[5] = logits[5] * 1e-3  # flat: the noise decides, blocks seldom skip
    specs = [DevSamp(1.0, 7, 3), DevSamp(0.7, 11, 3), DevSamp(1.3, 5, 0), DevSamp(0.0, 0, 0),
             DevSamp(1e-6, 3, 3), DevSamp(1.0, 2**63 + 1, 2**40), DevSamp(0.9, 4, 1, top_k=40),
             DevSamp(1.1, 8, 2, top_p=0.8), DevSamp(4.0, 1, 9, min_p=0.05)]
    for step in range(3):
        specs = [DevSamp(s.temperature, s.seed, s.ctr + step, s.top_k, s.top_p, s.min_p) for s in specs]
        want = [int(device_sample(logits[i], s)) for i, s in enumerate(specs)]
        for split in (False, True):
            skipped = []
            assert sample_triton.sample_batch(logits, specs, split, prune=True, skipped=skipped).tolist() == want
            counts = skipped[0].cpu()
            assert counts[0].sum() > 0 and counts[3].sum() == 0  # a plain row skips; a greedy row never
    canary = sample_triton.sample_batch(logits, specs, prune=True, slack=-100.0).tolist()
    assert canary != want, "blocks that could hold the best were skipped and no token changed: the skip is dead"
