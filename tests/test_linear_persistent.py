"""The persistent linear (memra.kernels.triton.linear_persistent, MEMRA_LINEAR_PERSISTENT) against the bucket
kernel (triton.linear), bit for bit: plain, bias, residual and SwiGLU epilogues, at row counts on both sides
of the tile edges (1, 63, 257, 700) with N and K that are not tile multiples.

On CPU both run in Triton's interpreter (which supports tensor descriptors) with the one interpreter tile
(LINEAR_INTERPRET_CONFIG), as the launchers choose it there; under MEMRA_TEST_DEVICE=cuda the same tests
hold the GPU's persistent tile to the GPU's bucket tiles. A canary (another BLOCK_K: another K walk) must
give other bits, and a counter on the kernel proves which one ran.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from conftest import gpu_kernel_table  # noqa: E402

from memra.kernels.triton import linear as bucket  # noqa: E402
from memra.kernels.triton import linear_persistent as P  # noqa: E402

DEVICE = os.environ.get("MEMRA_TEST_DEVICE", "cpu")
N, K = 72, 80  # neither a multiple of the interpreter tile's 32 columns nor of its 64-wide K step


def rnd(*shape, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(device=DEVICE, dtype=dtype)


def same_bits(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


class Launches:
    """Counts the launches of a module's kernel, which still runs (a spy, not a stand-in)."""

    def __init__(self, kernel):
        self.kernel, self.count = kernel, 0

    def __getitem__(self, grid):
        self.count += 1
        return self.kernel[grid]


@pytest.fixture
def persistent_launches(monkeypatch):
    spy = Launches(P._linear_persistent_kernel)
    monkeypatch.setattr(P, "_linear_persistent_kernel", spy)
    return spy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 63, 257])
def test_the_persistent_kernel_gives_the_bucket_kernels_bits(dtype, m, persistent_launches):
    x, w = rnd(m, K, dtype=dtype, seed=1), rnd(N, K, dtype=dtype, seed=2)
    b, h = rnd(N, dtype=dtype, seed=3), rnd(m, N, dtype=dtype, seed=4, scale=8.0)
    same_bits(P.persistent_linear(x, w), bucket.linear(x, w))
    same_bits(P.persistent_linear(x, w, b), bucket.linear(x, w, b))
    same_bits(P.persistent_linear(x, w, residual=h), bucket.linear(x, w, residual=h))
    w2 = rnd(2 * N, K, dtype=dtype, seed=5, scale=0.3)  # gate rows, then up rows
    same_bits(P.persistent_linear(x, w2, swiglu=True), bucket.linear_silu_mul(x, w2))
    assert persistent_launches.count == 4


def test_the_epilogue_in_column_halves_gives_the_same_bits(persistent_launches):
    """EPILOGUE_SPLIT=2 (what fit_shared_memory picks where the residual's block would not fit beside the
    stored one): bias, residual and SwiGLU over each column half, with the whole tile's bits."""
    bm, bn, bk, warps, stages = P.bucket.LINEAR_INTERPRET_CONFIG
    halves = (bm, bn, bk, warps, stages, 2, False, 2)
    x, w, w2 = rnd(70, K, dtype=torch.bfloat16, seed=16), rnd(N, K, dtype=torch.bfloat16, seed=17), \
        rnd(2 * N, K, dtype=torch.bfloat16, seed=18, scale=0.3)
    b, h = rnd(N, dtype=torch.bfloat16, seed=19), rnd(70, N, dtype=torch.bfloat16, seed=20, scale=8.0)
    same_bits(P.persistent_linear(x, w, b, config=halves), bucket.linear(x, w, b))
    same_bits(P.persistent_linear(x, w, residual=h, config=halves), bucket.linear(x, w, residual=h))
    same_bits(P.persistent_linear(x, w2, swiglu=True, config=halves), bucket.linear_silu_mul(x, w2))
    assert persistent_launches.count == 3


def test_the_shared_memory_fit_keeps_every_variant_under_the_limit():
    """The GPU's variants of the frozen tile, as fit_shared_memory trims them: bf16 keeps its tile and stages,
    the residual's epilogue goes to column halves, fp32 narrows (the compile test holds the real bytes)."""
    cfg = P.PERSISTENT_CONFIG
    assert P.fit_shared_memory(cfg, 2, False, False) == cfg
    assert P.fit_shared_memory(cfg, 2, True, False)[4:] == (cfg[4], cfg[5], cfg[6], 2)
    assert P.fit_shared_memory(cfg, 2, False, True)[1] == cfg[1] // 2
    assert P.fit_shared_memory(cfg, 4, True, False)[1] < cfg[1]


def test_a_wave_of_700_rows_and_its_rows_alone(persistent_launches):
    """More tiles than programs (each program walks several, in grouped order), the last row tile ragged."""
    x, w, w2 = rnd(700, K, dtype=torch.bfloat16, seed=6), rnd(40, K, dtype=torch.bfloat16, seed=7), \
        rnd(80, K, dtype=torch.bfloat16, seed=8, scale=0.3)
    full = P.persistent_linear(x, w)
    same_bits(full, bucket.linear(x, w))
    same_bits(P.persistent_linear(x[650:651].clone(), w), full[650:651])
    same_bits(P.persistent_linear(x, w2, swiglu=True), bucket.linear_silu_mul(x, w2))
    assert persistent_launches.count == 3


def test_the_comparison_sees_another_k_walk():
    """Canary: the same kernel summing K in steps of 32 instead of 64 (on CPU, where a step's products are
    rounded into the accumulator once per step) gives other bits, so the tests above can fail. In fp32: a
    bf16 output rounds most such differences away."""
    x, w = rnd(63, K, dtype=torch.float32, seed=1), rnd(N, K, dtype=torch.float32, seed=2)
    if DEVICE != "cpu":
        pytest.skip("on a GPU every BLOCK_K walks K in the same MMA steps: the bits are the same")
    bm, bn, _, warps, stages = bucket.LINEAR_INTERPRET_CONFIG
    other = P.persistent_linear(x, w, config=(bm, bn, 32, warps, stages, 2, False, 1))
    assert not torch.equal(other, bucket.linear(x, w))


def test_linear_routes_large_describable_calls_to_the_persistent_kernel(persistent_launches):
    x, w = rnd(P.PERSISTENT_ABOVE + 1, K, dtype=torch.bfloat16, seed=9), rnd(N, K, dtype=torch.bfloat16, seed=10)
    same_bits(P.linear(x[:-1], w), bucket.linear(x[:-1], w))  # 256 rows: the bucket kernel
    assert persistent_launches.count == 0
    same_bits(P.linear(x.view(1, *x.shape), w), bucket.linear(x, w).view(1, -1, N))  # 257 rows, leading dims kept
    assert persistent_launches.count == 1
    odd = rnd(P.PERSISTENT_ABOVE + 1, K + 1, dtype=torch.bfloat16, seed=11)[:, 1:]  # rows 2 bytes off 16-byte alignment
    assert not P.describable(odd) and P.describable(x, w)
    same_bits(P.linear(odd, w), bucket.linear(odd, w))  # a descriptor cannot read it: the bucket kernel
    assert persistent_launches.count == 1


def test_the_table_takes_the_persistent_family_only_behind_the_door(persistent_launches):
    """KernelTable.persistent_linear (MEMRA_LINEAR_PERSISTENT) sends linear, linear_add and linear_silu_mul
    there, with the bits of the table without it."""
    import dataclasses

    off = gpu_kernel_table()
    on = dataclasses.replace(off, persistent_linear=True)
    x, w = rnd(300, K, dtype=torch.bfloat16, seed=12), rnd(N, K, dtype=torch.bfloat16, seed=13)
    h, w2 = rnd(300, N, dtype=torch.bfloat16, seed=14), rnd(2 * N, K, dtype=torch.bfloat16, seed=15, scale=0.3)
    for op, args in (("linear", (x, w)), ("linear_add", (x, w, h)), ("linear_silu_mul", (x, w2))):
        before = persistent_launches.count
        expected = getattr(off, op)(*args)
        assert persistent_launches.count == before
        same_bits(getattr(on, op)(*args), expected)
        assert persistent_launches.count == before + 1, op


def test_the_door_is_read_once_and_on_by_default():
    """On since an H100 run of `memra bench throughput random:llama-3-8b` was faster with it (docs/PERFORMANCE.md)."""
    from memra.settings import Settings

    assert Settings.from_env({}).linear_persistent is True
    assert Settings.from_env({"MEMRA_LINEAR_PERSISTENT": "0"}).linear_persistent is False
    assert Settings().with_doors(MEMRA_LINEAR_PERSISTENT="0").as_env()["MEMRA_LINEAR_PERSISTENT"] == "0"
