"""GGUF-packed weights (memra.kernels.quant), their split layouts (memra.kernels.split) and the fused
dequantizing matmuls over those (memra.kernels.triton.quant).

- the torch quantizers against gguf's: Q8_0 byte for byte; Q4_K (gguf has no quantizer) by its round-trip
  error, and by decoding our bytes with gguf and with memra to the same bits;
- the kernels' weight values: an identity x turns the matmul into a read-out of the weight tile, which
  must equal qw.dequantize(dtype) to the bit -- so the kernels and the twin differ only in summation order;
- the kernels against the twin (fp32: 2e-5 relative; bf16: two output roundings, 2^-6, as
  tests/test_triton_kernels.py) and against themselves across row counts, bit for bit;
- refusals, and which implementation ops.linear picks.
On CPU the kernels run in Triton's interpreter (conftest sets TRITON_INTERPRET=1).
"""

from __future__ import annotations

import importlib.util
import os

import gguf
import numpy as np
import pytest
import torch

from memra.errors import MemraError
from memra.kernels import quant, reference
from memra.kernels.table import KernelTable
from memra.settings import Settings
from memra.kernels.quant import QType, QuantWeight
from memra.kernels.split import SPLIT_TYPES, split_layout
from memra.loading.dequant import SCALE_FIELDS, dequantize

DEVICE = os.environ.get("MEMRA_TEST_DEVICE", "cpu")
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton not installed")

DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: 2e-5, torch.bfloat16: 2 ** -6}
QTYPES = [QType.Q8_0, QType.Q4_K]
SHAPES = {QType.Q8_0: [(40, 96), (64, 320)], QType.Q4_K: [(40, 256), (64, 512)]}  # (N, K): N not a tile multiple, K in 1-2 blocks' worth


def rnd(*shape, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * scale


def close(a, b, dtype):
    a, b = a.float(), b.float()
    assert a.shape == b.shape
    err = ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
    assert err <= TOL[dtype], f"relative error {err:.3g} over {TOL[dtype]:.3g}"


def same_bits(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def weight(n, k, seed=1):
    """A weight with the awkward cases in it: rows of very different scale, and an all-zero block."""
    w = rnd(n, k, seed=seed) * torch.linspace(0.01, 3.0, n)[:, None]
    w[1, :32] = 0
    return w


# --- quantizers --------------------------------------------------------------------------------------


def test_q8_0_quantize_is_byte_identical_to_gguf():
    w = weight(12, 160)
    w[2, 40:72] = torch.arange(32) - 15.5  # exact .5 products: gguf rounds half away from zero
    qw = quant.quantize_q8_0(w)
    ref = gguf.quants.quantize(w.numpy(), QType.Q8_0)
    assert qw.data.shape == ref.shape and np.array_equal(qw.data.numpy(), ref)
    same_bits(qw.dequantize(torch.float32), torch.from_numpy(gguf.quants.dequantize(ref, QType.Q8_0)))


def test_q4_k_round_trip_and_bytes_decode_like_gguf():
    w = weight(10, 512)
    w[3, 256:288] = 0.7  # a constant sub-block (positive: min 0) and a constant negative one
    w[4, :32] = -0.2
    qw = quant.quantize_q4_k(w)
    assert qw.data.shape == (10, 2 * 144) and qw.nbytes == 10 * 2 * 144
    deq = qw.dequantize(torch.float32)
    same_bits(deq, torch.from_numpy(gguf.quants.dequantize(qw.data.numpy(), QType.Q4_K)))
    # 4-bit levels over each 32-value sub-block's range: RMS error ~ step / sqrt(12), about 7% of a
    # Gaussian's RMS (llama.cpp's quantizer lands there too). No value strays past a couple of steps,
    # plus the 6-bit code of the sub-block's min, which is only as fine as the super-block's dmin.
    rms = lambda t: t.square().mean(1).sqrt()
    rel = rms(deq - w) / rms(w).clamp_min(1e-30)
    assert rel.max().item() < 0.1, rel
    sub, err = w.view(-1, 32), (deq - w).view(-1, 32).abs()
    step = (sub.amax(1) - sub.amin(1).clamp(max=0)) / 15
    dmin = qw.data.view(-1, 144)[:, 2:4].contiguous().view(torch.float16).float().repeat_interleave(8)  # [sub-blocks]
    assert (err.amax(1) <= 2 * step + dmin).all()


def test_quant_weight_api():
    w = weight(8, 64)
    qw = quant.quantize_q8_0(w, torch.bfloat16)
    assert qw.shape == (8, 64) and qw.dtype == torch.bfloat16 and qw.device == torch.device("cpu")
    assert qw.nbytes == 8 * 2 * 34
    same_bits(qw.dequantize(), qw.dequantize(torch.float32).to(torch.bfloat16))
    moved = qw.to("cpu")
    assert moved.qtype == qw.qtype and moved.shape == qw.shape and torch.equal(moved.data, qw.data)
    wrapped = QuantWeight.from_gguf(qw.data.reshape(-1), QType.Q8_0, (8, 64), torch.bfloat16)  # flat file bytes
    same_bits(wrapped.dequantize(), qw.dequantize())


@pytest.mark.parametrize("qtype", [QType.Q8_0, QType.Q4_K])
def test_row_moves_lookups_and_tiles_keep_the_values(qtype, monkeypatch):
    """What the packed GGUF loader and the CPU linear do with packed rows: move them (map_rows,
    cat_rows), look rows up (an embedding), and decode a tile at a time — every value and every bit as
    the whole weight decoded."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(320, 256, generator=gen)
    qw = quant.quantize(w, qtype, torch.float32)
    full = qw.dequantize()
    perm = torch.randperm(320, generator=gen)
    assert torch.equal(qw.map_rows(lambda t: t[perm]).dequantize(), full[perm])
    assert torch.equal(QuantWeight.cat_rows([qw, qw.map_rows(lambda t: t[:64])]).dequantize(),
                       torch.cat((full, full[:64])))
    ids = torch.tensor([5, 0, 319, 5])
    assert torch.equal(qw[ids], full[ids]) and torch.equal(qw[7], full[7:8])
    x = torch.randn(3, 256, generator=gen)
    monkeypatch.setattr(quant, "TILE_BYTES", 64 * 256 * 4)  # five tiles of 64 rows
    assert quant.splits_keep_bits(x.device, x.dtype)  # this CPU's BLAS (else the linear decodes whole weights)
    assert torch.equal(quant.tiled_linear(x, qw), quant.reference_linear(x, qw))
    with pytest.raises(MemraError, match="one format"):
        QuantWeight.cat_rows([qw, quant.quantize(torch.randn(4, 512), qtype, torch.float32)])
    # the CPU's split layout (memra.kernels.split): the same values, rows and tiled products
    split = split_layout(qw)
    assert split.shape == qw.shape and qw.nbytes <= split.nbytes <= 1.06 * qw.nbytes  # about the file's size
    assert torch.equal(split.dequantize(), full) and torch.equal(split[ids], full[ids])
    assert torch.equal(split[7], full[7:8])
    assert torch.equal(quant.tiled_linear(x, split, scratch=quant.Scratch()), quant.reference_linear(x, qw))
    monkeypatch.setattr(quant, "TILE_BYTES", 8 << 20)  # one tile: decoded into the reused buffer too
    scratch = quant.Scratch()
    assert torch.equal(quant.tiled_linear(x, split, scratch=scratch), quant.reference_linear(x, qw))
    held = scratch.take(1, 1, x.device).data_ptr()
    assert torch.equal(quant.tiled_linear(x, split, scratch=scratch), quant.reference_linear(x, qw))
    assert scratch.take(320, 256, x.device).data_ptr() == held  # the same buffer, not a fresh one per call


@pytest.mark.parametrize("qtype", [QType.Q8_0, QType.Q4_K, QType.Q5_K, QType.Q6_K])
def test_the_cpu_split_decodes_any_bytes_as_the_reference_decoder(qtype):
    """Random bytes in every field (all 6-bit scales and mins, every bit plane, signed scales, any fp16
    scale that is finite): the split layout gives memra.loading.dequant's values, bit for bit, whole,
    by rows and through the tiled linear; it holds about the file's bytes."""
    gen = torch.Generator().manual_seed(11)
    n, k = 6, 512
    block, block_bytes = quant.PACKABLE[qtype]
    data = torch.randint(0, 256, (n, k // block, block_bytes), generator=gen, dtype=torch.uint8)
    for at in SCALE_FIELDS[qtype]:  # finite fp16 scales (random bytes would make some NaN / Inf)
        data[..., at : at + 2] = torch.randn(n, k // block, 1, generator=gen).mul(0.01).half().view(torch.uint8)
    qw = QuantWeight(qtype, data.reshape(n, -1).contiguous(), (n, k), torch.float32)
    want = dequantize(qw.data, qtype, (n, k))
    split = split_layout(qw)
    assert torch.equal(split.dequantize(), want) and torch.equal(split.decode(2, 5), want[2:5])
    assert torch.equal(split[torch.tensor([4, 0])], want[[4, 0]])
    assert split.nbytes <= 1.6 * qw.nbytes
    x = torch.randn(3, k, generator=gen)
    assert torch.equal(quant.tiled_linear(x, split, scratch=quant.Scratch()), quant.reference_linear(x, qw))


def test_row_blocks_of_several_formats_stay_packed_as_one_weight(monkeypatch):
    """A fused weight whose row blocks the file stores in different formats (llama.cpp's Q4_K_M keeps
    a qkv's v in Q6_K): memra.loading.gguf.cat_rows keeps it packed (quant.MixedRows), the CPU splits
    each block (split.SplitRows), and a tile that crosses blocks decodes each block's rows: every value
    and the tiled product as the whole weight decoded."""
    from memra.kernels.quant import MixedRows
    from memra.kernels.split import SplitRows
    from memra.loading.gguf import cat_rows

    gen = torch.Generator().manual_seed(5)
    q4 = quant.quantize(torch.randn(96, 256, generator=gen), QType.Q4_K, torch.float32)
    q8 = quant.quantize(torch.randn(40, 256, generator=gen), QType.Q8_0, torch.float32)
    mixed = cat_rows([q4, cat_rows([q8, q4])])  # nested, as a qkv joined to other rows
    assert isinstance(mixed, MixedRows) and mixed.shape == (232, 256)
    full = torch.cat([q4.dequantize(), q8.dequantize(), q4.dequantize()])
    assert torch.equal(mixed.dequantize(), full)
    split = split_layout(mixed)
    assert isinstance(split, SplitRows) and torch.equal(split.dequantize(), full)
    assert torch.equal(split.decode(90, 140), full[90:140])  # crosses two block edges
    x = torch.randn(2, 256, generator=gen)
    monkeypatch.setattr(quant, "TILE_BYTES", 64 * 256 * 4)  # tiles of 64 rows: edges inside tiles
    assert torch.equal(quant.tiled_linear(x, split, scratch=quant.Scratch()), reference.linear(x, full))
    assert isinstance(cat_rows([q4, torch.randn(8, 256)]), torch.Tensor)  # a float part: floats


def test_bad_shapes_and_types_are_refused_clearly():
    with pytest.raises(MemraError, match="multiple of 32"):
        quant.quantize_q8_0(rnd(4, 48))
    with pytest.raises(MemraError, match="multiple of 256"):
        quant.quantize_q4_k(rnd(4, 128))
    with pytest.raises(MemraError, match="multiple of 256"):
        QuantWeight(QType.Q4_K, torch.zeros(4, 72, dtype=torch.uint8), (4, 128), torch.float32)
    with pytest.raises(MemraError, match="bytes of shape"):
        QuantWeight(QType.Q8_0, torch.zeros(4, 33, dtype=torch.uint8), (4, 32), torch.float32)
    with pytest.raises(MemraError, match="dequantized at load"):
        QuantWeight(QType.Q3_K, torch.zeros(4, 110, dtype=torch.uint8), (4, 256), torch.float32)
    qw = quant.quantize_q8_0(rnd(4, 64))
    with pytest.raises(MemraError, match="expects 64"):
        quant.reference_linear(rnd(2, 32), qw)
    with pytest.raises(MemraError, match="returns torch.float32"):
        quant.reference_linear(rnd(2, 64).bfloat16(), qw)
    with pytest.raises(MemraError, match="bias torch.bfloat16"):
        quant.reference_linear(rnd(2, 64), qw, rnd(4).bfloat16())
    with pytest.raises(MemraError, match="bytes of shape"):
        QuantWeight.from_gguf(qw.data.reshape(-1)[:-1], QType.Q8_0, (4, 64), torch.float32)


# --- the fused kernels -------------------------------------------------------------------------------


def test_weight_products_are_exact_in_fp32():
    """Why the kernels may let the compiler fuse multiply-adds: Q4_K's (d * scale) * q and dmin * min, and
    Q8_0's d * q, are exact in fp32 for every fp16 d, so only the final subtraction ever rounds. The
    significand width is what matters (exponents stay far inside fp32's range): all 1024 fp16
    significands, the smallest subnormal and the largest value, against every scale and q."""
    h = torch.arange(0x3C00, 0x4000, dtype=torch.int32).to(torch.int16).view(torch.float16)  # [1, 2)
    d = torch.cat((h.float(), torch.tensor([2.0 ** -24, 65504.0])))[:, None, None]  # [D, 1, 1]
    scale = torch.arange(64, dtype=torch.float32)[None, :, None]  # 6-bit scale or min
    q4 = torch.arange(16, dtype=torch.float32)[None, None, :]
    dl = d * scale
    assert torch.equal(dl.double(), d.double() * scale.double())
    assert torch.equal((dl * q4).double(), dl.double() * q4.double())
    q8 = torch.arange(-128, 128, dtype=torch.float32)[None, :]
    assert torch.equal((d[:, :, 0] * q8).double(), d[:, :, 0].double() * q8.double())



@needs_triton
@pytest.mark.parametrize("dtype", [*DTYPES, torch.float16])
@pytest.mark.parametrize("qtype", QTYPES)
def test_kernel_weight_values_equal_the_dequantizer(qtype, dtype):
    from memra.kernels.triton import quant as quant_triton

    n, k = SHAPES[qtype][0]
    qw = quant.quantize(weight(n, k, seed=2), qtype, dtype).to(DEVICE)
    eye = torch.eye(k, dtype=dtype, device=DEVICE)  # y[i, n] = sum_k [k == i] w[n, k] = w[n, i], exactly
    same_bits(quant_triton.linear(eye, split_layout(qw)).t().contiguous(), qw.dequantize(dtype))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_reads_any_bytes_of_every_split_layout_as_the_dequantizer(dtype):
    """Random bytes in every field of Q8_0, Q4_K, Q5_K and Q6_K (all 6-bit scales and mins, every bit
    plane, signed scales), and their row blocks joined as one weight (split.SplitRows): the kernel's
    weight values (an identity x reads them out) are memra.loading.dequant's, bit for bit."""
    from memra.kernels.quant import MixedRows
    from memra.kernels.triton import quant as quant_triton

    gen = torch.Generator().manual_seed(12)
    n, k = 40, 512
    parts = []
    for qtype in (QType.Q8_0, QType.Q4_K, QType.Q5_K, QType.Q6_K):
        block, block_bytes = quant.PACKABLE[qtype]
        data = torch.randint(0, 256, (n, k // block, block_bytes), generator=gen, dtype=torch.uint8)
        for at in SCALE_FIELDS[qtype]:  # finite fp16 scales (random bytes would make some NaN / Inf)
            data[..., at : at + 2] = torch.randn(n, k // block, 1, generator=gen).mul(0.01).half().view(torch.uint8)
        qw = QuantWeight(qtype, data.reshape(n, -1).contiguous(), (n, k), dtype)
        parts.append(qw)
        eye = torch.eye(k, dtype=dtype, device=DEVICE)
        got = quant_triton.linear(eye, split_layout(qw.to(DEVICE))).t().contiguous()
        assert torch.equal(got, qw.dequantize(dtype).to(DEVICE))  # values: the read-out sums 0 + w, so -0 reads +0
    mixed = split_layout(MixedRows(tuple(parts)).placed(torch.device(DEVICE), dtype))
    x = rnd(3, k, seed=13).to(DEVICE, dtype)
    b = rnd(4 * n, seed=14).to(DEVICE, dtype)
    whole = torch.cat([quant_triton.linear(x, split_layout(p.to(DEVICE)), b[i * n : (i + 1) * n])
                       for i, p in enumerate(parts)], dim=-1)
    same_bits(quant_triton.linear(x, mixed, b), whole)  # each block's launch writes its own columns


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qtype", QTYPES)
def test_fused_linear_matches_twin_and_rows_do_not_depend_on_m(qtype, dtype):
    from memra.kernels.triton import quant as quant_triton

    fused = quant_triton.linear
    for i, (n, k) in enumerate(SHAPES[qtype]):
        qw = quant.quantize(weight(n, k, seed=3 + i), qtype, dtype).to(DEVICE)
        sw = split_layout(qw)
        bias = rnd(n, seed=5).to(DEVICE, dtype) if i == 0 else None
        x = rnd(100, k, seed=4).to(DEVICE, dtype)  # past 64 rows: both of QUANT_BUCKETS' tiles on a GPU
        full = fused(x, sw, bias)
        for m in (1, 2, 7, 33, 64, 65):
            part = fused(x[:m], sw, bias)
            close(part, quant.reference_linear(x[:m], qw, bias), dtype)
            same_bits(part, full[:m])  # the same rows inside a smaller call
        same_bits(fused(x[5:6], sw, bias)[0], full[5])  # row 5 moved to the front


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qtype", QTYPES)
def test_split_k_chunks_keep_row_bits_across_the_decode_and_prefill_paths(qtype, dtype):
    """K past one chunk (triton.quant.QUANT_CHUNK_K, and a short last one): calls of up to SPLIT_ROWS
    rows sum each chunk in its own programs and add the sums in a second launch, larger calls add them
    in one program; a row's bits are the same either way."""
    from memra.kernels.triton import quant as quant_triton

    n, k = 40, 2 * quant_triton.QUANT_CHUNK_K + 256  # (fp32 rows show a change of the sums' order; bf16 rarely)
    qw = quant.quantize(weight(n, k, seed=8), qtype, dtype).to(DEVICE)
    sw, bias = split_layout(qw), rnd(n, seed=9).to(DEVICE, dtype)
    rows = quant_triton.SPLIT_ROWS + 36
    x = rnd(rows, k, seed=10).to(DEVICE, dtype)
    full = quant_triton.linear(x, sw, bias)  # one program per tile: past the decode rows
    close(full, quant.reference_linear(x, qw, bias), dtype)
    for m in (1, 7, quant_triton.SPLIT_ROWS, quant_triton.SPLIT_ROWS + 1):
        same_bits(quant_triton.linear(x[:m].clone(), sw, bias), full[:m])


@needs_triton
def test_fused_linear_takes_leading_dims_and_refuses_unsplit_bytes():
    from memra.kernels.triton import quant as quant_triton

    qw = quant.quantize_q8_0(weight(40, 96)).to(DEVICE)
    sw = split_layout(qw)
    x = rnd(2, 3, 96, seed=6).to(DEVICE)
    y = quant_triton.linear(x, sw)
    assert y.shape == (2, 3, 40)
    same_bits(y.reshape(6, 40), quant_triton.linear(x.reshape(6, 96), sw))
    assert quant_triton.linear(x[:0, 0], sw).shape == (0, 40)
    with pytest.raises(MemraError, match="takes a split layout"):
        quant_triton.linear(x, qw)  # the file's bytes: the loader splits them first
    with pytest.raises(MemraError, match="expects 96"):
        quant_triton.linear(x[..., :64], sw)


# --- dispatch ----------------------------------------------------------------------------------------


def test_ops_linear_runs_the_twin_on_cpu():
    """With MEMRA_CPU_QDOT=0 (by default: the integer-dot kernel, tests/test_cpu_qdot.py), and torch's fp32
    linear (MEMRA_CPU_FLIN=0: the twin's tiles then run the table's row-invariant one, tests/test_cpu_qdot.py)."""
    ops = KernelTable.build("cpu", Settings().with_doors(MEMRA_CPU_QDOT="0", MEMRA_CPU_FLIN="0"))
    qw = quant.quantize_q4_k(weight(24, 256))
    x, b = rnd(5, 256, seed=7), rnd(24, seed=8)
    same_bits(ops.linear(x, split_layout(qw), b), quant.reference_linear(x, qw, b))
    w = qw.dequantize()
    same_bits(ops.linear(x, w, b), reference.linear(x, w, b))  # dense weights: unchanged


@needs_triton
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="dispatch is checked on CPU tensors, in Triton's interpreter")
def test_ops_linear_runs_the_fused_kernel_where_invariant_kernels_live(monkeypatch):
    from memra.kernels import table
    from memra.kernels.triton import quant as quant_triton

    # the table of a CUDA model in exact mode, held to CPU tensors (the interpreter runs the kernels)
    ops = KernelTable(invariant=True, triton=True, exact=True, gdn_kernel=False, sample_kernel=False)
    monkeypatch.setattr(KernelTable, "_impl", lambda self, x: table.triton_ops())
    sw = split_layout(quant.quantize_q8_0(weight(40, 96)))
    x = rnd(3, 96, seed=9)
    calls, fused = [], quant_triton.linear
    monkeypatch.setattr(quant_triton, "linear", lambda *a: calls.append(a) or fused(*a))
    same_bits(ops.linear(x, sw), fused(x, sw))
    assert len(calls) == 1


@pytest.mark.parametrize("fmt,tol", [("q8_0", 0.05), ("q4_k", 0.6)])
def test_random_model_serves_packed_weights(monkeypatch, fmt, tol):
    """random_model(quant=...) keeps the projections packed; the model runs and stays near the dense one
    (Q8_0: a few % of the logit scale; Q4_K: coarser, ~7% weight error compounding over two layers)."""
    import memra.random_model as rm

    monkeypatch.setitem(rm.SHAPES, "tiny-test", lambda n: rm._llama(n or 2, 256, 4, 2, 512, 512))
    dense = rm.random_model("tiny-test", "cpu", torch.float32)
    packed = rm.random_model("tiny-test", "cpu", torch.float32, quant=fmt)
    assert isinstance(packed.blocks[0].mixer.wqkv, SPLIT_TYPES) and isinstance(packed.lm_head, SPLIT_TYPES)
    a, b = dense.new_cache(32), packed.new_cache(32)
    la, lb = dense.prime([1, 2, 3, 4, 5], a), packed.prime([1, 2, 3, 4, 5], b)
    assert (la - lb).abs().max() / la.abs().max() < tol
    with pytest.raises(MemraError, match="unknown weight format"):
        rm.random_model("tiny-test", "cpu", torch.float32, quant="q2_k")
