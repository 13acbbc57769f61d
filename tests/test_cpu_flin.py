"""The row-invariant fp32 linear (memra.kernels.cpu_flin, cpu/flin.cpp): its twin's bits at every instruction
level, and a row's bits whatever the row count, its place in the batch, a strided input or the threads."""

import pytest
import torch

from memra.kernels import cpu_flin, cpu_qdot
from memra.kernels import flin_reference as ref

pytestmark = pytest.mark.skipif(cpu_qdot.library() is None, reason="no C++ compiler: the CPU kernels are off")

SHAPES = [(1, 8, 16), (3, 17, 37), (5, 33, 256), (9, 70, 100), (2, 9, 5), (4, 64, 48)]  # (M, N, K): tails of K, M, N


def _levels():
    return range(cpu_flin.level() + 1)


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_twin_bits_at_every_level(m, n, k):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x, w, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    want, want_b = ref.linear(x, w), ref.linear(x, w, b)
    for at in _levels():
        before = cpu_flin.outputs(at)
        assert torch.equal(cpu_flin.linear(x, w, at=at), want), f"level {at}"
        assert torch.equal(cpu_flin.linear(x, w, b, at=at), want_b), f"level {at}, bias"
        assert cpu_flin.outputs(at) - before == 2 * m * n  # the level asked for is the one that ran
    # another order's bits (the canary): torch's linear agrees to rounding, not in bits, on these sums
    assert torch.allclose(want, torch.nn.functional.linear(x, w), rtol=1e-5, atol=1e-5)


def test_fma_is_fused():
    """The twin's fma rounds once: 1 + 2^-23 squared, minus its rounded product, is the lost 2^-46."""
    a = torch.tensor([1 + 2.0 ** -23])
    c = -(a * a)
    assert ref.fma(a, a, c).item() == 2.0 ** -46
    assert (a * a + c).item() == 0.0  # two roundings lose it


def _row_invariant(linear, x, w) -> bool:
    """Does each row of x get the same bits alone, in every prefix of the batch, and moved to another place?"""
    full = linear(x, w)
    for m in range(1, x.shape[0] + 1):
        if not torch.equal(linear(x[:m], w), full[:m]):
            return False
    flipped = linear(x.flip(0), w).flip(0)
    return all(torch.equal(linear(x[i : i + 1], w)[0], full[i]) for i in range(x.shape[0])) and torch.equal(flipped, full)


def test_rows_do_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(19, 512, generator=g), torch.randn(96, 512, generator=g)
    assert _row_invariant(cpu_flin.linear, x, w)
    for at in _levels():
        assert _row_invariant(lambda x, w: cpu_flin.linear(x, w, at=at), x[:7], w)
    # the canary: torch's (MKL's) linear picks its kernel by M here, so the same check fails on it
    assert not _row_invariant(torch.nn.functional.linear, x, w)


def test_threads_and_strides_do_not_change_bits():
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(40, 300, generator=g), torch.randn(1000, 256, generator=g)  # big enough to take threads
    xs = x[:, 10:266]  # a strided view: rows 300 apart
    want = cpu_flin.linear(xs.contiguous(), w, threads=1)
    for threads in (1, 2, 3):
        assert torch.equal(cpu_flin.linear(xs, w, threads=threads), want)
    assert torch.equal(want, ref.linear(xs, w))
