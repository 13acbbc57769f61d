"""Batch invariance by construction: fixed row-group shapes, and a self-test of what that relies on.

Why results change with the batch: a kernel picks its reduction order from the shape of the call
(GEMV vs GEMM, blocking along K, split reductions when rows are few). So the exact path never lets
the batch choose a shape. Every op that reduces along a row (matmuls, norms, softmax) is called on
row groups of a shape fixed in advance:

    RowPlan.per_row()  each row alone, [1, K]: decode rows; a batch of B is B calls with B=1's shape.
    RowPlan.tiles()    consecutive tiles of TILE rows, zero-padded to exactly TILE: prefill. Correct
                       when a row's bits in a [TILE, K] call depend only on that row; the self-test
                       checks exactly that, at every position in the tile, with random neighbours.
    RowPlan.whole()    one call over all rows: the fast non-exact path, kept for comparison only.

Elementwise ops run on whole tensors; the self-test checks that their result for a value does not
depend on where in the tensor it sits (vectorized bodies vs scalar tails can differ on some CPUs).
If any check fails, exact mode is refused with a message naming the op (fail closed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from memra.errors import MemraError

TILE = 64  # prefill row-tile height; also the GDN chunk length, so 64-aligned prime cuts line up


@dataclass(frozen=True)
class RowPlan:
    kind: str  # "row" | "tile" | "whole"

    @staticmethod
    def per_row() -> "RowPlan":
        return RowPlan("row")

    @staticmethod
    def tiles() -> "RowPlan":
        return RowPlan("tile")

    @staticmethod
    def whole() -> "RowPlan":
        return RowPlan("whole")

    def apply(self, fn: Callable[..., torch.Tensor], x: torch.Tensor, *args) -> torch.Tensor:
        n = x.shape[0]
        if self.kind == "whole" or n == 0:
            return fn(x, *args)
        if self.kind == "row":
            if n == 1:
                return fn(x, *args)
            return torch.cat([fn(x[i : i + 1], *args) for i in range(n)])
        outs = []
        for a in range(0, n, TILE):
            piece = x[a : a + TILE]
            m = piece.shape[0]
            if m < TILE:
                piece = torch.cat((piece, piece.new_zeros((TILE - m, *piece.shape[1:]))))
            outs.append(fn(piece, *args)[:m])
        return outs[0] if len(outs) == 1 else torch.cat(outs)


class ExactnessError(MemraError):
    """This platform breaks an invariance the exact path relies on."""


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def _check(name: str, a: torch.Tensor, b: torch.Tensor, failures: list[str]) -> None:
    if not torch.equal(_bits(a), _bits(b)):
        failures.append(name)


@torch.inference_mode()
def self_test(dtype: torch.dtype, device: torch.device | str, shapes: tuple[tuple[int, int], ...] = ((256, 64), (640, 256))) -> list[str]:
    """Check, on this device and dtype, every invariance the exact plans rely on. Returns failed checks."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=gen).to(device=device, dtype=dtype)
    failures: list[str] = []
    for n_out, k in shapes:
        w = rnd(n_out, k)
        row = rnd(1, k)
        alone = F.linear(row, w)
        # per-row plan: repeated calls give the same bits (determinism)
        _check(f"linear[1x{k}] repeat", F.linear(row.clone(), w), alone, failures)
        # tile plan: the row's bits at every position of a TILE tile, neighbours random or zero
        in_tile = F.linear(torch.cat((row, torch.zeros(TILE - 1, k, device=device, dtype=dtype))), w)[0:1]
        for pos in (0, 1, 7, 31, TILE - 1):
            tile = rnd(TILE, k)
            tile[pos] = row[0]
            _check(f"linear[{TILE}x{k}] row {pos}", F.linear(tile, w)[pos : pos + 1], in_tile, failures)
        # row reductions used per group (norms, softmax) at every position of a tile
        x = rnd(TILE, k)
        ref_norm = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True))
        ref_soft = torch.softmax(x.float(), -1)
        for pos in (0, 5, TILE - 1):
            _check(f"row norm [{TILE}x{k}] row {pos} vs alone", torch.rsqrt(x[pos:pos + 1].float().pow(2).mean(-1, keepdim=True)), ref_norm[pos:pos + 1], failures)
            _check(f"row softmax [{TILE}x{k}] row {pos} vs alone", torch.softmax(x[pos:pos + 1].float(), -1), ref_soft[pos:pos + 1], failures)
    # elementwise transcendental ops: a value's result must not depend on its offset in the tensor
    v = rnd(1, 37).float()
    for name, fn in (("exp", torch.exp), ("sigmoid", torch.sigmoid), ("silu", F.silu), ("softplus", F.softplus),
                     ("rsqrt", lambda t: torch.rsqrt(t.abs() + 1)), ("cos", torch.cos), ("sin", torch.sin)):
        alone = fn(v)
        for lead in (1, 3, 8, 13, 64):
            padded = torch.cat((rnd(1, lead).float(), v), dim=1)
            _check(f"{name} at offset {lead}", fn(padded)[:, lead:], alone, failures)
    return failures


_VERIFIED: dict[tuple[str, str], list[str]] = {}


def require_exact(dtype: torch.dtype, device: torch.device | str) -> None:
    """Run the self-test once per (device type, dtype) in this process; refuse exact mode if it fails."""
    key = (str(torch.device(device).type), str(dtype))
    if key not in _VERIFIED:
        _VERIFIED[key] = self_test(dtype, device)
    failed = _VERIFIED[key]
    if failed:
        raise ExactnessError(
            f"exact mode refused on {key[0]} {key[1]}: this platform breaks row invariance in "
            f"{', '.join(failed[:4])}{' ...' if len(failed) > 4 else ''}. Results would depend on the batch; "
            "set MEMRA_EXACT=0 to run the non-exact path knowingly."
        )
