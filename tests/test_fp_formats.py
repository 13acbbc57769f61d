"""FP8 block-scaled and NVFP4: the loader's dequantizers (memra.loading.fp_formats) against the formats'
bit-by-bit definitions (memra.loading.fp_reference), on random bytes in every field, NaN codes, ragged
blocks; round trips through the reference quantizers; which configs are read and which refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from memra.errors import ConfigError
from memra.loading.fp_formats import E2M1_VALUES, fp8_block_dequant, nvfp4_dequant
from memra.loading.fp_reference import (
    e2m1_value, e4m3_value, fp8_block_quantize, fp8_block_reference, nvfp4_quantize, nvfp4_reference,
)
from memra.loading.hf_quant import FP8_BLOCK, NVFP4_CT, NVFP4_MODELOPT, weight_format


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical, except that any NaN equals any NaN (payloads are not part of either format)."""
    nan = a.isnan()
    return bool(torch.equal(nan, b.isnan()) and torch.equal(a[~nan].view(torch.int32), b[~nan].view(torch.int32)))


def random_fp8(shape, gen) -> torch.Tensor:
    """Every byte value possible, NaN codes (0x7F, 0xFF) included."""
    return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8).view(torch.float8_e4m3fn)


def test_e4m3_and_e2m1_definitions_match_torch_and_the_writers_tables():
    for b in range(256):  # torch's own float8_e4m3fn conversion agrees with the definition on every code
        t = torch.tensor([b], dtype=torch.uint8).view(torch.float8_e4m3fn).float().item()
        v = e4m3_value(b)
        assert (t != t and v != v) or (t == v and str(t)[0] == str(v)[0]), b
    assert e4m3_value(0x7E) == 448.0 and e4m3_value(0x01) == 2 ** -9
    assert [e2m1_value(n) for n in range(16)] == list(E2M1_VALUES)
    assert str(e2m1_value(8)) == "-0.0"


@pytest.mark.parametrize("shape,block", [((256, 384), (128, 128)), ((130, 200), (128, 128)), ((7, 5), (128, 128)),
                                         ((129, 257), (32, 48)), ((1, 1), (1, 1))])
def test_fp8_block_dequant_equals_the_reference_bit_for_bit(shape, block):
    gen = torch.Generator().manual_seed(sum(shape))
    w = random_fp8(shape, gen)
    grid = (-(-shape[0] // block[0]), -(-shape[1] // block[1]))  # ragged last block: still one scale
    for dtype in (torch.float32, torch.bfloat16):
        # scales spanning many binades (sign too): every fp32 product rounds as the reference's does
        s = (torch.randn(grid, generator=gen) * torch.exp2(torch.randint(-20, 20, grid, generator=gen).float())).to(dtype)
        out, ref = fp8_block_dequant(w, s, block), fp8_block_reference(w, s, block)
        assert out.dtype == torch.float32 and out.shape == shape
        assert same_bits(out, ref)
    nan_codes = (w.view(torch.uint8) & 0x7F) == 0x7F
    assert torch.equal(out.isnan(), nan_codes)  # NaN codes decode to NaN (the loader then refuses them)


def test_fp8_dequant_chunks_rows_on_block_edges(monkeypatch):
    from memra.loading import fp_formats

    monkeypatch.setattr(fp_formats, "_CHUNK_VALUES", 200)  # many chunks, each a whole number of blocks
    gen = torch.Generator().manual_seed(1)
    w, s = random_fp8((70, 33), gen), torch.rand(8, 3, generator=gen)
    assert same_bits(fp8_block_dequant(w, s, (9, 16)), fp8_block_reference(w, s, (9, 16)))


@pytest.mark.parametrize("inverted", [False, True], ids=["modelopt", "compressed-tensors"])
@pytest.mark.parametrize("shape", [(64, 64), (3, 40), (130, 18), (1, 2)])  # 40, 18, 2: a ragged last group
def test_nvfp4_dequant_equals_the_reference_bit_for_bit(shape, inverted):
    gen = torch.Generator().manual_seed(shape[0] * 1000 + shape[1])
    rows, cols = shape
    packed = torch.randint(0, 256, (rows, cols // 2), generator=gen, dtype=torch.uint8)
    groups = -(-cols // 16)
    scale = torch.randint(0, 256, (rows, groups), generator=gen, dtype=torch.uint8)
    scale[(scale & 0x7F) == 0x7F] = 0x38  # NaN scales are refused before dequantizing (test_fp_checkpoints)
    scale = scale.view(torch.float8_e4m3fn)
    for g in (torch.tensor(3.7e-3), torch.tensor([1234.5]), torch.tensor(1.0)):
        assert same_bits(nvfp4_dequant(packed, scale, g, inverted), nvfp4_reference(packed, scale, g, inverted))


def test_nvfp4_nibble_order_and_scale_meaning():
    """Byte 0x21 holds column 0 = code 1 (0.5) in its low nibble and column 1 = code 2 (1.0) in its high one."""
    packed = torch.tensor([[0x21] + [0x00] * 7 + [0xF8]], dtype=torch.uint8)  # 18 columns: groups of 16 and 2
    scale = torch.tensor([[2.0, 0.5]]).to(torch.float8_e4m3fn)
    out = nvfp4_dequant(packed, scale, torch.tensor(0.25), inverted_global=False)
    assert out[0, :2].tolist() == [0.5 * 2.0 * 0.25, 1.0 * 2.0 * 0.25]
    assert out[0, 16:].tolist() == [-0.0 * 0.125, -6.0 * 0.125] and str(out[0, 16].item()) == "-0.0"
    inv = nvfp4_dequant(packed, scale, torch.tensor(4.0), inverted_global=True)
    assert torch.equal(inv, out)  # 1/4 stored inverted: the same values


@pytest.mark.parametrize("shape,block", [((200, 130), (128, 128)), ((64, 64), (32, 48)), ((5, 3), (2, 2))])
def test_fp8_round_trip(shape, block):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    w[0, 0] = 0.0
    q, s = fp8_block_quantize(w, block)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
    back = fp8_block_dequant(q, s, block)
    assert same_bits(back, fp8_block_reference(q, s, block))
    # e4m3 keeps 3 mantissa bits: each value within half an ulp (2^-4 relative) of its block's scale grid
    amax = torch.stack([w[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]].abs().max()
                        for i in range(s.shape[0]) for j in range(s.shape[1])]).view(s.shape)
    bound = amax.repeat_interleave(block[0], 0)[:shape[0]].repeat_interleave(block[1], 1)[:, :shape[1]] / 16
    assert ((back - w).abs() <= bound + 1e-30).all() and back[0, 0] == 0.0
    assert torch.equal(fp8_block_quantize(back, block)[0].view(torch.uint8), q.view(torch.uint8))  # a fixed point


def test_nvfp4_round_trip():
    w = torch.randn(33, 48, generator=torch.Generator().manual_seed(1))
    w[1] = 0.0  # an all-zero row: its groups get scale 1, values 0
    packed, scale, scale_2 = nvfp4_quantize(w)
    assert packed.shape == (33, 24) and scale.shape == (33, 3) and scale.dtype == torch.float8_e4m3fn
    back = nvfp4_dequant(packed, scale, scale_2, inverted_global=False)
    assert same_bits(back, nvfp4_reference(packed, scale, scale_2, inverted_global=False))
    group_amax = w.abs().view(33, 3, 16).amax(-1).repeat_interleave(16, 1)
    # the largest step of the e2m1 grid is 2 (between 4 and 6) in units of amax / 6, plus the fp8 scale's rounding
    assert ((back - w).abs() <= group_amax / 6 * 1.07 + 1e-6).all()
    assert (back[1] == 0).all()


# --- which configs are read, which refused -------------------------------------------------------------------


def fmt(qc, tmp_path: Path, hq: str | None = None):
    if hq is not None:
        (tmp_path / "hf_quant_config.json").write_text(hq)
    raw = {"model_type": "llama"} if qc is None else {"model_type": "llama", "quantization_config": qc}
    return weight_format(raw, tmp_path, "config.json")


def test_declared_formats(tmp_path):
    assert fmt(None, tmp_path) is None
    f = fmt({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 64]}, tmp_path)
    assert f.kind == FP8_BLOCK and f.block == (128, 64)
    assert fmt({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}, tmp_path).kind == NVFP4_MODELOPT
    ct = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
          "config_groups": {"g": {"weights": {"num_bits": 4, "type": "float", "group_size": 16}}}}
    assert fmt(ct, tmp_path).kind == NVFP4_CT
    assert fmt(None, tmp_path, '{"quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": "FP8"}}').kind == NVFP4_MODELOPT


@pytest.mark.parametrize("qc,match", [
    ({"quant_method": "gptq", "bits": 4}, r"quant_method = 'gptq' is not a weight format memra reads"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, r"no weight_block_size: per-tensor FP8 is not read"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, r"weight_block_size = \[128\]"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"}, r"activation_scheme = 'static'"),
    ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, r"fmt = 'e5m2'"),
    ({"quant_method": "modelopt", "quant_algo": "FP8"}, r"quant_algo = 'FP8'; of modelopt's formats memra reads NVFP4"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 32}, r"group_size = 32"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int", "group_size": 128}}}}, r"format 'pack-quantized'"),
    ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 4, "type": "float", "group_size": 32}}}}, r"group_0|g\.weights"),
    ("fp8", r"'quantization_config' must be an object"),
])
def test_refused_formats_name_the_field(qc, match, tmp_path):
    with pytest.raises(ConfigError, match=match) as e:
        fmt(qc, tmp_path)
    assert "\n" not in str(e.value) and str(e.value).startswith("config.json")


def test_packed_layouts_decode_the_reference_values():
    """The CPU's packed layouts (memra.kernels.split): any row range, and rows concatenated across blocks
    (q, k, v of 40 + 24 + 24 rows in 32-row blocks), decode to the reference's bits."""
    from memra.kernels.split import Fp8BlockSplit, Nvfp4Split, fp_cat_rows
    from memra.loading.fp_formats import nvfp4_block_scales

    gen = torch.Generator().manual_seed(5)
    parts, refs = [], []
    for rows in (40, 24, 24):
        w, s = random_fp8((rows, 72), gen), torch.rand(-(-rows // 32), 2, generator=gen)
        w.view(torch.uint8)[(w.view(torch.uint8) & 0x7F) == 0x7F] = 0  # NaN codes are refused at load
        parts.append(Fp8BlockSplit(w, s.repeat_interleave(32, 0)[:rows], 48, torch.float32))
        refs.append(fp8_block_reference(w, s, (32, 48)))
    joined, ref = fp_cat_rows(parts), torch.cat(refs)
    assert joined.shape == (88, 72) and same_bits(joined.dequantize(), ref)
    assert same_bits(joined.decode(37, 70), ref[37:70]) and same_bits(joined[torch.tensor([3, 87])], ref[[3, 87]])
    packed = torch.randint(0, 256, (9, 20), generator=gen, dtype=torch.uint8)
    scale = torch.rand(9, 3, generator=gen).to(torch.float8_e4m3fn)
    for inv in (False, True):
        layout = Nvfp4Split(packed, nvfp4_block_scales(scale, torch.tensor(0.37), inv), torch.float32)
        ref = nvfp4_reference(packed, scale, torch.tensor(0.37), inv)
        assert same_bits(layout.dequantize(), ref) and same_bits(layout.decode(2, 7), ref[2:7])
    assert fp_cat_rows([parts[0], layout]) is None  # different formats do not join

