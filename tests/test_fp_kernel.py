"""The packed GPU linear (memra.kernels.triton.quant) over FP8 block-scaled and NVFP4 layouts
(memra.kernels.split.Fp8BlockSplit / Nvfp4Split): its weight values are the CPU decode's (and so the
format reference's) bit for bit, every byte code included; a row's bits do not depend on the batch; the
product is the dense twin's within the summation order. On CPU in Triton's interpreter (conftest sets
TRITON_INTERPRET=1); the same file on a GPU with MEMRA_TEST_DEVICE=cuda checks the compiled kernel's bits.
On a GPU this path runs only with --packed-weights / packed_weights=True (default: dequantized at load)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from memra.kernels import reference
from memra.kernels.split import Fp8BlockSplit, Nvfp4Split
from memra.loading.fp_formats import nvfp4_block_scales
from memra.loading.fp_reference import fp8_block_reference, nvfp4_reference

from cuda_marks import needs_cuda

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton not installed")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# cpu: Triton's interpreter (the default suite); cuda: the compiled kernel's bits (MEMRA_TEST_DEVICE=cuda -m cuda)
DEVICES = [pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRETED, reason="needs Triton's interpreter")),
           pytest.param("cuda", marks=needs_cuda)]
TOL = {torch.float32: 2e-5, torch.bfloat16: 2 ** -6}


def layouts(n: int, k: int, seed: int):
    """(Fp8BlockSplit in 32 x 48 blocks, Nvfp4Split), random bytes in every field (FP8 NaN codes apart)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 256, (n, k), generator=gen, dtype=torch.uint8)
    q[(q & 0x7F) == 0x7F] = 0x30
    q = q.view(torch.float8_e4m3fn)
    s = torch.rand(-(-n // 32), -(-k // 48), generator=gen) * 0.02 + 1e-3
    fp8 = Fp8BlockSplit(q, s.repeat_interleave(32, 0)[:n].contiguous(), 48, torch.float32)
    fp8_ref = fp8_block_reference(q, s, (32, 48))
    packed = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
    scale = (torch.rand(n, -(-k // 16), generator=gen) * 4 + 0.01).to(torch.float8_e4m3fn)
    glob = torch.tensor(3.1e-3)
    fp4 = Nvfp4Split(packed, nvfp4_block_scales(scale, glob, False), torch.float32)
    return (fp8, fp8_ref), (fp4, nvfp4_reference(packed, scale, glob, False))


def on(layout, dtype, device):
    import dataclasses

    return dataclasses.replace(layout.to(device), dtype=dtype)


def same_bits(a, b):
    nan = a.isnan()
    assert torch.equal(nan, b.isnan())
    assert torch.equal(a[~nan].contiguous().view(torch.uint8), b[~nan].contiguous().view(torch.uint8))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_weight_values_equal_the_reference(dtype, device):
    """An identity x reads the weight out (y[i, n] = 0 + ... + w[n, i]): K = 200 (ragged last FP8 block of
    48 columns and NVFP4 group of 16), N = 40 (ragged last 32-row block and last tile); random bytes in
    every field (FP8's NaN codes apart: a NaN in a row poisons its whole read-out; see the next test)."""
    from memra.kernels.triton import quant as quant_triton

    n, k = 40, 200
    for layout, ref in layouts(n, k, seed=1):
        eye = torch.eye(k, dtype=dtype, device=device)
        got = quant_triton.linear(eye, on(layout, dtype, device)).t().contiguous()
        want = ref.to(dtype).to(device)
        same_bits(got, torch.where(want == 0, torch.zeros_like(want), want))  # 0 + w: a -0 reads +0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_decodes_every_fp8_code(dtype, device):
    """All 256 e4m3 codes, one a row (K = 1, so x = [[1]] reads each alone): NaN codes decode to NaN."""
    from memra.kernels.triton import quant as quant_triton

    q = torch.arange(256, dtype=torch.uint8).view(256, 1).view(torch.float8_e4m3fn)
    s = torch.tensor([[0.75]] * 256)
    got = quant_triton.linear(torch.ones(1, 1, dtype=dtype, device=device),
                              on(Fp8BlockSplit(q, s, 128, torch.float32), dtype, device))[0]
    want = fp8_block_reference(q, s[:1], (256, 128))[:, 0].to(dtype).to(device)
    same_bits(got, torch.where(want == 0, torch.zeros_like(want), want))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.slow)])
def test_rows_do_not_depend_on_the_batch_and_match_the_twin(dtype, device):
    from memra.kernels.triton import quant as quant_triton

    n, k = 72, 1056  # K past one split-K chunk (QUANT_CHUNK_K = 1024), ragged
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(66, k, generator=gen).to(device, dtype)  # past 64: both of QUANT_BUCKETS' tiles
    bias = torch.randn(n, generator=gen).to(device, dtype)
    for layout, ref in layouts(n, k, seed=2):
        w = on(layout, dtype, device)
        full = quant_triton.linear(x, w, bias)
        twin = reference.linear(x, ref.to(device, dtype), bias)
        err = ((full.float() - twin.float()).abs().max() / twin.float().abs().max()).item()
        assert err <= TOL[dtype], err
        for m in (1, 7, 64, 65):
            same_bits(quant_triton.linear(x[:m], w, bias), full[:m])
        same_bits(quant_triton.linear(x[5:6], w, bias)[0], full[5])


@pytest.mark.slow  # ~50 s in the interpreter on a loaded 2-core box
@pytest.mark.skipif(not INTERPRETED, reason="the interpreter runs the kernels on CPU tensors")
def test_a_packed_model_on_the_gpu_kernel_table(tmp_path, monkeypatch):
    """A Qwen3.5 NVFP4 checkpoint, packed, under the table a CUDA model gets (its linears on this kernel,
    in the interpreter): its logits agree with the CPU's packed path to fp32 rounding."""
    import importlib.util as iu
    from pathlib import Path

    from conftest import gpu_kernel_table
    from memra.kernels.table import KernelTable
    from memra.loading.checkpoint import load

    spec = iu.spec_from_file_location("mfq", Path(__file__).resolve().parent.parent / "tools" / "make_fixture_quant.py")
    tool = iu.module_from_spec(spec)
    spec.loader.exec_module(tool)
    d = tool.make(tool.HF / "qwen3_5", tmp_path / "q", "nvfp4-ct", None)
    plain = load(d, device="cpu", tokenizer=False)
    from memra.kernels.triton import quant as quant_triton

    calls = []  # liveness: the packed kernel ran on NVFP4 layouts
    real = quant_triton.linear
    monkeypatch.setattr(quant_triton, "linear", lambda x, w, b=None: calls.append(type(w)) or real(x, w, b))
    table = gpu_kernel_table()
    monkeypatch.setattr(KernelTable, "build", classmethod(lambda cls, device, settings: table))
    gpu = plain.with_doors(MEMRA_DECODE_PLAN="row")
    assert gpu.ops.invariant
    prompt = [5, 6, 7, 8, 9, 10, 11]
    a = plain.prime(prompt, plain.new_cache(32))
    b = gpu.prime(prompt, gpu.new_cache(32))
    assert ((a - b).abs().max() / a.abs().max()).item() < 2e-5
    assert calls.count(Nvfp4Split) >= 6 * 2  # every layer's mixer and MLP projections, at least
