"""Shared test helpers. Tests read fixtures only from tests/fixtures, never from outside the repository."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

# One intra-op thread: the fixture models are tiny, and with 2 threads on a 2-core box OpenMP's
# spin-waits make each small op ~1000x slower whenever the other core is busy.
torch.set_num_threads(1)

FIXTURES = Path(__file__).parent / "fixtures"
# The model tests run on CPU by default; the device tool runs the same files with MEMRA_TEST_DEVICE=cuda.
DEVICE = os.environ.get("MEMRA_TEST_DEVICE", "cpu")
if DEVICE == "cpu":
    # Triton kernels (where Triton is installed) run in its numpy interpreter. Triton reads this when
    # it decorates its own library at import, so it must be set before anything imports triton.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def gpu_kernel_table():
    """The kernel table of a CUDA model in exact mode, held to CPU tensors: every op it sends to a
    Triton kernel runs in Triton's interpreter (tests/test_interpreted_model.py, tools/count_launches.py)."""
    from memra.kernels.table import KernelTable

    class OnCpu(KernelTable):
        def _gpu(self, x):
            return True

    return OnCpu(invariant=True, triton=True, exact=True, gdn_kernel=True, sample_kernel=False)


def _triton_interpreter_numpy2_fix() -> None:
    """Triton 3.6's interpreter turns a loop bound into an int with int(ndarray of shape (1,)), which
    NumPy >= 2.4 refuses; convert through the single element instead (test-time shim, CPU only)."""
    import importlib.util

    if DEVICE != "cpu" or importlib.util.find_spec("triton") is None:
        return
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None:  # another Triton: nothing to shim
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched


def _triton_interpreter_host_independent_dot() -> None:
    """The interpreter computes tl.dot as np.matmul in the accumulator's type, i.e. with the host's BLAS,
    whose fp32 summation order depends on the CPU model (OpenBLAS picks a kernel per CPU) and on the
    tile's shape (a 1-row tile goes to gemv): a row's bits would then depend on the machine and on how
    many rows share its tile, which a GPU's fixed MMA tiles do not. Test-time shim, CPU only: the
    products are summed in float64 and rounded once into the accumulator's type, the same bits on any
    host for any tile shape (float64's own order differences are ~2^-29 below an fp32 rounding step)."""
    import importlib.util

    if DEVICE != "cpu" or importlib.util.find_spec("triton") is None:
        return
    import numpy as np
    from triton.runtime import interpreter

    builder = getattr(interpreter, "InterpreterBuilder", None)
    original = getattr(builder, "create_dot", None)
    if original is None:  # another Triton: nothing to shim
        return

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.primitive_bitwidth == 8 or b.dtype.primitive_bitwidth == 8 or d.data.dtype.kind != "f":
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        wide = np.matmul(a.data.astype(np.float64), b.data.astype(np.float64)) + d.data.astype(np.float64)
        return interpreter.TensorHandle(wide.astype(d.data.dtype), d.dtype.scalar)

    builder.create_dot = create_dot


_triton_interpreter_numpy2_fix()
_triton_interpreter_host_independent_dot()

HF_ARCHS = ["llama", "llama_tied", "mistral", "gemma4", "step3p5", "qwen2", "qwen3", "qwen3_moe", "qwen3_next", "qwen3_5", "qwen3_5_moe"]
GGUF_F32_ARCHS = ["llama", "gemma4", "step3p5", "qwen3", "qwen3_moe", "qwen3_next", "qwen3_5", "qwen3_5_moe"]
GGUF_QUANTIZED = [f"{a}-{t}" for a in ("llama", "qwen3_next", "qwen3_5") for t in ("f16", "q8_0")]
HYBRID_ARCHS = ["qwen3_next", "qwen3_5", "qwen3_5_moe"]


def hf_dir(arch: str) -> Path:
    return FIXTURES / "hf" / arch


def gguf_file(name: str) -> Path:
    return FIXTURES / "gguf" / f"{name}.gguf"


def reference(arch: str) -> dict[str, torch.Tensor]:
    return load_file(str(hf_dir(arch) / "reference.safetensors"))


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """max |a - ref| / max |ref| — the agreement measure used throughout FIXTURES.md."""
    a, ref = a.detach().float().cpu(), ref.detach().float().cpu()
    return ((a - ref).abs().max() / ref.abs().max()).item()


def greedy(model, ids, n: int = 16, max_ctx: int = 128) -> list[int]:
    """Prime, then n greedy tokens through decode_step (the recurrent/decode path)."""
    cache = model.new_cache(max_ctx)
    nxt = int(model.prime(ids, cache).argmax())
    out = []
    for _ in range(n):
        out.append(nxt)
        nxt = int(model.decode_step(nxt, cache).argmax())
    return out


_MODELS: dict = {}


@pytest.fixture(scope="session")
def load_model():
    """Load each checkpoint once per session (CPU, fp32 unless asked)."""
    import memra

    def get(path, dtype="float32", device=DEVICE):
        key = (str(path), str(dtype), device)
        if key not in _MODELS:
            _MODELS[key] = memra.load(path, device=device, dtype=dtype, tokenizer=False)
        return _MODELS[key]

    return get


@contextlib.contextmanager
def process_doors(**values: str | None):
    """Set (or, with None, unset) environment variables while a process pipeline is launched: its worker
    processes read their doors from their environment when they load, as any process does. (memra code
    never changes the environment; a test launching processes is the one place that must.)"""
    saved = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def shape_9b():
    """The Qwen3.5-9B shape with 4 layers of random weights on the GPU (the cuda tests' real-size model)."""
    from memra.random_model import random_model

    model = random_model("qwen3.5-9b", "cuda", torch.bfloat16, n_layers=4)
    yield model
    del model
    torch.cuda.empty_cache()
