"""The sampler's logprob numbers (memra.engine.sampler.logprob_numbers): each asking row's chosen logprob,
rank and top n, laid out as PendingPick reads them. Batched (MEMRA_BATCHED_LOGPROBS: one log-softmax over
every asking row) against row by row: on a CPU the same layout and values within fp32 rounding (torch splits
a lone row's reduction there, so the door is CUDA's alone); on a GPU the same bits, and the engine's outputs
with the door on equal the outputs with it off."""

from __future__ import annotations

import pytest
import torch

import memra
from cuda_marks import DEVICES, cuda_only
from memra.engine.sampler import logprob_numbers
from memra.engine.scoring import row_score


def _case(rows: int, vocab: int, asked: list[tuple[int, int]], device: str = "cpu"):
    g = torch.Generator().manual_seed(rows * 7 + vocab)
    logits = (torch.randn(rows, vocab, generator=g) * 4).to(device)
    tokens = torch.randint(0, vocab, (rows,), generator=g).to(device)
    return logits, tokens, asked


def _split(numbers: torch.Tensor, asked: list[tuple[int, int]]):
    """-> per row (logprob, rank, ids, top logprobs)."""
    out, at = [], 0
    for _, n in asked:
        out.append((numbers[at], numbers[at + 1], numbers[at + 2 : at + 2 + n], numbers[at + 2 + n : at + 2 + 2 * n]))
        at += 2 + 2 * n
    assert at == numbers.numel()
    return out


@pytest.mark.parametrize("rows, asked", [(5, [(0, 0), (2, 3), (4, 1)]), (4, [(0, 2), (1, 0), (2, 0), (3, 5)]),
                                         (1, [(0, 0)])])
def test_batched_numbers_keep_the_layout_and_the_values(rows, asked):
    logits, tokens, asked = _case(rows, 1000, asked)
    one, many = (logprob_numbers(logits, tokens, asked, batched) for batched in (False, True))
    assert one.dtype == many.dtype == torch.float64 and one.shape == many.shape
    for (lp, rank, ids, vals), (lp2, rank2, ids2, vals2) in zip(_split(one, asked), _split(many, asked)):
        assert rank == rank2 and torch.equal(ids, ids2)  # distinct random logits: no near ties
        assert abs(lp - lp2) < 1e-5 and torch.allclose(vals, vals2, atol=1e-5, rtol=0)
    want = torch.log_softmax(logits[asked[0][0]], -1)[tokens[asked[0][0]]]
    assert abs(float(one[0]) - float(want)) == 0  # row by row: torch's one-row log-softmax, bit for bit
    odd, tokens, asked = _case(rows, 1001, asked)  # not a multiple of 4: kept row by row (the docstring says why)
    assert torch.equal(logprob_numbers(odd, tokens, asked, True), logprob_numbers(odd, tokens, asked, False))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("vocab", [50257, 1001])
def test_a_rows_logprob_does_not_depend_on_its_place(device, vocab):
    """One row of logits at each of rows 0..3 of a [4, V] batch (V not a multiple of 4: four alignments) gives
    the same numbers in the sampler and in scoring (memra.engine.sampler.lone_row)."""
    row = torch.randn(vocab, generator=torch.Generator().manual_seed(vocab)) * 4
    logits = row.repeat(4, 1).to(device)
    tokens = torch.full((4,), 17, dtype=torch.long, device=device)
    numbers = logprob_numbers(logits, tokens, [(i, 2) for i in range(4)], True).view(4, -1)
    assert all(torch.equal(numbers[0], numbers[i]) for i in range(1, 4))
    assert len({row_score(logits[i], 17, 2) for i in range(4)}) == 1 and row_score(logits[0], 17, 2).logprob == float(numbers[0, 0])


@cuda_only
@pytest.mark.parametrize("vocab", [1000, 50257, 128256, 151936, 248320])
def test_batched_numbers_are_the_row_by_row_bits_on_the_gpu(vocab):
    """Batched, each row's numbers are its lone row's bits (50,257: kept row by row, as batched it gave other bits
    on an H100: a gathered row of that width lies at another alignment than in the logits)."""
    for rows in (1, 7, 64, 256):
        every = [(i, 0 if i % 3 else 2) for i in range(rows)]
        for asked in (every, every[1::2] or every):
            logits, tokens, asked = _case(rows, vocab, asked, "cuda")
            one, many = (logprob_numbers(logits, tokens, asked, batched) for batched in (False, True))
            assert torch.equal(one, many), (vocab, rows, len(asked))


@cuda_only
def test_the_engine_gives_the_same_logprobs_with_the_door_on():
    model = memra.load("demo", device="cuda", dtype="bfloat16")
    prompts = ["ROMEO:", "JULIET:\nO Romeo, Romeo", "KING LEAR:\nBlow, winds,", "HAMLET:\nTo be"] * 3
    params = [memra.SamplingParams(temperature=0.0 if i % 2 else 0.9, seed=i, max_tokens=24, ignore_eos=True,
                                   logprobs=None if i % 5 == 4 else i % 3) for i in range(len(prompts))]
    got = []
    for door in ("0", "1"):  # (the default is on)
        llm = memra.LLM(model.with_doors(MEMRA_BATCHED_LOGPROBS=door), max_batch=8, warm_up=False)
        outs = llm.generate(prompts, params, use_tqdm=False)
        got.append([(o.outputs[0].token_ids, o.outputs[0].token_logprobs, o.outputs[0].top_logprobs) for o in outs])
        llm.close()
    assert got[0] == got[1] and any(lp for _, lp, _ in got[0])
