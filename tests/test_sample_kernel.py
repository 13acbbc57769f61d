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
