"""The shaped linear (memra.kernels.triton.linear_shaped, MEMRA_LINEAR_SHAPED): its cost model's choices on the
shapes memra serves, its routing, and the door.

A tile never changes a row's bits (the K order does), so on CPU, where Triton's interpreter runs one tile for
every call, the family's outputs are the persistent family's; on a GPU the self-test's probes hold the chosen
tiles to every bucket's (tests/test_cuda_exact.py, with a canary), and the compile test compiles every tile
the shaped table launches.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

pytest.importorskip("triton")

from conftest import gpu_kernel_table  # noqa: E402

from memra.errors import MemraError  # noqa: E402
from memra.kernels.triton import linear as bucket  # noqa: E402
from memra.kernels.triton import linear_persistent as P  # noqa: E402
from memra.kernels.triton import linear_shaped as S  # noqa: E402

DEVICE = os.environ.get("MEMRA_TEST_DEVICE", "cpu")
SMS = 132  # an H100's


def rnd(*shape, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=DEVICE, dtype=dtype)


def test_the_cost_model_gives_narrow_projections_more_tiles():
    """Llama-3-8B's projections: o and down at 128 rows take 64x64 (128 tiles, not 64), qkv at 256 rows 128x128
    (96 tiles in one wave, not 192 in two), o and down at 512 rows the persistent kernel's 128x128; Qwen3.5-9B's
    10,240-wide attention qkv at 128 rows 128x128 (80 tiles in one wave, not 160 in two)."""
    assert S.bucket_tile(128, 4096, 4096, SMS)[:2] == (64, 64)
    assert S.bucket_tile(128, 4096, 14336, SMS)[:2] == (64, 64)
    assert S.bucket_tile(256, 6144, 4096, SMS)[:2] == (128, 128)
    assert S.persistent_tile(512, 4096, 4096, SMS)[:2] == (128, 128)
    assert S.persistent_tile(512, 4096, 14336, SMS)[:2] == (128, 128)
    assert S.bucket_tile(128, 10240, 4096, SMS)[:2] == (128, 128)


def test_the_cost_model_keeps_todays_tile_where_it_fills_the_sms():
    """Today's tiles where they already fill the SMs or stream the weights: every call of at most 64 rows,
    qkv at 128 rows (96 tiles), o at 256 (128 tiles), gate|up at 772 rows (the persistent 128x256), and
    Qwen3.5-9B's gate|up at 192 rows (5 waves of 64x128 against 3 of 128x128: within SWITCH_GAIN)."""
    for m in (1, 16, 40, 64):
        assert S.bucket_tile(m, 4096, 4096, SMS) == bucket.bucket_config(m)
    assert S.bucket_tile(128, 6144, 4096, SMS) == bucket.bucket_config(128)
    assert S.bucket_tile(256, 4096, 4096, SMS) == bucket.bucket_config(256)
    assert S.persistent_tile(772, 28672, 4096, SMS) == P.PERSISTENT_CONFIG
    assert S.persistent_tile(772, 4096, 4096, SMS) == P.PERSISTENT_CONFIG
    assert S.bucket_tile(192, 24576, 4096, SMS) == bucket.bucket_config(192)


def test_the_model_counts_waves_and_the_weights_read():
    """One wave of 128 tiles costs one tile; 133 cost two; nothing is cheaper than reading the weights."""
    (tile, per_k) = S.BUCKET_TILES[0]
    assert tile == bucket.bucket_config(128) == bucket.bucket_config(256)  # today's tile comes first
    one = S.predicted_seconds(256, 4096, 4096, tile, per_k, 132)  # 4 x 32 tiles
    assert one == 4096 * per_k > 4096 * 4096 * 2 / S.HBM  # a tile's time, not the weights' read
    assert S.predicted_seconds(256, 4224, 4096, tile, per_k, 132) == one  # 4 x 33 = 132: still one wave
    assert S.predicted_seconds(256, 4352, 4096, tile, per_k, 132) == 2 * one  # 4 x 34 = 136: two
    assert S.predicted_seconds(1, 128256, 4096, (16, 16), 1e-12, 132) == 128256 * 4096 * 2 / S.HBM
    assert S.persistent_tile(300, 4096, 4096, 132, 4) == S.persistent_tile(300, 4096, 4096, 132)  # fp32 ranks alike


@pytest.mark.parametrize("m", [3, 100, 300])
def test_the_family_gives_the_persistent_familys_bits(m):
    """Plain, bias, residual and SwiGLU, below and above PERSISTENT_ABOVE (under the interpreter: one tile)."""
    x, w, w2 = rnd(m, 256, seed=1), rnd(96, 256, seed=2), rnd(192, 256, seed=3)
    b, h = rnd(96, seed=4), rnd(m, 96, seed=5)
    assert torch.equal(S.linear(x, w), P.linear(x, w))
    assert torch.equal(S.linear(x, w, b), P.linear(x, w, b))
    assert torch.equal(S.linear(x, w, residual=h), P.linear(x, w, residual=h))
    assert torch.equal(S.linear_silu_mul(x, w2), P.linear_silu_mul(x, w2))
    assert torch.equal(bucket.linear(x, w, config=(64, 64, 128, 4, 6)), bucket.linear(x, w))


def test_the_table_takes_the_shaped_family_only_behind_its_door():
    off = dataclasses.replace(gpu_kernel_table(), persistent_linear=True)
    on = dataclasses.replace(off, shaped_linear=True)
    assert (gpu_kernel_table().linear_family, off.linear_family, on.linear_family) == ("bucket", "persistent", "shaped")
    assert on._dense() is S and off._dense() is P
    x, w = rnd(20, 256, seed=6), rnd(96, 256, seed=7)
    assert torch.equal(on.linear(x, w), off.linear(x, w))


def test_the_door_is_off_by_default_and_needs_the_persistent_kernel():
    from memra.settings import Settings

    assert Settings.from_env({}).linear_shaped is False
    assert Settings.from_env({"MEMRA_LINEAR_SHAPED": "1"}).as_env()["MEMRA_LINEAR_SHAPED"] == "1"
    with pytest.raises(MemraError, match="MEMRA_LINEAR_SHAPED=1 needs MEMRA_LINEAR_PERSISTENT=1"):
        Settings.from_env({"MEMRA_LINEAR_SHAPED": "1", "MEMRA_LINEAR_PERSISTENT": "0"})
