"""The CPU integer-dot kernel for packed GGUF linears (memra.kernels.cpu_qdot, memra/kernels/cpu/qdot.cpp).

- against its pure-torch twin (memra.kernels.qdot_reference), bit for bit, in every format and in row
  blocks of several, through the AVX2 and the scalar loops;
- a row's bits do not depend on the rows beside it (B = 1..N), on how a prompt is cut into chunks, or on
  the thread count: E1 and E5 for the linear itself;
- against the dequantized fp32 product within the bound of rounding the activations to int8 (per output:
  sum over blocks of max|x_block| / 254 * sum |w| of the block);
- the table's choice (the kernel by default on CPU, the tiled twin with MEMRA_CPU_QDOT=0 or no compiler),
  and the exactness gate on a packed Q8_0 GGUF and a packed Q4_K model, with its canary.
"""

from __future__ import annotations

import pytest
import torch
from conftest import gguf_file

from memra.gate import run_battery
from memra.kernels import cpu_flin, cpu_qdot, qdot_reference, quant, split
from memra.kernels.quant import MixedRows, QType, QuantWeight
from memra.kernels.table import KernelTable
from memra.settings import Settings

pytestmark = pytest.mark.skipif(cpu_qdot.library() is None, reason="no C++ compiler to build the kernel")


def rnd(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def random_k(qtype: QType, n: int, k: int, seed: int) -> QuantWeight:
    """Any bytes of a K-quant (every quant and scale pattern), with small finite fp16 d / dmin."""
    g = torch.Generator().manual_seed(seed)
    nbytes = quant.PACKABLE[qtype][1]
    data = torch.randint(0, 256, (n * (k // 256), nbytes), dtype=torch.uint8, generator=g)
    for at in {QType.Q4_K: (0, 2), QType.Q5_K: (0, 2), QType.Q6_K: (208,)}[qtype]:
        d = (torch.rand(data.shape[0], generator=g) * 0.01 + 1e-3).half()
        data[:, at : at + 2] = d[:, None].view(torch.uint8)
    return QuantWeight(qtype, data.reshape(n, -1), (n, k), torch.float32)


def weights(n=68, k=512):
    """One packed weight per format (N not a multiple of the kernel's 4-row groups), and row blocks of three."""
    w = rnd(n, k, seed=1) * torch.linspace(0.01, 2.0, n)[:, None]
    w[1, :64] = 0  # an all-zero block
    packed = {"q8_0": quant.quantize_q8_0(w), "q4_k": quant.quantize_q4_k(w),
              "q5_k": random_k(QType.Q5_K, n, k, 2), "q6_k": random_k(QType.Q6_K, n, k, 3)}
    packed["mixed"] = MixedRows((packed["q4_k"], packed["q6_k"], packed["q5_k"]))
    return packed


WEIGHTS = weights()


def activations(m, k=512, seed=4):
    x = rnd(m, k, seed=seed)
    x[0, 32:64] = 0  # an all-zero activation block: d = 0
    x[-1, :32] *= 1e4  # one block of large values beside small ones
    return x


@pytest.mark.parametrize("fmt", list(WEIGHTS))
def test_kernel_is_its_twin_bit_for_bit(fmt):
    w = split.split_layout(WEIGHTS[fmt])
    x, bias = activations(5), rnd(w.shape[0], seed=5)
    out = cpu_qdot.linear(x, w, bias)
    assert torch.equal(out, qdot_reference.linear(x, w, bias))
    for level in (0, 1):  # the scalar loops, AVX2 (below the CPU's best, AVX-512 VNNI where it has it): the same bits
        assert torch.equal(out, cpu_qdot.linear(x, w, bias, avx2=level)), level
    x3 = x.view(5, 1, 512)  # leading dims
    assert torch.equal(cpu_qdot.linear(x3, w, bias), out.view(5, 1, -1))


def test_q6_k_keeps_the_files_planes_and_their_values():
    """Q6_K stays in the file's two bit planes (0.83 bytes a value, the file's 0.82, not a byte a value), and
    unpacking them gives the dequantizer's quants for any bytes."""
    from memra.loading import dequant

    qw = random_k(QType.Q6_K, 8, 512, 7)
    w = split.Q6KSplit.from_quant(qw)
    assert w.shape == (8, 512) and w.nbytes / (8 * 512) < 0.84 < qw.data.numel() / (8 * 512) + 0.02
    want = (dequant.q6_k_quants(qw.data.reshape(-1, 210)).to(torch.int16) - 32).to(torch.int8).reshape(8, 512)
    assert torch.equal(w.quants(0, 8), want) and torch.equal(w.quants(3, 5), want[3:5])


def test_activation_quantizer_is_its_twin():
    x = activations(3, 768)
    x[1, 5] = 2.5 * (x[1].abs().max() / 127)  # an exact .5 after scaling, where half-even matters
    for block in (32, 256):
        for got, want in zip(cpu_qdot.quantize_rows(x, block), qdot_reference.quantize_rows(x, block)):
            assert torch.equal(got, want)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_k", "mixed"])
def test_rows_do_not_depend_on_the_batch_the_chunks_or_the_threads(fmt):
    w = split.split_layout(WEIGHTS[fmt])
    x = activations(9)
    alone = torch.cat([cpu_qdot.linear(x[i : i + 1], w) for i in range(9)])  # B = 1
    for b in range(2, 10):  # E1: each of B rows as at B = 1
        assert torch.equal(cpu_qdot.linear(x[:b], w), alone[:b]), b
    for cut in ((4, 5), (1, 7, 1), (3, 3, 3)):  # E5: a prompt primed in chunks
        parts = torch.cat([cpu_qdot.linear(c, w) for c in x.split(list(cut))])
        assert torch.equal(parts, alone), cut
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_qdot.linear(x, w)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, alone)


@pytest.mark.parametrize("fmt", list(WEIGHTS))
def test_within_the_int8_activation_bound_of_the_dequantized_product(fmt):
    """|y - x @ W^T| <= sum over activation blocks of (max|x_b| / 254) * sum_b |w|: each activation moves by
    at most half its block's step d = max|x_b| / 127. The fp32 steps add a relative 1e-5."""
    qw = WEIGHTS[fmt]
    w = split.split_layout(qw)
    x = activations(4)
    got = cpu_qdot.linear(x, w)
    exact = x.double() @ qw.dequantize(torch.float64).T
    block = 32 if fmt == "q8_0" else 256
    step = x.abs().view(4, -1, block).amax(-1).double() / 254  # [M, K / block]
    wabs = qw.dequantize(torch.float64).abs().view(w.shape[0], -1, block).sum(-1)  # [N, K / block]
    bound = step @ wabs.T + 1e-5 * (x.double().abs() @ qw.dequantize(torch.float64).abs().T)
    assert ((got.double() - exact).abs() <= bound).all()


def test_the_table_runs_the_kernel_on_cpu_and_the_tiled_twin_behind_its_door(monkeypatch, capsys):
    qw = WEIGHTS["q4_k"]
    w, x, b = split.split_layout(qw), activations(3), rnd(qw.shape[0], seed=6)
    kernel = KernelTable.build("cpu", Settings())
    assert torch.equal(kernel.linear(x, w, b), qdot_reference.linear(x, w, b))
    # the tiled twin: its tiles on the table's fp32 linear (the row-invariant one: the weight decoded whole's
    # bits), or on torch's with MEMRA_CPU_FLIN=0 (quant.reference_linear's)
    tiled = KernelTable.build("cpu", Settings().with_doors(MEMRA_CPU_QDOT="0"))
    assert torch.equal(tiled.linear(x, w, b), cpu_flin.linear(x, qw.dequantize(torch.float32), b))
    mkl = KernelTable.build("cpu", Settings().with_doors(MEMRA_CPU_QDOT="0", MEMRA_CPU_FLIN="0"))
    assert torch.equal(mkl.linear(x, w, b), quant.reference_linear(x, qw, b))
    fp8 = split.Fp8BlockSplit(rnd(8, 64).to(torch.float8_e4m3fn), torch.ones(8, 1), 128, torch.float32)
    assert torch.equal(mkl.linear(rnd(2, 64), fp8), quant.tiled_linear(rnd(2, 64), fp8))  # not the kernel's

    monkeypatch.setattr(cpu_qdot, "COMPILERS", ("no-such-compiler",))
    cpu_qdot.library.cache_clear()
    try:
        nolib = KernelTable.build("cpu", Settings())  # no compiler: neither C linear
        assert torch.equal(nolib.linear(x, w, b), quant.reference_linear(x, qw, b))
        assert capsys.readouterr().err.count("\n") == 1  # one line saying why
    finally:
        monkeypatch.undo()
        cpu_qdot.library.cache_clear()


def test_logits_near_the_dequantized_model(load_model):
    """The llama fixture (Q8_0): the kernel's logits within 5% of the logit scale of the file decoded at load
    (measured 2.9%; llama.cpp's own logits are 5.1% from HF fp32's, the file's rounding 3.5%)."""
    from conftest import reference, rel_err

    model = load_model(gguf_file("llama-q8_0"))
    tiled = model.with_doors(MEMRA_CPU_QDOT="0")  # the same bits as the file decoded at load
    for i in range(3):
        ids = reference("llama")[f"prompt{i}"]
        a = model.prime(ids, model.new_cache(128), all_logits=True)
        assert rel_err(a, tiled.prime(ids, tiled.new_cache(128), all_logits=True)) <= 0.05


def test_gate_all_green_on_a_packed_q8_0_gguf_and_its_canary_fails(load_model):
    model = load_model(gguf_file("llama-q8_0"))
    assert isinstance(model.blocks[0].mixer.wqkv, split.Q8Split) and model.ops.qdot
    lines = []
    assert run_battery(model, steps=4, batch=3, mode="strict", plen=12, out=lines.append), "\n".join(lines)
    assert lines[-1].startswith("ALL GREEN")
    lines = []
    assert not run_battery(model.with_doors(MEMRA_GATE_CANARY="1"), steps=4, batch=3, mode="strict", plen=12,
                           out=lines.append)
    assert lines[-1].startswith("FAILED")


def test_gate_all_green_on_a_packed_q4_k_model(monkeypatch):
    import memra.random_model as rm

    monkeypatch.setitem(rm.SHAPES, "tiny-test", lambda n: rm._llama(n or 2, 256, 4, 2, 512, 512))
    model = rm.random_model("tiny-test", "cpu", torch.float32, quant="q4_k")
    lines = []
    assert run_battery(model, steps=4, batch=3, mode="strict", plen=12, out=lines.append), "\n".join(lines)
    assert lines[-1].startswith("ALL GREEN")
