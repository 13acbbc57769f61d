"""memra.loading.dequant against the oracle, gguf.quants.dequantize, compared bit for bit.

Bitwise means comparing the fp32 results as int32: it tells -0.0 from 0.0 and checks NaN payloads too.
"""

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from memra.errors import CheckpointError
from memra.loading import dequant
from memra.loading.dequant import SUPPORTED, dequantize, row_bytes

Q = gguf.GGMLQuantizationType
FIXTURES = Path(__file__).parent / "fixtures" / "gguf"

needs_cuda = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]

ALL_TYPES = sorted(SUPPORTED, key=lambda t: t.name)
SHAPES = [(256,), (3, 256), (5, 512), (2, 4, 256)]

# Byte offsets of the fp16 scale fields inside one block, written down independently of the module.
F16_FIELDS = {
    Q.Q8_0: (0,), Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2),
    Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,),
}

# Types the gguf package can also quantize, so they can be tested on real-looking data.
QUANTIZABLE = [t for t in ALL_TYPES if t in (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1)]


def test_supported_set():
    want = {Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1,
            Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K}
    assert want <= SUPPORTED


# ---------------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------------


def _finite_f16_bits(rng: np.random.Generator, n: int) -> np.ndarray:
    """n random fp16 bit patterns, every one finite (subnormals and extremes included)."""
    bits = rng.integers(0, 1 << 16, size=n, dtype=np.uint16)
    exponent_all_ones = (bits & 0x7C00) == 0x7C00
    return np.where(exponent_all_ones, bits ^ 0x4000, bits).astype(np.uint16)


def _random_bytes(qtype: Q, shape: tuple[int, ...], rng: np.random.Generator, finite: bool) -> np.ndarray:
    """Random file bytes for a tensor of `shape`, as a flat uint8 array.

    finite=True patches every fp16 field (and every F16/BF16 value) to a finite number. finite=False
    leaves them random, so some may be inf or NaN, and plants a few of those for sure: the oracle
    must be matched there too.
    """
    n_bytes = int(np.prod(shape[:-1], dtype=np.int64)) * row_bytes(qtype, shape[-1])
    raw = rng.integers(0, 256, size=n_bytes, dtype=np.uint8)
    if qtype == Q.F32:
        return raw
    if not finite:
        # Make sure the specials are there, not just likely, in the first fp16 fields of the tensor:
        # a signaling NaN, -inf, then two quiet NaNs with different payloads (for the types with a
        # scale and a min, that puts both NaNs in one block: whose payload wins is then at stake).
        if qtype in (Q.F16, Q.BF16):
            f16_specials, bf16_specials = (0x7C01, 0xFC00, 0xFE55, 0x7E2A), (0x7F81, 0xFF80, 0xFFD5, 0x7FAA)
            raw[:8].view(np.uint16)[:] = f16_specials if qtype == Q.F16 else bf16_specials
        else:
            blocks = raw.reshape(-1, gguf.GGML_QUANT_SIZES[qtype][1])
            places = [(b, at) for b in range(blocks.shape[0]) for at in F16_FIELDS[qtype]]
            for (b, at), bits in zip(places, (0x7C01, 0xFC00, 0xFE55, 0x7E2A)):
                blocks[b, at:at + 2] = np.array([bits], dtype=np.uint16).view(np.uint8)
        return raw
    if qtype in (Q.F16, Q.BF16):
        halves = raw.view(np.uint16)
        if qtype == Q.F16:
            halves[:] = _finite_f16_bits(rng, halves.size)
        else:  # bf16: exponent field is bits 7..14; clear one of them where all are set
            halves[:] = np.where((halves & 0x7F80) == 0x7F80, halves ^ 0x4000, halves)
        return raw
    blocks = raw.reshape(-1, gguf.GGML_QUANT_SIZES[qtype][1])
    for at in F16_FIELDS[qtype]:
        blocks[:, at:at + 2] = _finite_f16_bits(rng, blocks.shape[0]).view(np.uint8).reshape(-1, 2)
    return raw


def _oracle(raw: np.ndarray, qtype: Q, shape: tuple[int, ...]) -> torch.Tensor:
    rows = raw.reshape(*shape[:-1], row_bytes(qtype, shape[-1]))
    ref = np.ascontiguousarray(gguf.quants.dequantize(rows, qtype), dtype=np.float32)
    assert ref.shape == shape
    return torch.from_numpy(ref)


def _assert_bits_equal(ours: torch.Tensor, ref: torch.Tensor, nan_payloads: bool = True) -> None:
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    ours = ours.cpu()
    if not nan_payloads:  # NaN must be in the same places, but any NaN bit pattern will do
        assert torch.equal(ours.isnan(), ref.isnan())
        ours, ref = ours.masked_fill(ours.isnan(), 0.0), ref.masked_fill(ref.isnan(), 0.0)
    a, b = ours.view(torch.int32), ref.view(torch.int32)
    bad = (a != b).sum().item()
    assert bad == 0, f"{bad} of {a.numel()} values differ in their bits"


# ---------------------------------------------------------------------------------------------------
# Bit-identity against the oracle
# ---------------------------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # the oracle computing inf * 0
@pytest.mark.parametrize("finite", [True, False], ids=["finite", "with_inf_nan"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_random_bytes_match_gguf(qtype, shape, finite):
    rng = np.random.default_rng([int(qtype), len(shape), shape[-1], finite])
    raw = _random_bytes(qtype, shape, rng, finite)
    ours = dequantize(torch.from_numpy(raw), qtype, shape)
    _assert_bits_equal(ours, _oracle(raw, qtype, shape))


@pytest.mark.parametrize("qtype", QUANTIZABLE, ids=lambda t: t.name)
def test_quantized_real_data_matches_gguf(qtype):
    rng = np.random.default_rng(int(qtype))
    data = rng.standard_normal((6, 512)).astype(np.float32) * 0.02
    data[1] *= 1000.0  # large values
    data[2] = 0.0  # an all-zero row (d = 0)
    data[3, ::7] = -3.0  # outliers
    data[4] = 1e-6  # constant row
    raw = np.ascontiguousarray(gguf.quants.quantize(data, qtype)).view(np.uint8).reshape(-1)
    ours = dequantize(torch.from_numpy(raw), qtype, data.shape)
    _assert_bits_equal(ours, _oracle(raw, qtype, data.shape))
    if qtype not in (Q.F32, Q.F16, Q.BF16):
        # sanity: it really is an approximation of the input
        assert torch.allclose(ours, torch.from_numpy(data), rtol=0.2, atol=0.2 * float(np.abs(data).max()))


@pytest.mark.parametrize("name", ["llama-q8_0.gguf", "qwen3_5-f16.gguf", "llama-f32.gguf"])
def test_fixture_files_match_gguf(name):
    reader = gguf.GGUFReader(FIXTURES / name)
    seen = set()
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape))  # ggml ne[] is fastest-first
        raw = torch.from_numpy(np.array(t.data).view(np.uint8).reshape(-1))  # a writable copy
        ours = dequantize(raw, t.tensor_type, shape)
        ref = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
        ref = torch.from_numpy(np.array(ref, dtype=np.float32))  # a copy: ref may view the read-only file
        _assert_bits_equal(ours, ref)
        seen.add(t.tensor_type)
    want = {"q8_0": Q.Q8_0, "f16": Q.F16, "f32": Q.F32}[name.split("-")[1].split(".")[0]]
    assert want in seen


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qtype", [Q.F16, Q.Q4_K, Q.Q5_0, Q.Q8_0], ids=lambda t: t.name)
def test_chunked_path_matches(qtype, device, monkeypatch):
    # Tensors with many blocks are decoded a chunk at a time; shrink the chunk to exercise that path,
    # including a last partial chunk.
    monkeypatch.setattr(dequant, "_CHUNK_VALUES_CPU", 3 * 256)
    monkeypatch.setattr(dequant, "_CHUNK_VALUES_GPU", 3 * 256)
    shape = (7, 512)
    raw = _random_bytes(qtype, shape, np.random.default_rng(7), finite=True)
    ours = dequantize(torch.from_numpy(raw).to(device), qtype, shape)
    _assert_bits_equal(ours, _oracle(raw, qtype, shape))


# ---------------------------------------------------------------------------------------------------
# Input handling
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q4_1], ids=lambda t: t.name)
def test_misaligned_and_non_uint8_inputs(qtype):
    shape = (2, 256)
    raw = _random_bytes(qtype, shape, np.random.default_rng(3), finite=True)
    ref = _oracle(raw, qtype, shape)
    # bytes starting at an odd address inside a bigger buffer, as a slice of an mmapped file would
    buffer = torch.zeros(raw.size + 1, dtype=torch.uint8)
    buffer[1:] = torch.from_numpy(raw)
    _assert_bits_equal(dequantize(buffer[1:], qtype, shape), ref)
    # the same bytes in a 2-D uint8 tensor, and reinterpreted as another dtype
    _assert_bits_equal(dequantize(torch.from_numpy(raw).view(2, -1), qtype, shape), ref)
    _assert_bits_equal(dequantize(torch.from_numpy(raw).view(torch.int16), qtype, shape), ref)


def test_result_does_not_alias_input():
    raw = torch.from_numpy(np.arange(8, dtype=np.float32)).view(torch.uint8)
    out = dequantize(raw, Q.F32, (2, 4))
    out.zero_()
    assert raw.view(torch.float32)[1].item() == 1.0


def test_empty_tensor():
    out = dequantize(torch.empty(0, dtype=torch.uint8), Q.Q4_K, (0, 256))
    assert out.shape == (0, 256) and out.dtype == torch.float32


def test_row_bytes():
    assert row_bytes(Q.F32, 10) == 40
    assert row_bytes(Q.BF16, 10) == 20
    assert row_bytes(Q.Q8_0, 64) == 68
    assert row_bytes(Q.Q4_0, 64) == 36
    assert row_bytes(Q.Q5_1, 32) == 24
    assert row_bytes(Q.Q2_K, 512) == 168
    assert row_bytes(Q.Q3_K, 256) == 110
    assert row_bytes(Q.Q4_K, 256) == 144
    assert row_bytes(Q.Q5_K, 256) == 176
    assert row_bytes(Q.Q6_K, 768) == 630


# ---------------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------------


def test_row_bytes_rejects_partial_block():
    with pytest.raises(CheckpointError, match=r"Q4_K.*multiple of 256.*100"):
        row_bytes(Q.Q4_K, 100)


def test_unsupported_type_names_it_and_lists_supported():
    with pytest.raises(CheckpointError) as err:
        dequantize(torch.zeros(66, dtype=torch.uint8), Q.IQ2_XXS, (1, 256))
    message = str(err.value)
    assert "IQ2_XXS" in message
    for t in SUPPORTED:
        assert t.name in message


def test_unknown_type_id():
    with pytest.raises(CheckpointError, match="12345"):
        dequantize(torch.zeros(4, dtype=torch.uint8), 12345, (1,))


@pytest.mark.parametrize("n_bytes", [2 * 144 - 1, 2 * 144 + 1, 0])
def test_wrong_byte_count(n_bytes):
    with pytest.raises(CheckpointError, match=rf"Q4_K.*\[2, 256\].*288 bytes.*found {n_bytes}\b"):
        dequantize(torch.zeros(n_bytes, dtype=torch.uint8), Q.Q4_K, (2, 256))


def test_shape_not_a_whole_number_of_blocks():
    with pytest.raises(CheckpointError, match="multiple of 32"):
        dequantize(torch.zeros(34, dtype=torch.uint8), Q.Q8_0, (2, 16))


# ---------------------------------------------------------------------------------------------------
# CUDA
# ---------------------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_cuda_matches_gguf(qtype):
    shape = (4, 8, 512)
    rng = np.random.default_rng(int(qtype))
    # Finite scales: bit-identical, output stays on the device.
    raw = _random_bytes(qtype, shape, rng, finite=True)
    ours = dequantize(torch.from_numpy(raw).cuda(), qtype, shape)
    assert ours.device.type == "cuda"
    _assert_bits_equal(ours, _oracle(raw, qtype, shape))
    # inf/NaN scales: same values and NaN positions; GPUs emit a canonical NaN, so payloads may differ.
    raw = _random_bytes(qtype, shape, rng, finite=False)
    ours = dequantize(torch.from_numpy(raw).cuda(), qtype, shape)
    _assert_bits_equal(ours, _oracle(raw, qtype, shape), nan_payloads=False)
