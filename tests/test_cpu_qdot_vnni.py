"""The CPU integer-dot kernel's AVX-512 VNNI rows (memra/kernels/cpu/qdot_vnni.cpp) against its AVX2 and scalar
loops and the pure-torch twin, bit for bit, where this CPU has VNNI (the test machine's EPYC does; elsewhere
these skip and tests/test_cpu_qdot.py covers the other levels).

- every format, K of 1 to 6 256-blocks (a chunk of four and a ragged one), N not a multiple of the 4-row
  groups, M = 1 and 3, random bytes and the extreme quants that bound the int16 lanes vpdpwssd reads;
- the library builds and finds VNNI where /proc/cpuinfo lists it (so the skips cannot hide a failed build);
- liveness: the library's per-level output counters (memra_qdot_outputs) show the level-2 call ran the VNNI
  rows and the level-1 call did not; a canary: one flipped quant changes the VNNI output.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from memra.kernels import cpu_qdot, qdot_reference, quant, split
from memra.kernels.quant import QType, QuantWeight

LIB = cpu_qdot.library()
needs_vnni = pytest.mark.skipif(LIB is None or LIB.avx2 < 2, reason="no AVX-512 VNNI on this CPU (or no compiler)")
FLAGS = ("avx2", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni")  # as memra_qdot_has_avx2


def test_the_library_takes_the_vnni_rows_where_the_cpu_has_them():
    """The skips below cannot hide a failed build or a missed CPU check: on a Linux CPU whose flags list VNNI,
    with a compiler on PATH, the library builds and reports level 2."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        pytest.skip("no /proc/cpuinfo")
    if not all(f in flags for f in FLAGS) or not any(shutil.which(c) for c in cpu_qdot.COMPILERS):
        pytest.skip("no AVX-512 VNNI on this CPU, or no compiler")
    assert LIB is not None and LIB.avx2 == 2

TYPES = {"q8_0": QType.Q8_0, "q4_k": QType.Q4_K, "q5_k": QType.Q5_K, "q6_k": QType.Q6_K}
SCALE_AT = {QType.Q8_0: (0,), QType.Q4_K: (0, 2), QType.Q5_K: (0, 2), QType.Q6_K: (208,)}


def packed(qtype: QType, n: int, k: int, seed: int, fill: int | None = None):
    """A split layout [n, k] of random bytes (or all `fill`), with small finite fp16 d (and dmin)."""
    g = torch.Generator().manual_seed(seed)
    block, nbytes = quant.PACKABLE[qtype]
    rows = n * (k // block)
    if fill is None:
        data = torch.randint(0, 256, (rows, nbytes), dtype=torch.uint8, generator=g)
    else:
        data = torch.full((rows, nbytes), fill, dtype=torch.uint8)
    for at in SCALE_AT[qtype]:
        d = (torch.rand(rows, generator=g) * 0.01 + 1e-3).half()
        data[:, at : at + 2] = d[:, None].view(torch.uint8)
    return split.split_layout(QuantWeight(qtype, data.reshape(n, -1), (n, k), torch.float32))


def levels(x, w):
    """The kernel's output at the VNNI level, with the outputs each level's counter gained over the call."""
    before = [LIB.memra_qdot_outputs(lv) for lv in range(3)]
    out = cpu_qdot.linear(x, w, avx2=2)
    return out, [LIB.memra_qdot_outputs(lv) - b for lv, b in enumerate(before)]


@needs_vnni
@pytest.mark.parametrize("fmt", list(TYPES))
@pytest.mark.parametrize("k", [224, 256, 1024, 1280, 1536])
def test_vnni_rows_are_the_avx2_and_scalar_loops_and_the_twin(fmt, k):
    if k % 256 and fmt != "q8_0":
        pytest.skip("K-quants come in 256-blocks")
    for n, m, seed in ((13, 1, 0), (6, 3, 1)):
        w = packed(TYPES[fmt], n, k, seed)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed + 10)) * torch.rand(k) * 3
        out, ran = levels(x, w)
        vnni = k % 256 == 0  # Q8_0's VNNI loop takes eight 32-blocks a step (224: seven, the AVX2 loop's)
        assert ran == ([0, 0, n * m] if vnni else [0, n * m, 0]), ran
        assert torch.equal(out, cpu_qdot.linear(x, w, avx2=1))
        assert torch.equal(out, cpu_qdot.linear(x, w, avx2=0))
        assert torch.equal(out, qdot_reference.linear(x, w))


@needs_vnni
@pytest.mark.parametrize("fmt", list(TYPES))
@pytest.mark.parametrize("fill", [0x00, 0xFF, 0x80])
def test_vnni_rows_at_the_extreme_quants(fmt, fill):
    """Every byte `fill` (Q4_K / Q5_K: q = 15 / 31 with scales and mins 63; Q6_K: q - 32 = -32 or 31 with
    scales -1 or -128), activations all at +-127 after quantizing: each vpdpbusd lane at its largest."""
    w = packed(TYPES[fmt], 5, 1536, 3, fill)
    x = torch.ones(4, 1536)
    x[1] = -1
    x[2, ::2] = -1
    x[3] = torch.randn(1536, generator=torch.Generator().manual_seed(4))
    out, ran = levels(x, w)
    assert ran[2] == 5 * 4
    assert torch.equal(out, cpu_qdot.linear(x, w, avx2=1))
    assert torch.equal(out, qdot_reference.linear(x, w))


@needs_vnni
@pytest.mark.parametrize("fmt", list(TYPES))
def test_the_avx2_level_runs_no_vnni_rows_and_a_flipped_quant_shows(fmt):
    w, x = packed(TYPES[fmt], 9, 512, 5), torch.randn(2, 512, generator=torch.Generator().manual_seed(6))
    before = LIB.memra_qdot_outputs(2)
    cpu_qdot.linear(x, w, avx2=1)
    assert LIB.memra_qdot_outputs(2) == before
    out, _ = levels(x, w)
    quants = next(t for t in (getattr(w, f, None) for f in ("q", "qs", "ql")) if t is not None)
    quants[7, 100] ^= 0x11  # the canary: the comparison above is not blind to the quants of row 7
    try:
        flipped, _ = levels(x, w)
    finally:
        quants[7, 100] ^= 0x11
    assert not torch.equal(flipped[:, 7], out[:, 7]) and torch.equal(flipped[:, :7], out[:, :7])
