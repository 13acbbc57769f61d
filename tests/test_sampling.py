"""Seeded sampling: the stream is a pure function of (logits, seed, step)."""

import pytest
import torch

from memra.errors import MemraError
from memra.sampling import SamplingParams, allowed_tokens, sample, splitmix64, uniform_noise


def test_splitmix64_matches_the_published_sequence():
    # splitmix64 seeded with 0 yields 0xE220A8397B1DCDAF first: the finalizer of 0 + golden gamma.
    got = splitmix64(torch.tensor([0], dtype=torch.int64)).item() & ((1 << 64) - 1)
    assert got == 0xE220A8397B1DCDAF


def test_noise_is_a_pure_function_of_seed_step_and_token():
    a = uniform_noise(42, 7, 1000)
    assert torch.equal(a, uniform_noise(42, 7, 1000))
    assert torch.equal(a[:10], uniform_noise(42, 7, 10))  # independent of the vocab size asked for
    assert not torch.equal(a, uniform_noise(42, 8, 1000))
    assert not torch.equal(a, uniform_noise(43, 7, 1000))
    assert (a > 0).all() and (a < 1).all()
    assert abs(a.mean().item() - 0.5) < 0.05


def test_sampling_follows_the_distribution():
    logits = torch.tensor([0.0, 1.0, 2.0, -1.0])
    p = SamplingParams(max_tokens=128, temperature=1.0, seed=1)
    counts = torch.bincount(torch.tensor([sample(logits, p, ctr) for ctr in range(4000)]), minlength=4).double()
    assert torch.allclose(counts / 4000, torch.softmax(logits.double(), 0), atol=0.03)


def test_greedy_is_argmax():
    logits = torch.randn(500)
    assert sample(logits, SamplingParams(temperature=0.0, max_tokens=128), 0) == int(logits.argmax())


def test_filters_keep_the_right_tokens():
    logits = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.1]))
    keep = lambda **kw: allowed_tokens(logits, SamplingParams(temperature=1.0, **kw)).tolist()
    assert keep(top_k=2) == [True, True, False, False]
    assert keep(top_p=0.7) == [True, True, False, False]  # 0.5 < 0.7, 0.75 >= 0.7 stops after token 1
    assert keep(min_p=0.3) == [True, True, False, False]  # >= 0.15
    assert keep(top_p=0.01) == [True, False, False, False]


@pytest.mark.parametrize("kw", [dict(temperature=-0.1), dict(temperature=float("nan")), dict(top_k=-2),
                                dict(top_p=0.0), dict(top_p=1.5), dict(min_p=2.0), dict(max_tokens=0), dict(seed=-3)])
def test_bad_params_are_refused(kw):
    with pytest.raises(MemraError):
        SamplingParams(**kw)


def test_penalties_and_logit_bias():
    from memra.sampling import apply_penalties

    logits = torch.tensor([2.0, -1.0, 0.5, 3.0])
    p = SamplingParams(temperature=0.0, max_tokens=128, repetition_penalty=2.0)
    assert apply_penalties(logits, p, [0], [1]).tolist() == [1.0, -2.0, 0.5, 3.0]
    p = SamplingParams(temperature=0.0, max_tokens=128, presence_penalty=0.5, frequency_penalty=0.25)
    assert apply_penalties(logits, p, [], [2, 2, 3]).tolist() == [2.0, -1.0, 0.5 - 0.5 - 0.5, 3.0 - 0.5 - 0.25]
    p = SamplingParams(temperature=0.0, max_tokens=128, logit_bias={1: 100, 3: -100})
    out = apply_penalties(logits, p, [], [])
    assert out.tolist() == [2.0, 99.0, 0.5, -97.0] and sample(out, p, 0) == 1
    assert apply_penalties(logits, SamplingParams(temperature=0.0, max_tokens=128), [0], [1]) is logits  # no work when nothing is asked
    with pytest.raises(MemraError, match="outside the vocabulary"):
        apply_penalties(logits, SamplingParams(temperature=0.0, max_tokens=128, logit_bias={9: 1.0}), [], [])


@pytest.mark.parametrize("kw", [dict(repetition_penalty=0.0), dict(presence_penalty=3.0), dict(frequency_penalty=-2.5),
                                dict(logit_bias={5: 101.0}), dict(logit_bias={"x": 1.0}), dict(stop=("",)),
                                dict(stop=tuple("abcdefghijklmnopq"))])
def test_bad_penalty_params_are_refused(kw):
    with pytest.raises(MemraError):
        SamplingParams(**kw)
