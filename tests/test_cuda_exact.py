"""Exactness on the GPU (what tools/gpu_exact_report.py used to print, now pass/fail):

- the platform self-test on this GPU, bf16 and fp32: repeated identical calls give identical bits (the
  exact path refuses to run otherwise), and the batch-invariant Triton kernels keep their promise;
- `memra gate` (config and strict) on the bundled demo in bf16;
- the gate on a random-weight Qwen3.5-9B-shaped model in bf16 (4 of its 32 layers: 3 GDN + 1 attention,
  every real width, the 248k vocabulary) at B = 1, 4, 16, 64, on the `stacked` plan `auto` picks there.

The CPU side of the same promises is tests/test_exact.py and tests/test_gate.py. Decode tokens/s (exact
against MEMRA_EXACT=0) is `memra bench model`.
"""

from __future__ import annotations

import pytest
import torch

import memra
from cuda_marks import needs_cuda
from memra.gate import run_battery
from memra.kernels.exact import self_test

pytestmark = needs_cuda

DTYPES = [torch.bfloat16, torch.float32]


@pytest.fixture(scope="module")
def demo():
    return memra.load("demo", device="cuda", dtype="bfloat16", tokenizer=False)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_self_test_finds_this_gpu_deterministic(dtype):
    failed = self_test(dtype, "cuda")
    assert not [f for f in failed if "repeat" in f], f"nondeterministic on this GPU: {failed}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_self_test_triton_probes_pass(dtype):
    """The batch-invariant kernels' probes (linear at every M bucket, norms, packed weights, MoE, prefill
    attention, GDN's chunked prefill): a row's bits do not depend on the call it is in."""
    failed = [f for f in self_test(dtype, "cuda") if f.startswith("triton")]
    assert not failed, failed


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_self_test_holds_the_persistent_linear_to_the_buckets(dtype):
    """MEMRA_LINEAR_PERSISTENT's probes: the 300- and 600-row calls through the persistent kernel, their rows
    against every bucket's, SwiGLU and the residual epilogue too."""
    failed = [f for f in self_test(dtype, "cuda", linear_family="persistent") if f.startswith("triton")]
    assert not failed, failed


def test_the_persistent_probes_fail_on_one_flipped_bit(monkeypatch):
    """Canary: a persistent kernel one bit off in one value is caught, and only with the door's probes."""
    from memra.kernels.triton import linear_persistent

    real = linear_persistent.persistent_linear

    def one_bit_off(*args, **kwargs):
        y = real(*args, **kwargs)
        y.view(torch.int16)[0, 0] ^= 1
        return y

    monkeypatch.setattr(linear_persistent, "persistent_linear", one_bit_off)
    assert any(f.startswith("triton linear[") for f in self_test(torch.bfloat16, "cuda", linear_family="persistent"))
    assert not [f for f in self_test(torch.bfloat16, "cuda") if f.startswith("triton linear")]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_self_test_holds_the_shaped_tiles_to_the_buckets(dtype):
    """MEMRA_LINEAR_SHAPED's probes: the [1024 x 4096] weight takes its other tiles (64x64 at 100 rows, the
    persistent kernel's 128x128 at 300 and 600), their rows held to every bucket's."""
    from memra.kernels.triton import linear_shaped

    assert linear_shaped.bucket_tile(100, 1024, 4096, 132)[:2] == (64, 64)
    assert linear_shaped.persistent_tile(600, 1024, 4096, 132)[:2] == (128, 128)
    failed = [f for f in self_test(dtype, "cuda", linear_family="shaped") if f.startswith("triton")]
    assert not failed, failed


def test_the_shaped_probes_fail_on_one_flipped_bit(monkeypatch):
    """Canary: a chosen tile one bit off in one value is caught by the shaped family's probes."""
    from memra.kernels.triton import linear

    real = linear.linear

    def one_bit_off(*args, config=None, **kwargs):
        y = real(*args, config=config, **kwargs)
        if config is not None:
            y.view(torch.int16).view(-1)[0] ^= 1
        return y

    monkeypatch.setattr(linear, "linear", one_bit_off)
    assert any(f.startswith("triton linear[") for f in self_test(torch.bfloat16, "cuda", linear_family="shaped"))


@pytest.mark.parametrize("mode", ["config", "strict"])
def test_gate_demo_bf16(demo, mode):
    lines: list[str] = []
    ok = run_battery(demo, steps=16, batch=4, mode=mode, out=lines.append)
    assert ok, "\n".join(lines)
    assert lines[-1].startswith("ALL GREEN")


@pytest.mark.parametrize("batch", [1, 4, 16, 64])
def test_gate_9b_shape_bf16(shape_9b, batch):
    lines: list[str] = []
    ok = run_battery(shape_9b, steps=2, batch=batch, mode="config", plen=8, out=lines.append)
    assert ok, "\n".join(lines)
    assert "decode plan: stacked" in "\n".join(lines)  # all rows in one forward on the invariant kernels


def test_gate_9b_shape_with_a_bf16_gdn_state(shape_9b):
    """MEMRA_GDN_STATE_DTYPE=bfloat16 (vLLM's --mamba-ssm-cache-dtype bfloat16): every arm at B=16 on the
    stacked plan, the state stored in bf16 and carried as stored."""
    model = shape_9b.with_doors(MEMRA_GDN_STATE_DTYPE="bfloat16")
    lines: list[str] = []
    ok = run_battery(model, steps=2, batch=16, mode="config", plen=8, out=lines.append)
    assert ok, "\n".join(lines)
    assert "GDN state bfloat16" in lines[0] and "decode plan: stacked" in "\n".join(lines)
