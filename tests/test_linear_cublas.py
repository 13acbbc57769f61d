"""The cuBLAS linear (memra.kernels.triton.linear_cublas, MEMRA_LINEAR_CUBLAS): the door, the table's routing, the
row check a model's load runs (with its canary), and on a GPU the model's bits through it.

On CPU the family is the bucket kernel (interpreted) up to CUBLAS_ABOVE rows and F.linear above, with the activation
and the add apart, so the table's fused ops must equal those compositions bit for bit; the row check is exercised
with a per-row linear (invariant by construction) and a canary that breaks one bit at one row count. On a GPU
(`cuda`): cuBLAS's rows against the Triton kernel's on real weight shapes, and the gate battery on the Qwen3.5-9B
shape with the door open, every row's bits at B=1 and B=96 stacked.
"""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from conftest import gpu_kernel_table  # noqa: E402
from cuda_marks import cuda_only  # noqa: E402

from memra.errors import MemraError  # noqa: E402
from memra.kernels.triton import linear as bucket  # noqa: E402
from memra.kernels.triton import linear_cublas as C  # noqa: E402
from memra.kernels.triton.activation import silu_mul  # noqa: E402
from memra.settings import Settings  # noqa: E402


def rnd(*shape, seed=0, dtype=torch.bfloat16, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)


def per_row(x, w):
    """A linear whose rows are each their own call: invariant by construction."""
    return torch.cat([F.linear(x[i:i + 1], w) for i in range(x.shape[0])])


def one_bit_off_at(rows: int, linear=per_row):
    """The canary: `linear` with one bit of its last row flipped in calls of `rows` rows."""
    def fn(x, w):
        y = linear(x, w)
        if x.shape[0] == rows:
            y.view(torch.int16)[rows - 1, 0] ^= 1
        return y
    return fn


def test_the_door_is_on_by_default_and_not_with_the_shaped_tiles():
    assert Settings.from_env({}).linear_cublas is True and Settings().linear_cublas is True
    assert Settings.from_env({"MEMRA_LINEAR_CUBLAS": "0"}).as_env()["MEMRA_LINEAR_CUBLAS"] == "0"
    assert Settings.from_env({"MEMRA_LINEAR_SHAPED": "1"}).linear_cublas is False  # the shaped tiles alone: off
    with pytest.raises(MemraError, match="MEMRA_LINEAR_CUBLAS=1 and MEMRA_LINEAR_SHAPED=1"):
        Settings.from_env({"MEMRA_LINEAR_CUBLAS": "1", "MEMRA_LINEAR_SHAPED": "1"})


def test_the_table_takes_the_family_only_behind_its_door(monkeypatch):
    # the shapes a load's check held (on CPU F.linear is not held to the interpreter's bits: set them here)
    monkeypatch.setattr(C, "HELD_SHAPES", {(48, 64, torch.bfloat16), (96, 64, torch.bfloat16)})
    on = dataclasses.replace(gpu_kernel_table(), persistent_linear=True, cublas_linear=True)
    assert on.linear_family == "cublas" and on._dense() is C
    assert dataclasses.replace(on, cublas_linear=False).linear_family == "persistent"
    few, many = C.CUBLAS_ABOVE, C.CUBLAS_ABOVE + 16
    x, w, w2, h = rnd(many, 64, seed=1), rnd(48, 64, seed=2), rnd(96, 64, seed=3), rnd(many, 48, seed=4)
    assert torch.equal(on.linear(x, w), F.linear(x, w))  # above: cuBLAS (on CPU, torch's)
    assert torch.equal(on.linear_add(x, w, h), h + F.linear(x, w))
    assert torch.equal(on.linear_silu_mul(x, w2), silu_mul(F.linear(x, w2)))
    assert torch.equal(on.linear(x[:few], w), bucket.linear(x[:few], w))  # at or below: the Triton kernel
    assert torch.equal(on.linear_add(x[:few], w, h[:few]), bucket.linear(x[:few], w, residual=h[:few]))
    assert torch.equal(on.linear_silu_mul(x[:20], w2), bucket.linear_silu_mul(x[:20], w2))
    assert torch.equal(on.linear_silu_mul(x[:3], w2), silu_mul(bucket.linear(x[:3], w2)))  # the GEMV bucket
    b = rnd(48, seed=5)
    assert torch.equal(on.linear(x, w, b), bucket.linear(x, w, b))  # a bias keeps the Triton kernel at every M
    unheld = rnd(32, 64, seed=6)  # a weight the check did not hold keeps the Triton kernel too
    assert torch.equal(on.linear(x, unheld), bucket.linear(x, unheld))
    assert torch.equal(on.linear_silu_mul(x, unheld), bucket.linear_silu_mul(x, unheld))


def test_a_cpu_table_never_takes_it():
    from memra.kernels.table import KernelTable

    table = KernelTable.build("cpu", Settings.from_env({"MEMRA_LINEAR_CUBLAS": "1"}))
    assert not table.cublas_linear and table.linear_family != "cublas"


def test_the_row_check_passes_an_invariant_linear_and_fails_one_bit():
    shapes, rows = [(48, 64), (96, 32)], (1, 2, 3, 5, 8)
    assert C.row_failures(shapes, torch.bfloat16, "cpu", rows, fn=per_row, reference=per_row) == {}
    failed = C.row_failures(shapes, torch.bfloat16, "cpu", rows, fn=one_bit_off_at(3), reference=per_row)
    assert failed == {(48, 64): "[48x64] at 1 row counts (3)", (96, 32): "[96x32] at 1 row counts (3)"}


@pytest.fixture
def small_check(monkeypatch):
    """hold_rows over three row counts, against a per-row reference (on CPU, F.linear is not held to the
    interpreter's bits), with nothing held yet; -> a setter for what stands in for cuBLAS."""
    monkeypatch.setattr(C, "ROW_COUNTS", (1, 2, 4))
    monkeypatch.setattr(bucket, "linear", per_row)
    monkeypatch.setattr(C, "HELD_SHAPES", set())
    monkeypatch.setattr(C, "_HELD", {})
    monkeypatch.setattr(C, "_BEFORE", [])
    yield lambda fn: monkeypatch.setattr(C, "on_cublas", fn)
    if C._BEFORE:  # hold_rows configured torch's flags: the process's own again for the tests after
        C._set_flags(*C._BEFORE[0])


def test_the_check_holds_and_marks_only_what_passed(small_check, capsys):
    """The load's check runs the cuBLAS path itself (not `linear`, which sends an unheld shape to the Triton
    kernel, so a check through it could never fail), marks only the shapes that passed, and names the others in
    one line on stderr: they keep the Triton kernel, so the model still loads with its bits."""
    small_check(per_row)
    assert C.hold_rows([(48, 64)], torch.bfloat16, "cpu") == {}
    assert C.HELD_SHAPES == {(48, 64, torch.bfloat16)} and capsys.readouterr().err == ""
    canary = one_bit_off_at(2)
    small_check(lambda x, w: canary(x, w) if w.shape[0] == 96 else per_row(x, w))  # one row count of one shape
    failed = C.hold_rows([(96, 64), (32, 64)], torch.bfloat16, "cpu")
    assert list(failed) == [(96, 64)]
    assert C.HELD_SHAPES == {(48, 64, torch.bfloat16), (32, 64, torch.bfloat16)}
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "[96x64] at 1 row counts (2)" in err and "keep the Triton kernel" in err
    # (an unheld shape keeps the Triton kernel at every M: test_the_table_takes_the_family_only_behind_its_door)
    small_check(canary)  # a gate of one output column: cuBLAS's GEMV, never probed, never held, never named
    assert C.hold_rows([(1, 64), (C.CUBLAS_MIN_N - 1, 64)], torch.bfloat16, "cpu") == {}
    assert (1, 64, torch.bfloat16) not in C.HELD_SHAPES and capsys.readouterr().err == ""


def test_the_check_covers_every_linear_weight_of_a_model():
    from memra.model.hybrid import dense_linear_shapes

    weights = {"embed": rnd(100, 16), "lm_head": rnd(100, 16), "layers.0.wqkv": rnd(48, 16),
               "layers.0.wo": rnd(16, 32), "layers.0.w_gate_up": rnd(64, 16), "layers.0.w_down": rnd(16, 32),
               "layers.1.w_in": rnd(80, 16), "layers.1.conv": rnd(80, 4), "layers.1.attn_norm": rnd(16),
               "layers.2.w_gate_up": rnd(4, 64, 16), "layers.2.router": rnd(4, 16), "mtp.0.fc": rnd(16, 32)}
    assert dense_linear_shapes(weights, torch.bfloat16) == {(100, 16), (48, 16), (16, 32), (64, 16), (80, 16),
                                                            (4, 16)}


def test_row_counts_cover_every_step_size_cublas_takes():
    from memra.cache import PRIME_CHUNK_MAX_TOKENS
    from memra.graphs import BUCKETS

    assert set(range(C.CUBLAS_ABOVE + 1, max(BUCKETS) + 1)) <= set(C.ROW_COUNTS)
    assert min(C.ROW_COUNTS) == C.CUBLAS_ABOVE + 1 and max(C.ROW_COUNTS) == PRIME_CHUNK_MAX_TOKENS


@cuda_only
def test_cublas_rows_hold_on_this_gpu_and_the_canary_fails():
    """The fact the door stands on, on the running GPU, at the Llama-3-8B widths (lm_head left out for time):
    cuBLAS's rows are the Triton kernel's at every row count it takes; and its canary, one bit off at one row
    count, is refused."""
    shapes = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
    C.configure()
    assert C.row_failures(shapes, torch.bfloat16, "cuda") == {}
    failed = C.row_failures([(4096, 4096)], torch.bfloat16, "cuda", (65, 100, 128), fn=one_bit_off_at(100, C.on_cublas))
    assert failed == {(4096, 4096): "[4096x4096] at 1 row counts (100)"}


@cuda_only
@pytest.mark.parametrize("batch", [1, 96])
def test_gate_9b_shape_on_cublas(shape_9b, batch):
    """Every row's bits with the door open: B rows stacked against each alone (the gate battery); 96 rows take
    cuBLAS in the stacked decode, one row the Triton kernel."""
    from memra.gate import run_battery

    model = shape_9b.with_doors(MEMRA_LINEAR_CUBLAS="1")
    assert model.ops.linear_family == "cublas"
    lines: list[str] = []
    ok = run_battery(model, steps=2, batch=batch, mode="config", plen=8, out=lines.append)
    assert ok, "\n".join(lines)
    assert "decode plan: stacked" in "\n".join(lines)


@cuda_only
def test_a_step_with_cublas_in_it_is_captured_again_after_every_graph_of_its_pool_was_dropped():
    """memra.graphs.run_static and capture_pool: a captured step that calls cuBLAS, dropped with its pool's last
    graph (pools enlarged, an engine closed), then captured again, into a new pool and into the old handle too.
    Before the warm-up and the capture shared one stream, cuBLAS took its workspace during the capture, from the
    graph's pool, which pinned it: the next capture naming that pool failed torch's allocator assert."""
    from memra.graphs import capture_pool, run_static

    C.configure()
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)

    class Step:  # what run_static needs of a static step: body(), its logits' device, its graph
        def __init__(self):
            self.x = torch.randn(96, 4096, device="cuda", dtype=torch.bfloat16)
            self.logits, self.graph = torch.empty(96, 4096, device="cuda"), None
            self.model = types.SimpleNamespace(ops=types.SimpleNamespace(cublas_linear=True))  # the door's model

        def body(self):
            self.logits.copy_(C.on_cublas(self.x, w))  # 96 rows: a cuBLAS kernel

    store: dict = {}
    pool = capture_pool(store, None)
    store["a"] = first = Step()
    run_static(first, pool)
    assert first.graph is not None and capture_pool(store, pool) == pool  # the others share it while one lives
    del store["a"], first  # the pool's last graph gone
    fresh = capture_pool(store, pool)
    assert fresh != pool
    for handle in (fresh, pool):
        step = Step()
        run_static(step, handle)
        step.graph.replay()
        assert torch.equal(step.logits, C.on_cublas(step.x, w).float())


def test_torch_defaults_gives_code_not_memras_the_flags_as_the_process_had_them(monkeypatch):
    """configure() changes torch's process-wide cuBLAS flags; torch_defaults() puts back what it first found for
    the duration (the HF peer of `memra bench model`), then memra's again."""
    monkeypatch.setattr(C, "_BEFORE", [])
    before = C._flags()
    try:
        C.configure()
        configured = C._flags()
        assert configured[:2] == (False, False) and configured != before  # (torch reads back the first half)
        with C.torch_defaults():
            assert C._flags() == before
        assert C._flags() == configured
    finally:
        C._set_flags(*before)
