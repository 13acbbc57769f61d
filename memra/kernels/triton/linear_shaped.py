"""The dense linears with each call's tile chosen from its whole shape (MEMRA_LINEAR_SHAPED): the bits of
triton.linear and triton.linear_persistent, fewer idle SMs.

Why: the bucket kernel picks its tile from M alone, and the persistent kernel has one tile. At decode's and
a mixed step's row counts that leaves SMs idle on the narrow projections: at 128 rows the 4,096-wide o and
down projections make 64 tiles of 64x128 for 132 SMs; at 256 rows the 6,144-wide qkv makes 192, two waves
of which the second is half empty; at 512 rows the persistent kernel's 128x256 tile gives o and down 64.
What fixes a row's bits is the K order, not the tile (triton.linear's notes: every candidate tile gives the
reference tile's bits, re-checked by the self-test), so the tile can follow N and K as well as M.

The choice is a small cost model, computed once per shape: a call of `tiles` output tiles on `sms` SMs runs
ceil(tiles / sms) waves; a wave takes K times its tile's time per k step (each candidate's, fitted to one
H100 sweep of every projection at 128-772 rows, docs/PERFORMANCE.md); the whole call takes no less than its
weights' read at HBM. Of the candidates
(today's tile first) the cheapest is taken, and today's is kept unless another is predicted SWITCH_GAIN
faster. The model only ranks tiles; it never touches bits. tools/gpu_tune_shaped.py times the candidates.

Off by default: on an H100 the picks are 4-17% faster than today's tiles at 128-512 rows in isolation (one
weight re-read), but the engine's decode steps at 128 and 256 rows and the offline throughput did not move
beyond the run-to-run spread (docs/PERFORMANCE.md).
"""

from __future__ import annotations

import functools

import torch
import triton

from memra.kernels.triton import linear as bucket
from memra.kernels.triton import linear_persistent as persistent
from memra.kernels.triton.common import _interpreting

HBM = 2.7e12  # bytes/s of weights one call streams at best (H100: 2.5-2.8 TB/s in the tiles' single waves)
SWITCH_GAIN = 0.9  # another tile replaces today's only if predicted at most this fraction of its time
SHAPED_ABOVE = 64  # calls of at most this many rows keep the bucket kernel's tile (at the weights' read rate)
# (tile, seconds one tile takes per k step in bf16, fitted to that H100 sweep); today's tile first.
# The bucket kernel's (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) for 65-256 rows: 64x64 with six stages
# keeps as many bytes in flight as 64x128 with four.
BUCKET_TILES = (((64, 128, 128, 4, 4), 5.2e-9), ((64, 64, 128, 4, 6), 3.5e-9), ((128, 128, 64, 8, 4), 8.5e-9))
# the persistent kernel's, past PERSISTENT_ABOVE rows
PERSISTENT_TILES = ((persistent.PERSISTENT_CONFIG, 11.5e-9), ((128, 128, 64, 8, 4, 8, False, 1), 7.5e-9))


def predicted_seconds(m: int, n: int, k: int, tile: tuple, per_k: float, sms: int, elem_bytes: int = 2) -> float:
    """The cost model's time for an [m, k] x [n, k]^T call in `tile` (per_k: its time per k step in bf16) on
    `sms` SMs (module notes). fp32 doubles every tile's bytes and the weights', so the ranking holds."""
    waves = triton.cdiv(triton.cdiv(m, tile[0]) * triton.cdiv(n, tile[1]), sms)
    return max(waves * k * per_k, n * k * 2 / HBM) * elem_bytes / 2


def _pick(m: int, n: int, k: int, tiles: tuple, sms: int, elem_bytes: int) -> tuple:
    cost = {tile: predicted_seconds(m, n, k, tile, per_k, sms, elem_bytes) for tile, per_k in tiles}
    today, best = tiles[0][0], min(cost, key=cost.get)
    return best if cost[best] <= SWITCH_GAIN * cost[today] else today


@functools.cache
def bucket_tile(m: int, n: int, k: int, sms: int, elem_bytes: int = 2) -> tuple:
    """The bucket kernel's tile for an m-row call on a weight [n, k] (SwiGLU: n = 2F, its tiles read both halves)."""
    if m <= SHAPED_ABOVE or m > persistent.PERSISTENT_ABOVE:
        return bucket.bucket_config(m, elem_bytes)
    return _pick(m, n, k, BUCKET_TILES, sms, elem_bytes)


@functools.cache
def persistent_tile(m: int, n: int, k: int, sms: int, elem_bytes: int = 2) -> tuple:
    """The persistent kernel's tile for an m-row call (past PERSISTENT_ABOVE) on a weight [n, k]."""
    return _pick(m, n, k, PERSISTENT_TILES, sms, elem_bytes)


NOMINAL_SMS = 132  # an H100's or H200's, for a CPU tensor (the compile test records a GPU's launches on CPU)


def _sms(x: torch.Tensor) -> int:
    if not x.is_cuda:
        return NOMINAL_SMS
    return persistent._sm_count(x.device.index if x.device.index is not None else torch.cuda.current_device())


def _chooser(x: torch.Tensor):
    """(m, n, k, persistent) -> the tile for a call on x's device and dtype; None under the interpreter (its one
    tile: its numpy dot sums in an order set by the tile)."""
    if _interpreting():
        return None
    sms, elem_bytes = _sms(x), x.element_size()
    return lambda m, n, k, persistent: (persistent_tile if persistent else bucket_tile)(m, n, k, sms, elem_bytes)


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
           residual: torch.Tensor | None = None) -> torch.Tensor:
    """triton.linear_persistent.linear's routing, contract and bits, with the tile from bucket_tile or
    persistent_tile."""
    return persistent.linear(x, w, b, residual, tile=_chooser(x))


def linear_silu_mul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """triton.linear_persistent.linear_silu_mul's routing, contract and bits, the tile chosen as `linear`'s."""
    return persistent.linear_silu_mul(x, w, tile=_chooser(x))
