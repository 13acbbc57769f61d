"""The two probes of what this device can do — read bandwidth and dense matmul peak — measured in the
same run as the cells, so every roofline is this device's own, not a datasheet's."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from memra.bench.config import GIB
from memra.bench.timing import best_seconds


def measure_read_bandwidth(device: str | torch.device, nbytes: int | None = None, repeats: int = 5) -> float:
    """Read bandwidth in bytes/s: a sum over one large tensor (every byte read once, nothing written
    back but a scalar — the access pattern of a decode step's weight reads). Best of `repeats`.
    Default size 4 GiB on CUDA (far past any cache), 32 MiB on CPU (so it stays quick to test)."""
    dev = torch.device(device)
    n = nbytes or (4 * GIB if dev.type == "cuda" else 32 * 2**20)
    x = torch.ones(n // 4, dtype=torch.float32, device=dev)
    seconds = best_seconds(lambda: x.sum(), dev, repeats)
    return (n // 4) * 4 / seconds


def measure_matmul_peak(device: str | torch.device, dtype: torch.dtype = torch.bfloat16, size: int | None = None,
                        repeats: int = 5) -> float:
    """Dense matmul throughput in FLOP/s: square GEMMs of `size` (default 8192 on CUDA, 256 on CPU),
    several per timed call on CUDA so launch overhead does not count. Best of `repeats`."""
    dev = torch.device(device)
    n = size or (8192 if dev.type == "cuda" else 256)
    inner = 8 if dev.type == "cuda" else 1
    gen = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(n, n, device=dev, generator=gen).to(dtype)
    b = torch.randn(n, n, device=dev, generator=gen).to(dtype)

    def run() -> None:
        for _ in range(inner):
            torch.mm(a, b)

    return 2 * n**3 * inner / best_seconds(run, dev, repeats)


@dataclass(frozen=True)
class Probes:
    read_bytes_per_s: float
    matmul_flops_per_s: float
    matmul_dtype: str
    seconds: float  # how long the probes took

    @classmethod
    def measure(cls, device: str | torch.device, dtype: torch.dtype, repeats: int) -> "Probes":
        t0 = time.perf_counter()
        bw = measure_read_bandwidth(device, repeats=repeats)
        peak = measure_matmul_peak(device, dtype, repeats=repeats)
        return cls(bw, peak, str(dtype).removeprefix("torch."), time.perf_counter() - t0)
