"""Batch-invariant GPU kernels (Triton): a row's result never depends on how many rows share the call.

cuBLAS and torch's reductions choose their algorithm from the shape of the call (GEMV for one row,
split-K for few rows, a different tree for a different row count), so the same row gets different
bits at B=1 and B=64. The kernels here freeze every choice instead: one tile configuration for all M,
a K loop in one fixed order, one program per row for reductions, positions visited in order. Row i
of the output is then computed by exactly the same instructions whatever M is, which is what makes a
stacked decode of B sequences bit-identical to each sequence decoded alone (promise E1).

Each kernel has its meaning in memra.kernels.reference; tests/test_triton_kernels.py holds every
kernel to its twin (to a stated tolerance: the summation order differs, deliberately) and to its own
output across row counts (bit for bit). The kernels also run under TRITON_INTERPRET=1 on CPU, which
is how CI checks them without a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# The frozen configurations. Changing any of these changes bits (never across batch sizes, but
# across memra versions), so they are constants rather than autotuned.
#
# The linear kernel's tiles are chosen per bucket of M, because one tile cannot serve both a B=1
# decode (a GEMV: it wants narrow M and many programs to stream the weight) and a 4096-token prefill
# (a GEMM: it wants 128x256 tiles). What fixes a row's bits is not the tile but the order in which its
# K products are summed: every configuration walks K in the same order with the same fp32 accumulator
# and the same MMA step (k = 16) -- measured on the H200 (tools/gpu_tune_linear.py: every candidate
# tile gives the reference tile's bits at every M on every model shape). Because that is a fact of the
# hardware rather than a promise of the compiler, the self-test (memra.kernels.exact) re-checks rows
# across the buckets on the running GPU, and a failure refuses the stacked plan.
LINEAR_BUCKETS = (  # (largest M of the bucket, (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages))
    (16, (16, 16, 256, 2, 4)),  # decode: a GEMV, as fast as cuBLAS's on the 8B/9B projections at M=1
    (64, (64, 32, 128, 4, 4)),
    (128, (64, 128, 128, 4, 4)),
    (512, (128, 128, 64, 8, 4)),
    (None, (128, 256, 64, 8, 3)),  # prefill: ~530 TFLOP/s at M=4096
)
# Under TRITON_INTERPRET (CI's CPU runs) the dot is numpy's, whose summation order follows the tile
# shape, so there one tile serves every M.
LINEAR_INTERPRET_CONFIG = (64, 32, 64, 4, 4)
ATTN_BLOCK_S = 16  # KV positions per step of the decode-attention loop (= the KV page size)
GDN_BLOCK_DV = 32  # value columns of the delta-rule state handled by one program


def _interpreting() -> bool:
    from memra.settings import process_env

    return process_env().get("TRITON_INTERPRET", "0") == "1"  # Triton's own switch (tests on CPU)


@triton.jit
def round_to_bf16(w):
    """fp32 -> the nearest bf16 value (ties to even), still held in fp32, for finite values; NaN stays NaN.
    Bit arithmetic rather than a cast, because a cast does not round to nearest everywhere these kernels
    run (Triton's interpreter truncates), and the kernels that use this promise torch's bits."""
    bits = w.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return tl.where(w != w, w, rounded.to(tl.float32, bitcast=True))


# --- linear ------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["M"])
def _linear_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                   HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # M is not specialised: an M == 1 call must compile to the same instructions as M == 64.
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        a = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        b = tl.load(w_ptr + rn[None, :] * stride_wn + kk[:, None], mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)
        if IEEE:  # fp32 models: no silent TF32 (and the interpreter, whose bf16 dot is broken, via fp32)
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


SHARED_MEMORY_BUDGET = 200 * 1024  # bytes of pipelined tiles per program (the H200 allows 227 KiB)


def linear_config(m: int, elem_bytes: int = 2) -> tuple[int, int, int, int, int]:
    """The tile configuration for an M-row call: its bucket's (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages).
    fp32 tiles are twice the bytes, so the pipeline gets fewer stages where they would not fit in
    shared memory (stages only overlap loads with math; they do not change the K order or the bits)."""
    if _interpreting():
        return LINEAR_INTERPRET_CONFIG
    bm, bn, bk, warps, stages = next(cfg for top, cfg in LINEAR_BUCKETS if top is None or m <= top)
    while stages > 2 and (bm + bn) * bk * elem_bytes * stages > SHARED_MEMORY_BUDGET:
        stages -= 1
    return bm, bn, bk, warps, stages


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ w[N, K]^T (+ b) -> [..., N] in x's dtype; fp32 accumulation, M-invariant."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    m, n = x2.shape[0], w.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        bm, bn, bk, warps, stages = linear_config(m, x.element_size())
        _linear_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
            x2, w, b if b is not None else w, y, m, n, k, x2.stride(0), w.stride(0), y.stride(0),
            HAS_BIAS=b is not None, IEEE=x.dtype == torch.float32 or _interpreting(),
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
    return y.reshape(*lead, n)


# --- row norms -----------------------------------------------------------------------------------

RMS_ZERO_CENTRED, RMS_LLAMA, L2 = 0, 1, 2


@triton.jit
def _row_norm_kernel(x_ptr, w_ptr, y_ptr, r_ptr, s_ptr, D, eps, MODE: tl.constexpr, RESIDUAL: tl.constexpr,
                     BLOCK: tl.constexpr):
    # One program per row, the whole row in one tile: the sum is one tree of fixed shape.
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    x = tl.load(x_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
    if RESIDUAL:  # x + r rounded to the dtype as torch's add rounds it, stored, then normalised
        x = x + tl.load(r_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
        s_ty = s_ptr.dtype.element_ty
        x = round_to_bf16(x) if s_ty == tl.bfloat16 else x.to(s_ty).to(tl.float32)
        tl.store(s_ptr + row * D + cols, x.to(s_ty), mask=mask)
    ss = tl.sum(x * x, axis=0)
    if MODE == 2:  # l2: x / sqrt(sum + eps), fp32 out
        tl.store(y_ptr + row * D + cols, x * (1.0 / tl.sqrt(ss + eps)), mask=mask)
    else:
        xn = x * (1.0 / tl.sqrt(ss / D + eps))
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        out_ty = y_ptr.dtype.element_ty
        if MODE == 0:  # zero-centred style: multiply in fp32, round last
            tl.store(y_ptr + row * D + cols, (xn * w).to(out_ty), mask=mask)
        else:  # llama style: round the normalised row, multiply in the model dtype
            y = w.to(out_ty).to(tl.float32) * xn.to(out_ty).to(tl.float32)
            tl.store(y_ptr + row * D + cols, y.to(out_ty), mask=mask)


def _row_norm(x: torch.Tensor, w: torch.Tensor | None, eps: float, mode: int, out_dtype: torch.dtype,
              residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    d = x.shape[-1]
    x2 = x.reshape(-1, d).contiguous()
    y = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    r2 = residual.reshape(-1, d).contiguous() if residual is not None else None
    s = torch.empty_like(x2) if residual is not None else None
    if x2.shape[0]:
        _row_norm_kernel[(x2.shape[0],)](x2, w if w is not None else x2, y, r2 if r2 is not None else x2,
                                         s if s is not None else x2, d, eps, MODE=mode, RESIDUAL=residual is not None,
                                         BLOCK=triton.next_power_of_2(d))
    return y.reshape(x.shape), (s.reshape(x.shape) if s is not None else None)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, zero_centered: bool) -> torch.Tensor:
    return _row_norm(x, w, eps, RMS_ZERO_CENTRED if zero_centered else RMS_LLAMA, x.dtype)[0]


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor, w: torch.Tensor, eps: float,
                 zero_centered: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, rms_norm(h + delta)) in one pass over the row: the residual add and the next
    pre-norm of a block, which otherwise write the sum and read it straight back. Same code as
    rms_norm on the rounded sum, so the same bits as the two ops apart."""
    y, s = _row_norm(h, w, eps, RMS_ZERO_CENTRED if zero_centered else RMS_LLAMA, h.dtype, residual=delta)
    return s, y


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return _row_norm(x.float(), None, eps, L2, torch.float32)[0]


@triton.jit
def _gated_rms_norm_kernel(o_ptr, z_ptr, w_ptr, y_ptr, D, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    o = tl.load(o_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    out_ty = y_ptr.dtype.element_ty
    on = o * (1.0 / tl.sqrt(tl.sum(o * o, axis=0) / D + eps))
    y = (w.to(out_ty).to(tl.float32) * on.to(out_ty).to(tl.float32)).to(out_ty).to(tl.float32)
    tl.store(y_ptr + row * D + cols, (y * (z / (1.0 + tl.exp(-z)))).to(out_ty), mask=mask)


def gated_rms_norm(o: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    d = o.shape[-1]
    o2, z2 = o.reshape(-1, d).contiguous(), z.reshape(-1, d).contiguous()
    y = torch.empty(z2.shape, dtype=z.dtype, device=z.device)
    if o2.shape[0]:
        _gated_rms_norm_kernel[(o2.shape[0],)](o2, z2, w, y, d, eps, BLOCK=triton.next_power_of_2(d))
    return y.reshape(z.shape)


# --- rotary embedding -----------------------------------------------------------------------------


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, y_ptr, H, stride_xt, stride_xh, D, R, HALF: tl.constexpr,
                 BLOCK_D: tl.constexpr):
    # One program per (token, head). The reference's five elementwise kernels (neg, cat, two muls, add)
    # in one, rounding to the model dtype after each product and after the sum as the reference does.
    # Measured on the H200 this is within one rounding of the reference, not always its bits (it is
    # elementwise, so a value's bits never depend on the batch either way; both the exact and the fast
    # path use it, so prefill, decode and verify agree). fp32 goes to the reference in ops.
    t = tl.program_id(0) // H
    h = tl.program_id(0) % H
    c = tl.arange(0, BLOCK_D)
    base = x_ptr + t * stride_xt + h * stride_xh
    x = tl.load(base + c, mask=c < D, other=0.0)
    in_rot = c < R
    partner = tl.where(c < HALF, c + HALF, c - HALF)
    xp = tl.load(base + partner, mask=in_rot, other=0.0).to(tl.float32)
    rotated = tl.where(c < HALF, -xp, xp)
    cos = tl.load(cos_ptr + t * R + c, mask=in_rot, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + t * R + c, mask=in_rot, other=0.0).to(tl.float32)
    ty = y_ptr.dtype.element_ty
    a = (x.to(tl.float32) * cos).to(ty)
    b = (rotated * sin).to(ty)
    y = tl.where(in_rot, (a.to(tl.float32) + b.to(tl.float32)).to(ty), x)
    tl.store(y_ptr + (t * H + h) * D + c, y, mask=c < D)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Same contract as reference.apply_rope: x [T, H, D] (any strides over T and H), cos/sin [T, R]
    -> [T, H, D] contiguous, the first R channels of each head rotated NeoX style."""
    t, h, d = x.shape
    r = cos.shape[-1]
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty((t, h, d), dtype=x.dtype, device=x.device)
    if t * h:
        _rope_kernel[(t * h,)](x, cos.contiguous(), sin.contiguous(), y, h, x.stride(0), x.stride(1), d, r,
                               HALF=r // 2, BLOCK_D=triton.next_power_of_2(d))
    return y


# --- Gated DeltaNet recurrent step ---------------------------------------------------------------


@triton.jit(do_not_specialize=["T"])
def _delta_rule_scan_kernel(q_ptr, k_ptr, v_ptr, beta_ptr, g_ptr, s_ptr, o_ptr, s_out_ptr, T, H, DK, DV,
                            BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr):
    # One program per (sequence x head, block of value columns): those columns of the state evolve
    # independently of every other column, head and sequence. The program walks its T tokens in order
    # with the state in registers and writes the state after every token (s_out [n, T, H, DK, DV]).
    # Decode calls it with T=1 per row, the verify with T tokens of one sequence: T is a runtime value
    # (not specialised, not even for 1), so both run the same machine code and a token's step has the
    # same bits either way (between calls the fp32 state round-trips through memory exactly).
    r = tl.program_id(0)  # sequence * H + head
    n, h = r // H, r % H
    cv = tl.program_id(1) * BLOCK_DV + tl.arange(0, BLOCK_DV)
    ck = tl.arange(0, BLOCK_DK)
    mk, mv = ck < DK, cv < DV
    m2 = mk[:, None] & mv[None, :]
    s = tl.load(s_ptr + r * DK * DV + ck[:, None] * DV + cv[None, :], mask=m2, other=0.0)  # [DK, BDV]
    for t in range(T):
        row = (n * T + t) * H + h  # token t of sequence n, head h
        k = tl.load(k_ptr + row * DK + ck, mask=mk, other=0.0)
        q = tl.load(q_ptr + row * DK + ck, mask=mk, other=0.0)
        v = tl.load(v_ptr + row * DV + cv, mask=mv, other=0.0)
        s = s * tl.exp(tl.load(g_ptr + row))
        predicted = tl.sum(s * k[:, None], axis=0)  # S^T k  [BDV]
        delta = (v - predicted) * tl.load(beta_ptr + row)
        s = s + k[:, None] * delta[None, :]
        tl.store(o_ptr + row * DV + cv, tl.sum(s * q[:, None], axis=0), mask=mv)
        tl.store(s_out_ptr + row * DK * DV + ck[:, None] * DV + cv[None, :], s, mask=m2)


def delta_rule_scan(q, k, v, beta, g, s):
    """n sequences x T tokens of the delta rule, in order. q, k [n, T, H, DK], v [n, T, H, DV],
    beta, g [n, T, H], s [n, H, DK, DV] (fp32) -> (o [n, T, H, DV], state after each token
    [n, T, H, DK, DV]). Same contract as reference.delta_rule_scan."""
    n, t, h, dk = q.shape
    dv = v.shape[-1]
    args = [x.contiguous().float() for x in (q, k, v, beta, g)]
    s_in = s.reshape(n * h, dk, dv).contiguous()
    o = torch.empty(n, t, h, dv, dtype=torch.float32, device=q.device)
    s_out = torch.empty(n, t, h, dk, dv, dtype=torch.float32, device=q.device)
    if n * t * h:
        grid = (n * h, triton.cdiv(dv, GDN_BLOCK_DV))
        _delta_rule_scan_kernel[grid](*args, s_in, o, s_out, t, h, dk, dv,
                                      BLOCK_DK=triton.next_power_of_2(dk), BLOCK_DV=GDN_BLOCK_DV)
    return o, s_out


def delta_rule_step(q, k, v, beta, g, s):
    """Same contract as reference.delta_rule_step (fp32 throughout): one token for each row of the
    leading dims — the scan kernel with T = 1, so decode and the verify share its code."""
    dk, dv = q.shape[-1], v.shape[-1]
    lead = q.shape[:-1]
    rows = q.numel() // dk
    o, s_out = delta_rule_scan(q.reshape(rows, 1, 1, dk), k.reshape(rows, 1, 1, dk), v.reshape(rows, 1, 1, dv),
                               beta.reshape(rows, 1, 1), g.reshape(rows, 1, 1), s.reshape(rows, 1, dk, dv))
    return o.reshape(*lead, dv), s_out.reshape(*lead, dk, dv)


# --- decode attention over a paged KV prefix ------------------------------------------------------


ATTN_SPLIT = 1024  # positions per split of a long prefix (a multiple of ATTN_BLOCK_S)


@triton.jit
def _decode_attention_kernel(q_ptr, k_ptr, v_ptr, rows_ptr, starts_ptr, lens_ptr, o_ptr, m_ptr, l_ptr, Hq, scale,
                             GROUP: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                             BLOCK_S: tl.constexpr, SPLIT: tl.constexpr, PARTIAL: tl.constexpr):
    # One program per (query row, head, split). Query row r attends over its own prefix: positions
    # 0..S-1 whose flat KV-pool rows sit at rows[start : start + S] (start, S read from memory, so one
    # launch serves B sequences of decode or the T columns of a verify, and no length is a compile-time
    # value). Split p covers the positions [p * SPLIT, (p + 1) * SPLIT): fixed by absolute position,
    # visited in order, BLOCK_S a step, with an online softmax in fp32 -- the same order whatever the
    # batch, so a row's bits are its own. PARTIAL: write this split's (max, sum, unnormalised output)
    # for _combine_splits_kernel; otherwise (one split covers every row) write the output itself.
    r = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.program_id(2)
    kvh = h // GROUP
    start = tl.load(starts_ptr + r)
    S = tl.load(lens_ptr + r)
    cd = tl.arange(0, BLOCK_D)
    md = cd < D
    q = tl.load(q_ptr + (r * Hq + h) * D + cd, mask=md, other=0.0).to(tl.float32)
    m_run = tl.full((), float("-inf"), tl.float32)
    l_run = tl.zeros((), tl.float32)
    acc = tl.zeros((BLOCK_D,), tl.float32)
    hi = tl.minimum(S, (sp + 1) * SPLIT)
    for s0 in range(sp * SPLIT, hi, BLOCK_S):  # empty for a split past the row's prefix
        ps = s0 + tl.arange(0, BLOCK_S)
        ms = ps < hi
        rows = tl.load(rows_ptr + start + ps, mask=ms, other=0)
        base = (rows * HKV + kvh) * D
        kt = tl.load(k_ptr + base[:, None] + cd[None, :], mask=ms[:, None] & md[None, :], other=0.0).to(tl.float32)
        scores = tl.sum(kt * q[None, :], axis=1) * scale
        scores = tl.where(ms, scores, float("-inf"))
        m_new = tl.maximum(m_run, tl.max(scores, axis=0))
        alpha = tl.exp(m_run - m_new)
        p = tl.exp(scores - m_new)
        vt = tl.load(v_ptr + base[:, None] + cd[None, :], mask=ms[:, None] & md[None, :], other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * vt, axis=0)
        l_run = l_run * alpha + tl.sum(p, axis=0)
        m_run = m_new
    if PARTIAL:
        at = (r * Hq + h) * tl.num_programs(2) + sp
        tl.store(m_ptr + at, m_run)
        tl.store(l_ptr + at, l_run)
        tl.store(o_ptr + at * D + cd, acc, mask=md)
    else:
        tl.store(o_ptr + (r * Hq + h) * D + cd, (acc / l_run).to(o_ptr.dtype.element_ty), mask=md)


@triton.jit
def _combine_splits_kernel(m_ptr, l_ptr, part_ptr, o_ptr, Hq, N_SPLITS: tl.constexpr, D: tl.constexpr,
                           BLOCK_D: tl.constexpr):
    # Program (row, head): the splits' partial softmaxes merged in split order. A row whose prefix fits
    # in split 0 gets exactly the unsplit kernel's bits: its weight is exp(0) = 1, the empty splits'
    # are exp(-inf) = 0 with zero partials, so sum and output pass through unchanged. That is what lets
    # the split be chosen per call (from the longest row) without changing any row's bits.
    r = tl.program_id(0)
    h = tl.program_id(1)
    cd = tl.arange(0, BLOCK_D)
    md = cd < D
    base = (r * Hq + h) * N_SPLITS
    m_all = tl.full((), float("-inf"), tl.float32)
    for sp in tl.static_range(N_SPLITS):
        m_all = tl.maximum(m_all, tl.load(m_ptr + base + sp))
    l_all = tl.zeros((), tl.float32)
    acc = tl.zeros((BLOCK_D,), tl.float32)
    for sp in tl.static_range(N_SPLITS):
        w = tl.exp(tl.load(m_ptr + base + sp) - m_all)
        l_all = l_all + tl.load(l_ptr + base + sp) * w
        acc = acc + tl.load(part_ptr + (base + sp) * D + cd, mask=md, other=0.0) * w
    tl.store(o_ptr + (r * Hq + h) * D + cd, (acc / l_all).to(o_ptr.dtype.element_ty), mask=md)


def paged_attention_rows(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, rows: torch.Tensor,
                         starts: torch.Tensor, lens: torch.Tensor, scale: float, max_len: int | None = None) -> torch.Tensor:
    """R query rows, each over its own paged prefix, in one launch (two for long prefixes). q [R, Hq, D];
    k/v_pool [n_blocks, BLOCK, Hkv, D]; rows [N] flat pool rows; row r's prefix is rows[starts[r] :
    starts[r] + lens[r]] in position order (its own K/V already written, last). max_len: a bound on
    every lens[r] known to the caller (default N). -> [R, Hq, D].

    Prefixes longer than ATTN_SPLIT are split at fixed positions over more programs (a B=1 decode at
    32k context would otherwise stream its prefix through just Hq programs); a row's bits depend only
    on its own prefix either way (see _combine_splits_kernel)."""
    n, hq, d = q.shape
    hkv = k_pool.shape[-2]
    o = torch.empty_like(q)
    if not n:
        return o
    n_splits = triton.cdiv(max_len if max_len is not None else rows.numel(), ATTN_SPLIT)
    q, rows, starts, lens = q.contiguous(), rows.contiguous(), starts.contiguous(), lens.contiguous()
    shape = dict(GROUP=hq // hkv, HKV=hkv, D=d, BLOCK_D=triton.next_power_of_2(d), BLOCK_S=ATTN_BLOCK_S, SPLIT=ATTN_SPLIT)
    if n_splits <= 1:
        _decode_attention_kernel[(n, hq, 1)](q, k_pool, v_pool, rows, starts, lens, o, o, o, hq, scale, PARTIAL=False, **shape)
        return o
    m = torch.empty(n, hq, n_splits, dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    part = torch.empty(n, hq, n_splits, d, dtype=torch.float32, device=q.device)
    _decode_attention_kernel[(n, hq, n_splits)](q, k_pool, v_pool, rows, starts, lens, part, m, l, hq, scale,
                                                PARTIAL=True, **shape)
    _combine_splits_kernel[(n, hq)](m, l, part, o, hq, N_SPLITS=n_splits, D=d, BLOCK_D=triton.next_power_of_2(d))
    return o


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, rows: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """One new query per head over a paged prefix. q [Hq, D]; k/v_pool [n_blocks, BLOCK, Hkv, D];
    rows [S] flat pool rows of positions 0..S-1 (the new token's K/V already written). -> [Hq, D].
    The multi-row kernel with one row, so B=1 decode, batched decode and the verify share its code."""
    zero = torch.zeros(1, dtype=torch.long, device=q.device)
    lens = torch.full((1,), rows.numel(), dtype=torch.long, device=q.device)
    return paged_attention_rows(q[None], k_pool, v_pool, rows, zero, lens, scale)[0]


# --- prefill attention over a paged KV prefix ------------------------------------------------------

PREFILL_BLOCK_M, PREFILL_BLOCK_N, PREFILL_WARPS, PREFILL_STAGES = 64, 64, 4, 2


@triton.jit(do_not_specialize=["T", "pos0"])
def _prefill_attention_kernel(q_ptr, k_ptr, v_ptr, rows_ptr, o_ptr, T, pos0, Hq, qk_scale,
                              GROUP: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                              IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # Program (BLOCK_M queries, head): flash attention with the keys visited in blocks of BLOCK_N from
    # position 0, whatever the queries. A query's bits cannot depend on the piece it came in or on the
    # tile it shares: its scores and its P @ V are per-row MMA results, the blocks it sees are fixed
    # by absolute position, and the blocks past its own position (there for its tile-mates) are fully
    # masked, which leaves its running max, sum and output untouched (alpha = 1, p = 0).
    mb = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // GROUP
    rm = mb * BLOCK_M + tl.arange(0, BLOCK_M)  # query index in the piece
    cd = tl.arange(0, BLOCK_D)
    md = cd < D
    q = tl.load(q_ptr + (rm[:, None] * Hq + h) * D + cd[None, :], mask=(rm[:, None] < T) & md[None, :], other=0.0)
    q_pos = pos0 + rm
    m_run = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_run = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    hi = tl.minimum(pos0 + (mb + 1) * BLOCK_M, pos0 + T)  # keys this tile's last query sees
    for n0 in range(0, hi, BLOCK_N):
        pn = n0 + tl.arange(0, BLOCK_N)
        mn = pn < hi
        rows = tl.load(rows_ptr + pn, mask=mn, other=0)
        base = (rows * HKV + kvh) * D
        kt = tl.load(k_ptr + base[None, :] + cd[:, None], mask=mn[None, :] & md[:, None], other=0.0)  # [D, N]
        if IEEE:  # fp32 models, and the interpreter (whose 16-bit dot is broken)
            s = tl.dot(q.to(tl.float32), kt.to(tl.float32), input_precision="ieee")
        else:
            s = tl.dot(q, kt)
        s = tl.where((pn[None, :] <= q_pos[:, None]) & mn[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_run, tl.max(s, axis=1))
        alpha = tl.exp2(m_run - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_run = l_run * alpha + tl.sum(p, axis=1)
        vt = tl.load(v_ptr + base[:, None] + cd[None, :], mask=mn[:, None] & md[None, :], other=0.0)  # [N, D]
        if IEEE:
            pv = tl.dot(p, vt.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(vt.dtype), vt)
        acc = acc * alpha[:, None] + pv
        m_run = m_new
    out = acc / l_run[:, None]
    tl.store(o_ptr + (rm[:, None] * Hq + h) * D + cd[None, :], out.to(o_ptr.dtype.element_ty),
             mask=(rm[:, None] < T) & md[None, :])


def prefill_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, rows: torch.Tensor, pos0: int,
                      scale: float) -> torch.Tensor:
    """T new queries of one sequence at positions pos0.. over its paged prefix (causal). q [T, Hq, D];
    k/v_pool [n_blocks, BLOCK, Hkv, D]; rows [pos0 + T] flat pool rows in position order (the new
    tokens' K/V already written). -> [T, Hq, D]. A query's bits do not depend on T or pos0's piece."""
    t, hq, d = q.shape
    hkv = k_pool.shape[-2]
    o = torch.empty_like(q)
    if t:
        _prefill_attention_kernel[(triton.cdiv(t, PREFILL_BLOCK_M), hq)](
            q.contiguous(), k_pool, v_pool, rows.contiguous(), o, t, pos0, hq, scale * 1.4426950408889634,
            GROUP=hq // hkv, HKV=hkv, D=d, BLOCK_D=triton.next_power_of_2(d),
            IEEE=q.dtype == torch.float32 or _interpreting(), BLOCK_M=PREFILL_BLOCK_M, BLOCK_N=PREFILL_BLOCK_N,
            num_warps=PREFILL_WARPS, num_stages=PREFILL_STAGES)
    return o
