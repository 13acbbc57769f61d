"""Each Triton kernel against its pure-torch twin (to a stated tolerance), and against itself across
row counts (bit for bit: the property the exact path buys with them).

On a CPU machine the kernels run in Triton's interpreter (TRITON_INTERPRET=1: the same kernel
code, executed with numpy), so CI checks their meaning; MEMRA_TEST_DEVICE=cuda runs them compiled.
Tolerances: the kernels sum in another order than torch does (that is their point), so against the
twin we allow fp32 rounding noise (2e-5 of the largest value) and, in bf16, two roundings of the
output (2^-6: each side rounds once, differently).
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from memra.kernels import reference  # noqa: E402
from memra.kernels.table import triton_ops  # noqa: E402  (interpreted on CPU: conftest sets TRITON_INTERPRET)
from memra.kernels.triton.rope import ROPE_TILE_HEADS  # noqa: E402

tk = triton_ops()  # every family's twin of a reference op, under the reference's name

DEVICE = os.environ.get("MEMRA_TEST_DEVICE", "cpu")

DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2 ** -7}


def rnd(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(device=DEVICE, dtype=dtype)


def close(a, b, dtype):
    a, b = a.float(), b.float()
    assert a.shape == b.shape
    err = ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
    assert err <= TOL[dtype] * 2, f"relative error {err:.3g} over {TOL[dtype] * 2:.3g}"


def same_bits(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_matches_twin_and_rows_do_not_depend_on_m(dtype):
    w, b = rnd(96, 200, dtype=dtype, seed=1), rnd(96, dtype=dtype, seed=2)
    x = rnd(70, 200, dtype=dtype, seed=3)
    full = tk.linear(x, w, b)
    close(full, reference.linear(x.float(), w.float(), b.float()), dtype)
    for m in (1, 3, 64):  # the same rows inside smaller calls, and row 5 moved to the front
        same_bits(tk.linear(x[:m], w, b), full[:m])
    same_bits(tk.linear(x[5:6], w)[0], tk.linear(x, w)[5])


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_with_residual_is_the_linear_then_the_add(dtype):
    """The residual add in the linear's epilogue: torch's add of the two model-dtype tensors, bit for
    bit, and still M-invariant (a row alone has its bits in the batch)."""
    w, x = rnd(96, 200, dtype=dtype, seed=1), rnd(70, 200, dtype=dtype, seed=3)
    h = rnd(70, 96, dtype=dtype, seed=4, scale=8.0)
    fused = tk.linear(x, w, residual=h)
    same_bits(fused, h + tk.linear(x, w))
    same_bits(tk.linear(x[5:6], w, residual=h[5:6]), fused[5:6])


@pytest.mark.parametrize("dtype", DTYPES)
def test_gate_up_projection_with_the_activation_is_the_two_launches(dtype):
    """SwiGLU's projection with silu(gate) * up in its epilogue: the bits of linear then silu_mul (each
    column's products summed as the plain kernel sums them, rounded, then the activation's steps), a
    row's bits alone its bits in the call, at every size of call."""
    from memra.kernels.triton.linear import linear_silu_mul

    f, k = 72, 200  # F not a tile multiple: a ragged column tile in each half
    w, x = rnd(2 * f, k, dtype=dtype, seed=7, scale=0.3), rnd(70, k, dtype=dtype, seed=8)
    full = linear_silu_mul(x, w)
    same_bits(full, tk.silu_mul(tk.linear(x, w)))
    for m in (1, 3, 64):
        same_bits(linear_silu_mul(x[:m], w), full[:m])
    same_bits(linear_silu_mul(x[5:6].clone(), w), full[5:6])
    same_bits(linear_silu_mul(x.view(7, 10, k), w), full.view(7, 10, f))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_is_torchs_two_ops(dtype):
    """SwiGLU's activation in one launch: on a GPU torch's bits (its expf, division and two roundings),
    in the interpreter (numpy's exp) within the twin tolerance; a row's bits alone are its bits in the
    call, and a [..., 2F] view of a wider projection (gate | up columns of a split) reads the same."""
    x = rnd(37, 2 * 1100, dtype=dtype, seed=5, scale=4.0)  # F = 1100: two column blocks, a ragged one
    x[0, :6] = torch.tensor([-100.0, -30.0, 0.0, 30.0, 100.0, -0.0])  # exp overflow, signed zero
    got = tk.silu_mul(x)
    if DEVICE.startswith("cuda"):
        same_bits(got, reference.silu_mul(x))
    else:
        close(got, reference.silu_mul(x), dtype)
    same_bits(tk.silu_mul(x[5:6].clone()), got[5:6])
    wide = torch.cat((x, rnd(37, 16, dtype=dtype, seed=6)), dim=1)[:, : 2 * 1100]  # rows of stride 2216
    same_bits(tk.silu_mul(wide.view(37, 1, 2200)), got.view(37, 1, 1100))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("zero_centered", [True, False])
def test_rms_norm_matches_twin_and_is_row_invariant(dtype, zero_centered):
    x, w = rnd(9, 3, 40, dtype=dtype, seed=4), rnd(40, seed=5) + 1
    full = tk.rms_norm(x, w, 1e-6, zero_centered)
    close(full, reference.rms_norm(x, w, 1e-6, zero_centered), dtype)
    same_bits(tk.rms_norm(x[2:3], w, 1e-6, zero_centered), full[2:3])


@pytest.mark.parametrize("zero_centered", [True, False])
def test_rms_norm_reads_a_strided_view_in_place(zero_centered):
    """q and k normed where they lie inside a fused projection's output ([T, H, D] views with token and
    head strides): the bits of the norm over their contiguous copies."""
    qkv = rnd(5, 2 * 4 * 16 + 2 * 16, dtype=torch.bfloat16, seed=6)  # [T, 4 heads of (q | gate) + k + v]
    q = qkv[:, : 4 * 32].view(5, 4, 32)[..., :16]  # strides (160, 32, 1)
    k = qkv[:, 4 * 32 : 4 * 32 + 16].view(5, 1, 16)  # strides (160, 16, 1)
    w = rnd(16, seed=7) + 1
    for view in (q, k, qkv[:, :16]):
        same_bits(tk.rms_norm(view, w, 1e-6, zero_centered), tk.rms_norm(view.contiguous(), w, 1e-6, zero_centered))


def test_gated_norm_matches_twin():
    for dtype in DTYPES:
        o, z, w = rnd(5, 2, 24, seed=7), rnd(5, 2, 24, dtype=dtype, seed=8), rnd(24, seed=9)
        full = tk.gated_rms_norm(o, z, w, 1e-6)
        close(full, reference.gated_rms_norm(o, z, w, 1e-6), dtype)
        same_bits(tk.gated_rms_norm(o[1:2], z[1:2], w, 1e-6), full[1:2])
        same_bits(tk.gated_rms_norm(o.to(dtype), z, w, 1e-6), full)  # fp32 o: rounded first, as a cast would
        wide = rnd(5, 3 * 2 * 24, dtype=dtype, seed=10)  # z as the GDN's projection split leaves it: a column slice
        zs = wide[:, 24 : 24 + 2 * 24].reshape(5, 2, 24)
        same_bits(tk.gated_rms_norm(o, zs, w, 1e-6), tk.gated_rms_norm(o, zs.contiguous(), w, 1e-6))


def test_delta_rule_step_matches_twin_and_is_row_invariant():
    b, h, dk, dv = 5, 3, 16, 40
    q = reference.l2_normalize(rnd(b, h, dk, seed=10))
    k = reference.l2_normalize(rnd(b, h, dk, seed=11))
    v, s = rnd(b, h, dv, seed=12), rnd(b, h, dk, dv, seed=13)
    beta, g = torch.sigmoid(rnd(b, h, seed=14)), -torch.rand(b, h, generator=torch.Generator().manual_seed(15)).to(DEVICE)
    o, s_new = tk.delta_rule_step(q, k, v, beta, g, s)
    o_ref, s_ref = reference.delta_rule_step(q, k, v, beta, g, s)
    close(o, o_ref, torch.float32)
    close(s_new, s_ref, torch.float32)
    o1, s1 = tk.delta_rule_step(q[2], k[2], v[2], beta[2], g[2], s[2])  # one sequence alone: [H, ...]
    same_bits(o1, o[2])
    same_bits(s1, s_new[2])


def test_delta_rule_step_into_a_pool_is_the_step_on_its_slots():
    """The graphed decode's GDN step on states where they live (pool[slots], in place): the output and
    each stepped slot have the bits of delta_rule_step on the gathered states (and of the verify's
    scan); the slots not named keep theirs; the twin agrees."""
    b, h, dk, dv, n_slots = 3, 2, 16, 40, 6
    q = reference.l2_normalize(rnd(b, h, dk, seed=20))
    k = reference.l2_normalize(rnd(b, h, dk, seed=21))
    v = rnd(b, h, dv, seed=22)
    beta, g = torch.sigmoid(rnd(b, h, seed=23)), -torch.rand(b, h, generator=torch.Generator().manual_seed(24)).to(DEVICE)
    slots = torch.tensor([4, 0, 2], device=DEVICE)
    pool = rnd(n_slots, h, dk, dv, seed=25)
    before = pool.clone()
    o = tk.delta_rule_step_into(q, k, v, beta, g, pool, slots)
    o_want, s_want = tk.delta_rule_step(q, k, v, beta, g, before[slots])
    same_bits(o, o_want)
    same_bits(pool[slots], s_want)
    untouched = [i for i in range(n_slots) if i not in slots.tolist()]
    same_bits(pool[untouched], before[untouched])
    o_scan, states = tk.delta_rule_scan(q[:, None], k[:, None], v[:, None], beta[:, None], g[:, None], before[slots])
    same_bits(o_scan[:, 0], o)
    same_bits(states[:, 0], pool[slots])
    twin = before.clone()
    close(reference.delta_rule_step_into(q, k, v, beta, g, twin, slots), o, torch.float32)
    close(twin, pool, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_attention_rows_is_each_row_alone(dtype):
    """One launch over R rows (decode's B sequences, or a verify's T positions of one sequence) gives
    every row the bits of its own single-row call, and the twin's values."""
    n_blocks, block, hkv, hq, d = 8, 16, 2, 4, 32
    k_pool, v_pool = rnd(n_blocks, block, hkv, d, dtype=dtype, seed=30), rnd(n_blocks, block, hkv, d, dtype=dtype, seed=31)
    table = torch.tensor([6, 2, 7, 0, 3], device=DEVICE)
    flat = lambda n: table[torch.arange(n, device=DEVICE) // block] * block + torch.arange(n, device=DEVICE) % block
    rows = flat(70)
    lens = torch.tensor([1, 17, 33, 70, 16], device=DEVICE)  # the verify's shape: prefixes of one table
    starts = torch.zeros_like(lens)
    q = rnd(5, hq, d, dtype=dtype, seed=32)
    out = tk.paged_attention_rows(q, k_pool, v_pool, rows, starts, lens, 0.17)
    close(out, reference.paged_attention_rows(q, k_pool, v_pool, rows, starts, lens, 0.17), dtype)
    for r, n in enumerate(lens.tolist()):
        same_bits(tk.paged_decode_attention(q[r], k_pool, v_pool, rows[:n], 0.17), out[r])
    # A captured step tells the kernel its table's width, far past most rows: the splits past a row's
    # prefix are empty and pass through the combine, which must not move a bit.
    same_bits(tk.paged_attention_rows(q, k_pool, v_pool, rows, starts, lens, 0.17, max_len=256), out)  # 8 splits
    packed = torch.cat([rows[:n] for n in lens.tolist()])  # decode's shape: one table per row, concatenated
    offs = torch.cumsum(lens, 0) - lens
    same_bits(tk.paged_attention_rows(q, k_pool, v_pool, packed, offs, lens, 0.17), out)


def test_delta_rule_scan_is_decode_steps_in_order():
    """The verify's one-call scan over T tokens == T decode steps (the same kernel at T=1), bit for
    bit, state after every token included; and == its pure-torch twin within fp32 rounding."""
    t, h, dk, dv = 5, 3, 16, 40
    q = reference.l2_normalize(rnd(1, t, h, dk, seed=20))
    k = reference.l2_normalize(rnd(1, t, h, dk, seed=21))
    v, s0 = rnd(1, t, h, dv, seed=22), rnd(1, h, dk, dv, seed=23)
    beta = torch.sigmoid(rnd(1, t, h, seed=24))
    g = -torch.rand(1, t, h, generator=torch.Generator().manual_seed(25)).to(DEVICE)
    o, states = tk.delta_rule_scan(q, k, v, beta, g, s0)
    s = s0[0]
    for j in range(t):  # decode: one token at a time, state through memory
        oj, s = tk.delta_rule_step(q[0, j], k[0, j], v[0, j], beta[0, j], g[0, j], s)
        same_bits(oj, o[0, j])
        same_bits(s, states[0, j])
    o_ref, states_ref = reference.delta_rule_scan(q, k, v, beta, g, s0)
    close(o, o_ref, torch.float32)
    close(states, states_ref, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_decode_attention_matches_twin(dtype):
    n_blocks, block, hkv, hq, d = 6, 16, 2, 6, 32
    k_pool, v_pool = rnd(n_blocks, block, hkv, d, dtype=dtype, seed=16), rnd(n_blocks, block, hkv, d, dtype=dtype, seed=17)
    table = torch.tensor([4, 1, 5], device=DEVICE)  # pages out of order, as a pool hands them out
    for s in (1, 16, 17, 40):
        pos = torch.arange(s, device=DEVICE)
        rows = table[pos // block] * block + pos % block
        q = rnd(hq, d, dtype=dtype, seed=18 + s)
        got = tk.paged_decode_attention(q, k_pool, v_pool, rows, d ** -0.5)
        close(got, reference.paged_decode_attention(q, k_pool, v_pool, rows, d ** -0.5), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d,r", [(64, 64), (64, 16)])  # full and partial rotary (Qwen3.5 rotates a quarter)
def test_rope_matches_the_reference_within_one_rounding(dtype, d, r):
    """The fused rope rounds after each product and after the sum, as the reference's separate kernels
    do; measured on the H200 it lands within one rounding of the reference (not always its bits), and
    the interpreter's fp32 -> 16-bit conversion truncates. Both are held to one rounding of the output."""
    t, h = 5, 3
    qkv = rnd(t, h * d * 2, dtype=dtype, seed=3)
    x = qkv[:, : h * d].view(t, h, d)  # a strided view, as the projections hand it over
    pos = torch.arange(7, 7 + t, device=DEVICE)
    inv = 1.0 / (10000 ** (torch.arange(0, r, 2, device=DEVICE).float() / r))
    cos, sin = reference.rope_cos_sin(pos, inv, dtype)
    got, want = tk.apply_rope(x, cos, sin), reference.apply_rope(x, cos, sin)
    tol = 2 ** -6 if dtype != torch.float32 else 1e-6
    assert (got.float() - want.float()).abs().max() <= want.float().abs().max() * tol
    assert torch.equal(got[..., r:], x[..., r:])  # channels past R pass through untouched
    assert torch.equal(tk.apply_rope(x[2:3], cos[2:3], sin[2:3]), got[2:3])  # a token's bits alone == in the batch
    for heads in (2, ROPE_TILE_HEADS):  # MEMRA_ROPE_TILE: several heads a program, the last group part empty
        assert torch.equal(tk.apply_rope(x, cos, sin, heads), got)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d,r", [(64, 64), (64, 16)])
def test_rope_write_kv_is_the_rope_then_the_copy(dtype, d, r):
    """One launch for the step between projection and attention: the rotated q and the pool's K/V rows
    have the bits of apply_rope then index_copy_ (the six launches it replaces); rows not named keep
    theirs; the twin (reference.rope_write_kv) agrees within the rope's one rounding."""
    t, hq, hkv, n_blocks, block = 4, 4, 2, 3, 8
    qkv = rnd(t, (hq + 2 * hkv) * d, dtype=dtype, seed=5)
    q, k, v = (x.view(t, -1, d) for x in qkv.split([hq * d, hkv * d, hkv * d], dim=-1))  # strided views
    pos = torch.arange(3, 3 + t, device=DEVICE)
    inv = 1.0 / (10000 ** (torch.arange(0, r, 2, device=DEVICE).float() / r))
    cos, sin = reference.rope_cos_sin(pos, inv, dtype)
    rows = torch.tensor([9, 2, 17, 10], device=DEVICE)
    pools = lambda: (rnd(n_blocks, block, hkv, d, dtype=dtype, seed=6), rnd(n_blocks, block, hkv, d, dtype=dtype, seed=7))
    k_pool, v_pool = pools()
    got_q = tk.rope_write_kv(q, k, v, cos, sin, k_pool, v_pool, rows)
    want_k, want_v = pools()
    want_k.view(-1, hkv, d).index_copy_(0, rows, tk.apply_rope(k, cos, sin))
    want_v.view(-1, hkv, d).index_copy_(0, rows, v)
    assert torch.equal(got_q, tk.apply_rope(q, cos, sin))
    assert torch.equal(k_pool, want_k) and torch.equal(v_pool, want_v)
    tiled_k, tiled_v = pools()  # MEMRA_ROPE_TILE: several heads a program (here past the last head), same bits
    for heads in (2, ROPE_TILE_HEADS):
        assert torch.equal(tk.rope_write_kv(q, k, v, cos, sin, tiled_k, tiled_v, rows, heads), got_q)
        assert torch.equal(tiled_k, k_pool) and torch.equal(tiled_v, v_pool)
    twin_k, twin_v = pools()
    twin_q = reference.rope_write_kv(q, k, v, cos, sin, twin_k, twin_v, rows)
    tol = 2 ** -6 if dtype != torch.float32 else 1e-6
    for got, want in ((got_q, twin_q), (k_pool, twin_k)):
        assert (got.float() - want.float()).abs().max() <= want.float().abs().max() * tol
    assert torch.equal(v_pool, twin_v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("zero_centered", [True, False])
def test_add_rms_norm_is_the_add_then_the_norm(dtype, zero_centered):
    """The fused residual add + pre-norm: the sum has torch's bits, the norm rms_norm's bits on that sum."""
    h, d, w = rnd(7, 96, dtype=dtype, seed=30), rnd(7, 96, dtype=dtype, seed=31), rnd(96, seed=32) + 1
    s, y = tk.add_rms_norm(h, d, w, 1e-6, zero_centered)
    same_bits(s, h + d)
    same_bits(y, tk.rms_norm(h + d, w, 1e-6, zero_centered))
    ref_s, ref_y = reference.add_rms_norm(h, d, w, 1e-6, zero_centered)
    same_bits(s, ref_s)
    close(y, ref_y, torch.bfloat16 if dtype != torch.float32 else dtype)
    s1, y1 = tk.add_rms_norm(h[4:5].clone(), d[4:5].clone(), w, 1e-6, zero_centered)  # a row alone
    same_bits(s1, s[4:5])
    same_bits(y1, y[4:5])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [32, 24])
def test_prefill_attention_matches_twin_and_does_not_depend_on_the_piece(dtype, d):
    """A prompt's queries attended in one piece, or in pieces of any length and alignment, or alone:
    the same bits per query (what lets the exact prefill run large pieces); the twin's values."""
    n_blocks, block, hkv, hq, n = 12, 16, 2, 4, 150
    k_pool, v_pool = rnd(n_blocks, block, hkv, d, dtype=dtype, seed=40), rnd(n_blocks, block, hkv, d, dtype=dtype, seed=41)
    table = torch.tensor([9, 2, 7, 0, 3, 11, 5, 1, 10, 4], device=DEVICE)
    pos = torch.arange(n, device=DEVICE)
    rows = table[pos // block] * block + pos % block
    q = rnd(n, hq, d, dtype=dtype, seed=42)
    whole = tk.prefill_attention(q, k_pool, v_pool, rows, 0, d ** -0.5)
    close(whole, reference.prefill_attention(q, k_pool, v_pool, rows, 0, d ** -0.5), dtype)
    for a, b in ((0, 64), (64, 100), (100, 150), (37, 38), (70, 141)):
        piece = tk.prefill_attention(q[a:b].clone(), k_pool, v_pool, rows[:b], a, d ** -0.5)
        same_bits(piece, whole[a:b])
        close(piece, reference.prefill_attention(q[a:b], k_pool, v_pool, rows[:b], a, d ** -0.5), dtype)


@pytest.mark.parametrize("window", [5, 40, 64])
def test_sliding_window_prefill_is_the_twins_and_does_not_depend_on_the_piece(window):
    """Sliding-window prefill (a query at p sees p-W+1..p) across the window edge: pieces of any length
    and alignment give each query the bits of the one-shot call, near the twin's masked definition;
    a window wider than the prompt is full attention's bits. Several sequences in one launch too."""
    from memra.kernels.pieces import AttentionPieces

    dtype, d, n_blocks, block, hkv, hq, n = torch.float32, 32, 12, 16, 2, 4, 150
    k_pool, v_pool = rnd(n_blocks, block, hkv, d, dtype=dtype, seed=50), rnd(n_blocks, block, hkv, d, dtype=dtype, seed=51)
    table = torch.tensor([9, 2, 7, 0, 3, 11, 5, 1, 10, 4], device=DEVICE)
    pos = torch.arange(n, device=DEVICE)
    rows = table[pos // block] * block + pos % block
    q = rnd(n, hq, d, dtype=dtype, seed=52)
    whole = tk.prefill_attention(q, k_pool, v_pool, rows, 0, 0.3, window)
    close(whole, reference.prefill_attention(q, k_pool, v_pool, rows, 0, 0.3, window), dtype)
    full = tk.prefill_attention(q, k_pool, v_pool, rows, 0, 0.3)
    assert not torch.equal(whole[window:], full[window:])  # the window is applied past its edge...
    same_bits(whole[:window], full[:window])  # ... and nowhere before it
    for a, b in ((0, 64), (64, 100), (100, 150), (37, 38), (70, 141)):
        same_bits(tk.prefill_attention(q[a:b].clone(), k_pool, v_pool, rows[:b], a, 0.3, window), whole[a:b])
    spans = ((0, 70), (100, 150))
    read = [rows[:b] for _, b in spans]
    sizes = [b - a for a, b in spans]
    pieces = AttentionPieces.of([0, sizes[0]], [a for a, _ in spans], read)
    out = tk.prefill_attention_pieces(torch.cat([q[a:b] for a, b in spans]), k_pool, v_pool, pieces, 0.3, window)
    same_bits(out[: sizes[0]], whole[:70])
    same_bits(out[sizes[0]:], whole[100:])


def test_sliding_window_decode_rows_read_the_windows_last_positions():
    """A decode row cut to its window (reference.window_rows) reads its prefix's last W positions: the
    twin's masked prefill value for that query, and each row the bits of its own call."""
    dtype, d, block, hkv, hq, w = torch.float32, 32, 16, 2, 4, 20
    k_pool, v_pool = rnd(8, block, hkv, d, dtype=dtype, seed=60), rnd(8, block, hkv, d, dtype=dtype, seed=61)
    rows = torch.arange(8 * block, device=DEVICE).flip(0)
    lens = torch.tensor([7, 20, 21, 90], device=DEVICE)
    q = rnd(4, hq, d, dtype=dtype, seed=62)
    starts, cut = reference.window_rows(torch.zeros_like(lens), lens, w)
    assert cut.tolist() == [7, 20, 20, 20] and starts.tolist() == [0, 0, 1, 70]
    out = tk.paged_attention_rows(q, k_pool, v_pool, rows, starts, cut, 0.3)
    for r, n in enumerate(lens.tolist()):
        prefill = reference.prefill_attention(q[r : r + 1], k_pool, v_pool, rows[:n], n - 1, 0.3, w)[0]
        close(out[r], prefill, dtype)
        same_bits(out[r : r + 1], tk.paged_attention_rows(q[r : r + 1], k_pool, v_pool, rows, starts[r : r + 1],
                                                          cut[r : r + 1], 0.3))


@pytest.mark.parametrize("dtype", DTYPES)
def test_pieces_of_several_sequences_in_one_launch_keep_their_solo_bits(dtype):
    """Cross-request prefill: pieces of three sequences (different pools' pages, positions and lengths,
    one of them longer than a query tile) stacked in one launch: each piece's rows are the bits of its
    own prefill_attention call, and the twin's piece-by-piece definition agrees."""
    from memra.kernels.pieces import AttentionPieces

    n_blocks, block, hkv, hq, d = 16, 16, 2, 4, 32
    k_pool, v_pool = rnd(n_blocks, block, hkv, d, dtype=dtype, seed=70), rnd(n_blocks, block, hkv, d, dtype=dtype, seed=71)
    tables = ([9, 2, 7, 0, 3], [11, 5, 1], [10, 4, 14, 6, 8, 12, 13, 15, 1, 2])
    spans = ((0, 70), (20, 41), (64, 150))  # (pos0, pos0 + tokens) of each sequence's piece
    read = [torch.tensor(tb, device=DEVICE)[torch.arange(b, device=DEVICE) // block] * block
            + torch.arange(b, device=DEVICE) % block for tb, (_, b) in zip(tables, spans)]
    sizes = [b - a for a, b in spans]
    firsts = [sum(sizes[:i]) for i in range(len(sizes))]
    q = rnd(sum(sizes), hq, d, dtype=dtype, seed=72)
    pieces = AttentionPieces.of(firsts, [a for a, _ in spans], read)
    out = tk.prefill_attention_pieces(q, k_pool, v_pool, pieces, 0.2)
    twin = reference.prefill_attention_pieces(q, k_pool, v_pool, pieces, 0.2)
    buf = torch.zeros(3 + q.shape[0], hq, d, dtype=dtype, device=DEVICE)  # a mixed step's buffer: rows after 3 others
    assert tk.prefill_attention_pieces(q, k_pool, v_pool, pieces, 0.2, out=buf[3:]).data_ptr() == buf[3:].data_ptr()
    same_bits(buf[3:], out)
    for first, n, (a, _), rows in zip(firsts, sizes, spans, read):
        same_bits(out[first : first + n], tk.prefill_attention(q[first : first + n].clone(), k_pool, v_pool, rows, a, 0.2))
        close(out[first : first + n], twin[first : first + n], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_split_prefixes_give_each_row_its_own_bits(dtype, monkeypatch):
    """Long prefixes are split at fixed positions (ATTN_SPLIT, made small here). A row's bits must not
    depend on whether its call was split (the longest row decides): a short row in a split call has
    the bits of its unsplit call alone, a long row the bits of its own split call; all near the twin."""
    from memra.kernels.triton import attention

    monkeypatch.setattr(attention, "ATTN_SPLIT", 32)
    n_blocks, block, hkv, hq, d = 8, 16, 2, 4, 32
    k_pool, v_pool = rnd(n_blocks, block, hkv, d, dtype=dtype, seed=50), rnd(n_blocks, block, hkv, d, dtype=dtype, seed=51)
    table = torch.tensor([6, 2, 7, 0, 3], device=DEVICE)
    flat = lambda n: table[torch.arange(n, device=DEVICE) // block] * block + torch.arange(n, device=DEVICE) % block
    rows, lens = flat(70), torch.tensor([1, 17, 32, 33, 70], device=DEVICE)
    starts = torch.zeros_like(lens)
    q = rnd(5, hq, d, dtype=dtype, seed=52)
    out = tk.paged_attention_rows(q, k_pool, v_pool, rows, starts, lens, 0.17, max_len=70)  # three splits
    close(out, reference.paged_attention_rows(q, k_pool, v_pool, rows, starts, lens, 0.17), dtype)
    for r, n in enumerate(lens.tolist()):
        same_bits(tk.paged_decode_attention(q[r], k_pool, v_pool, rows[:n], 0.17), out[r])
    # A captured step tells the kernel its table's width, far past most rows: the splits past a row's
    # prefix are empty and pass through the combine, which must not move a bit.
    same_bits(tk.paged_attention_rows(q, k_pool, v_pool, rows, starts, lens, 0.17, max_len=256), out)  # 8 splits
    buf = torch.zeros(7, hq, d, dtype=dtype, device=DEVICE)  # written in place: a mixed step's first rows of its buffer
    tk.paged_attention_rows(q, k_pool, v_pool, rows, starts, lens, 0.17, max_len=70, out=buf[:5])
    same_bits(buf[:5], out)
    assert not buf[5:].any()
    # MEMRA_ATTN_SHORT_ROWS: the rows of one split write their output in the split launch and skip the combine
    for bound in (70, 256):
        same_bits(tk.paged_attention_rows(q, k_pool, v_pool, rows, starts, lens, 0.17, max_len=bound, short_rows=True),
                  out)
        # MEMRA_ATTN_SKIP_EMPTY: the splits past a row's prefix write no partials and the combine reads none;
        # MEMRA_ATTN_SPLIT_WALK (its threshold made 1 here): a program walks its row's splits, either way, and
        # with MEMRA_ATTN_WALK_COMBINE merges them itself
        for short, skip, walk, merge in itertools.product((False, True), repeat=4):
            if (skip or walk) and (walk or not merge):
                monkeypatch.setattr(attention, "WALK_PROGRAMS", 1 if walk else 1 << 30)
                same_bits(tk.paged_attention_rows(q, k_pool, v_pool, rows, starts, lens, 0.17, max_len=bound,
                                                  short_rows=short, skip_empty=skip, split_walk=walk,
                                                  walk_combine=merge), out)
    # liveness: in the split launch itself, a one-split row (lens 17) writes its output and no partials; a
    # longer one (70) writes partials and leaves its output to the combine; so too where a program walks a row
    shape = attention.decode_shape(q, k_pool)
    for walk in (False, True):
        m = torch.full((5, hq, 3), float("nan"), device=DEVICE)
        part, o = torch.full((5, hq, 3, d), float("nan"), device=DEVICE), torch.zeros_like(q)
        attention._decode_attention_kernel[(5, hkv, 1 if walk else 3)](
            q, k_pool, v_pool, rows, starts, lens, part, m, m.clone(), o, hq, 0.17 * 1.4426950408889634, int(walk), 3,
            PARTIAL=True, DIRECT=True, WALK=walk, **shape)
        same_bits(o[1], out[1])
        assert torch.isnan(m[1]).all() and not torch.isnan(m[4]).any() and not o[4].any()
    # ... and where the walk merges its splits itself (COMBINE): the long row's output too, from its partials
    m = torch.full((5, hq, 3), float("nan"), device=DEVICE)
    part, o = torch.full((5, hq, 3, d), float("nan"), device=DEVICE), torch.zeros_like(q)
    attention._decode_attention_kernel[(5, hkv, 1)](q, k_pool, v_pool, rows, starts, lens, part, m, m.clone(), o, hq,
                                                    0.17 * 1.4426950408889634, 1, 3, PARTIAL=True, WALK=True,
                                                    COMBINE=True, **shape)
    same_bits(o, out)
    assert torch.isnan(m[1]).all() and not torch.isnan(m[4]).any()
    # liveness of the skip: a row of 33 positions fills splits 0 and 1 of three, and only with the skip is split 2's
    # partial left unwritten (without it, an empty split writes -inf); walked, one program a row writes the same
    for skip, written in ((1, False), (0, True)):
        for walk in (False, True)[: 2 if skip else 1]:  # the launcher walks only with the skip
            m = torch.full((5, hq, 3), float("nan"), device=DEVICE)
            attention._decode_attention_kernel[(5, hkv, 1 if walk else 3)](
                q, k_pool, v_pool, rows, starts, lens, part, m, m.clone(), o, hq, 0.17 * 1.4426950408889634, skip, 3,
                PARTIAL=True, WALK=walk, **shape)
            assert not torch.isnan(m[3, :, :2]).any() and torch.isnan(m[3, :, 2]).all() != written


def _gdn_inputs(t, h=2, dk=32, dv=48, seed=60):
    q = reference.l2_normalize(rnd(t, h, dk, seed=seed)) * dk ** -0.5
    k = reference.l2_normalize(rnd(t, h, dk, seed=seed + 1))
    v, s0 = rnd(t, h, dv, seed=seed + 2), rnd(h, dk, dv, seed=seed + 3) * 0.1
    beta = torch.sigmoid(rnd(t, h, seed=seed + 4))
    g = -torch.rand(t, h, generator=torch.Generator().manual_seed(seed + 5)).to(DEVICE) * 0.5
    return q, k, v, beta, g, s0


def test_gdn_prefill_of_several_sequences_in_one_launch_pair_keeps_their_solo_bits():
    """Cross-request prefill: three sequences' pieces (a 1-token piece, one crossing an absolute
    multiple of 64, a long one) in the rows of one wave, their states in a pool's slots: each piece's
    output and final state have the bits of its own gdn_prefill call, stepped in place in the pool;
    the twin's piece-by-piece definition agrees; the slots no piece names are untouched."""
    from memra.kernels.pieces import RecurrentPieces
    from memra.kernels.triton import gdn as gdn_triton

    sizes, pos0s, slots = [1, 50, 140], [7, 40, 0], [3, 0, 2]
    q, k, v, beta, g, s0 = _gdn_inputs(sum(sizes))
    pool = rnd(5, *s0.shape, seed=77) * 0.1  # [slots, Hv, Dk, Dv]
    firsts = [0, 1, 51]
    pieces = RecurrentPieces.of(firsts, sizes, pos0s, slots, pool.device)
    before, twin_pool = pool.clone(), pool.clone()
    o = gdn_triton.gdn_prefill_pieces(q, k, v, beta, g, pool, pieces)
    o_twin = reference.gdn_prefill_pieces(q, k, v, beta, g, twin_pool, pieces)
    for first, t, pos0, slot in zip(firsts, sizes, pos0s, slots):
        rows = slice(first, first + t)
        o_solo, s_solo = gdn_triton.gdn_prefill(q[rows], k[rows], v[rows], beta[rows], g[rows], before[slot], pos0)
        same_bits(o[rows], o_solo)
        same_bits(pool[slot], s_solo)
    close(o, o_twin, torch.float32)
    close(pool, twin_pool, torch.float32)
    for slot in (1, 4):
        same_bits(pool[slot], before[slot])


def test_a_mixed_steps_gdn_output_is_written_in_place_with_the_bits_of_its_own_calls():
    """A mixed step's GDN layer has its decode rows and its prompt pieces write their rows of one output buffer
    (`out`): the bits are those of each call's own output, the buffer's rows are all written, and the table's
    twin paths copy into it."""
    from memra.kernels.pieces import RecurrentPieces
    from memra.kernels.table import KernelTable
    from memra.kernels.triton import gdn as gdn_triton
    from memra.settings import Settings

    q, k, v, beta, g, s0 = _gdn_inputs(3 + 70)
    pool = rnd(6, *s0.shape, seed=78) * 0.1
    pieces = RecurrentPieces.of([0], [70], [5], [4], pool.device)
    rows, piece = slice(0, 3), slice(3, None)
    slots = torch.tensor([1, 0, 2], device=pool.device)
    plain_pool, out_pool = pool.clone(), pool.clone()
    o_rows = gdn_triton.delta_rule_step_into(q[rows], k[rows], v[rows], beta[rows], g[rows], plain_pool, slots)
    o_piece = gdn_triton.gdn_prefill_pieces(q[piece], k[piece], v[piece], beta[piece], g[piece], plain_pool, pieces)
    buf = torch.full((73, *o_rows.shape[1:]), float("nan"), device=pool.device)
    gdn_triton.delta_rule_step_into(q[rows], k[rows], v[rows], beta[rows], g[rows], out_pool, slots, out=buf[rows])
    gdn_triton.gdn_prefill_pieces(q[piece], k[piece], v[piece], beta[piece], g[piece], out_pool, pieces, buf[piece])
    same_bits(buf, torch.cat((o_rows, o_piece)))
    same_bits(out_pool, plain_pool)
    table = KernelTable.build("cpu", Settings.from_env({}))  # on CPU: the twins, copied into `out`
    twin = torch.full_like(buf, float("nan"))
    got = table.gdn_prefill_pieces(q[piece], k[piece], v[piece], beta[piece], g[piece], pool.clone(), pieces, twin[piece])
    assert got.data_ptr() == twin[piece].data_ptr() and not torch.isnan(twin[piece]).any() and torch.isnan(twin[rows]).all()


@pytest.mark.parametrize("pos0", [0, 40])
def test_gdn_prefill_kernel_matches_twin_and_does_not_depend_on_the_piece(pos0):
    """The one-launch chunked delta rule against the reference's chunk loop (fp32 noise: a product
    replaces the triangular solve), and its own bits when the prompt comes in 64-aligned pieces."""
    from memra.kernels.triton import gdn as gdn_triton

    q, k, v, beta, g, s0 = _gdn_inputs(150)
    o, s = gdn_triton.gdn_prefill(q, k, v, beta, g, s0, pos0)
    o_ref, s_ref = reference.gdn_prefill(q, k, v, beta, g, s0, pos0)
    close(o, o_ref, torch.float32)
    close(s, s_ref, torch.float32)
    o_rec, s_rec = reference.gdn_recurrent(q, k, v, beta, g, s0)  # the definition, token by token
    close(o, o_rec, torch.float32)
    cut = 64 - pos0 % 64 + 64  # a hand-in boundary at an absolute multiple of 64
    o1, s1 = gdn_triton.gdn_prefill(q[:cut], k[:cut], v[:cut], beta[:cut], g[:cut], s0, pos0)
    o2, s2 = gdn_triton.gdn_prefill(q[cut:], k[cut:], v[cut:], beta[cut:], g[cut:], s1, pos0 + cut)
    same_bits(torch.cat((o1, o2)), o)
    same_bits(s2, s)


def test_kernel_compiles_are_counted_through_tritons_hook_after_any_hook_already_there():
    """memra.kernels.triton.common.count_compiles: Triton calls its post-compile hook once per kernel it
    compiles (or loads from its disk cache); memra's hook bumps `kernel_compiles` and then calls the hook
    that was there before it. On a GPU a real compile moves the counter (tests/test_triton_kernels.py)."""
    from memra import counters
    from memra.kernels.triton import common

    runtime = triton.knobs.runtime
    seen = []
    saved = runtime.jit_post_compile_hook
    try:
        runtime.jit_post_compile_hook = lambda **kw: seen.append(kw["key"])
        common.count_compiles()
        common.count_compiles()  # once is enough: a second call does not count twice
        before = counters.snapshot()
        runtime.jit_post_compile_hook(key="k", repr="r", fn=None, compile={}, is_manual_warmup=False, already_compiled=False)
        assert counters.delta(before)["kernel_compiles"] == 1 and seen == ["k"]
    finally:
        runtime.jit_post_compile_hook = saved


@triton.jit
def _one_store(x_ptr):
    tl.store(x_ptr, 1.0)


@pytest.mark.skipif(not DEVICE.startswith("cuda"), reason="Triton's interpreter compiles nothing")
def test_a_kernel_compile_moves_the_liveness_counter():
    """What memra:kernel_compiles_total counts: a kernel Triton compiles in this process (a fresh
    specialisation of a small kernel here: the element type of its pointer)."""
    from memra import counters

    before = counters.snapshot()
    _one_store[(1,)](torch.zeros(1, device=DEVICE, dtype=torch.float64))
    assert counters.delta(before)["kernel_compiles"] == 1
