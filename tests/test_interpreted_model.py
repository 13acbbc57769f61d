"""The GPU path's kernel table composed into whole models, on CPU: every op the invariant table sends to
a Triton kernel (linear, norms, rope and the K/V write, paged and prefill attention, GDN's conv, heads,
scan and chunked prefill, the grouped MoE matmuls, the packed GGUF linear) runs in Triton's interpreter, inside the model's own
prime, batched prime and decode. What the kernel tests check one kernel at a time, this checks as the
model wires them: the logits agree with the torch path to fp32 rounding (the kernels sum in another
order, so bits are not the contract here). CPU only: on a GPU every model test runs this table for real."""

from __future__ import annotations

import os

import pytest
import torch

from conftest import gpu_kernel_table, hf_dir

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="the interpreter runs the Triton kernels on CPU tensors")

PROMPTS = [[5, 6, 7, 8, 9], [12, 13]]


def _interpreted_table(monkeypatch):
    """Models built from now on get the table of a CUDA model in exact mode, held to CPU tensors."""
    from memra.kernels.table import KernelTable

    table = gpu_kernel_table()
    monkeypatch.setattr(KernelTable, "build", classmethod(lambda cls, device, settings: table))


def _agree(a: torch.Tensor, b: torch.Tensor, tol: float = 2e-5) -> None:
    err = ((a - b).abs().max() / a.abs().max()).item()
    assert err < tol, f"relative error {err:.3g}"


def _compare(plain, interpreted) -> None:
    caches = [[m.new_cache(32) for _ in PROMPTS] for m in (plain, interpreted)]
    for p, a, b in zip(PROMPTS, *caches):
        _agree(plain.prime(p, a), interpreted.prime(p, b))
    rows = [m.decode_step_batch([1, 2], c) for m, c in zip((plain, interpreted), caches)]
    _agree(*rows)
    batched = [interpreted.new_cache(32) for _ in PROMPTS]
    firsts = interpreted.prime_batch(PROMPTS, batched)  # the pieces' launches: one per kernel for both
    solo = [interpreted.new_cache(32) for _ in PROMPTS]
    for p, got, c in zip(PROMPTS, firsts, solo):
        _agree(interpreted.prime(p, c), got)


@pytest.mark.parametrize("arch", ["llama", "qwen3_5", "qwen3_5_moe"])
def test_a_model_on_the_gpu_kernels_agrees_with_the_torch_path(arch, monkeypatch):
    from memra.loading.checkpoint import load

    plain = load(hf_dir(arch), device="cpu", tokenizer=False)
    _interpreted_table(monkeypatch)
    interpreted = plain.with_doors(MEMRA_DECODE_PLAN="row")  # the stacked plan's check needs the GPU's torch ops
    assert interpreted.ops.invariant and interpreted.blocks[0].ops is interpreted.ops
    _compare(plain, interpreted)


def test_a_packed_model_on_the_gpu_kernels_agrees_with_the_torch_path(monkeypatch):
    """Q8_0 projections in their split layout through the packed GPU kernel (each format's tile is
    held to the dequantizer by tests/test_quant_linear.py; this is the wiring)."""
    import memra.random_model as rm
    from memra.kernels.split import SPLIT_TYPES

    monkeypatch.setitem(rm.SHAPES, "tiny-test", lambda n: rm._llama(n or 2, 64, 4, 2, 128, 256))
    # the CPU side through the tiled twin: the values of the file decoded, as the GPU kernel reads them
    # (the CPU's int8 block kernel rounds the activations too, as llama.cpp does)
    plain = rm.random_model("tiny-test", "cpu", torch.float32, quant="q8_0").with_doors(MEMRA_CPU_QDOT="0")
    _interpreted_table(monkeypatch)
    interpreted = plain.with_doors(MEMRA_DECODE_PLAN="row")
    assert isinstance(interpreted.blocks[0].ffn.w_gate_up, SPLIT_TYPES)
    _compare(plain, interpreted)
