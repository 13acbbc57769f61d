"""Marks shared by the GPU tests (tests/test_cuda_*.py), which run on a GPU as

    MEMRA_TEST_DEVICE=cuda python -m pytest -o addopts='' -m "cuda and not slow" tests/test_cuda_*.py

`needs_cuda`: the test is marked `cuda` (the default addopts deselect it; `-m cuda` selects it) and is
skipped unless this run is a GPU run: MEMRA_TEST_DEVICE=cuda (tests/conftest.py: Triton compiles its
kernels instead of running them in its interpreter) and a CUDA device present.
`needs_gpus(n)`: the same, and at least n CUDA devices (the multi-GPU pipeline tests).
`cuda_only`: needs_cuda as a decorator, for one test of a module that also has CPU tests.
`DEVICES`: cpu (the default suite) and cuda (a `cuda`-marked parameter), for checks that mean something
on both.
"""

from __future__ import annotations

import pytest
import torch

from conftest import DEVICE

ON_GPU = DEVICE.startswith("cuda") and torch.cuda.is_available()
RUN_ON_GPU = "run with MEMRA_TEST_DEVICE=cuda pytest -m cuda on a machine with a CUDA device"

needs_cuda = [pytest.mark.cuda, pytest.mark.skipif(not ON_GPU, reason=f"needs a CUDA device ({RUN_ON_GPU})")]


def gpu_count() -> int:
    return torch.cuda.device_count() if ON_GPU else 0


def needs_gpus(n: int) -> list:
    return [pytest.mark.cuda,
            pytest.mark.skipif(gpu_count() < n, reason=f"needs {n} CUDA devices, {gpu_count()} here ({RUN_ON_GPU})")]


DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]


def cuda_only(fn):
    """One test, not a whole module, marked as needs_cuda."""
    for mark in needs_cuda:
        fn = mark(fn)
    return fn
