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
    import os

    return os.environ.get("TRITON_INTERPRET", "0") == "1"


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
def _row_norm_kernel(x_ptr, w_ptr, y_ptr, D, eps, MODE: tl.constexpr, BLOCK: tl.constexpr):
    # One program per row, the whole row in one tile: the sum is one tree of fixed shape.
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    x = tl.load(x_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
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


def _row_norm(x: torch.Tensor, w: torch.Tensor | None, eps: float, mode: int, out_dtype: torch.dtype) -> torch.Tensor:
    d = x.shape[-1]
    x2 = x.reshape(-1, d).contiguous()
    y = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    if x2.shape[0]:
        _row_norm_kernel[(x2.shape[0],)](x2, w if w is not None else x2, y, d, eps, MODE=mode,
                                         BLOCK=triton.next_power_of_2(d))
    return y.reshape(x.shape)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, zero_centered: bool) -> torch.Tensor:
    return _row_norm(x, w, eps, RMS_ZERO_CENTRED if zero_centered else RMS_LLAMA, x.dtype)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return _row_norm(x.float(), None, eps, L2, torch.float32)


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


@triton.jit
def _decode_attention_kernel(q_ptr, k_ptr, v_ptr, rows_ptr, starts_ptr, lens_ptr, o_ptr, Hq, scale,
                             GROUP: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                             BLOCK_S: tl.constexpr):
    # One program per (query row, head). Query row r attends over its own prefix: positions 0..S-1 whose
    # flat KV-pool rows sit at rows[start : start + S] (start, S read from memory, so one launch serves
    # B sequences of decode or the T columns of a verify, and no length is a compile-time value). The
    # prefix is visited in position order, BLOCK_S positions a step, with an online softmax in fp32 —
    # the same order whatever the batch, so a row's bits are its own.
    r = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // GROUP
    start = tl.load(starts_ptr + r)
    S = tl.load(lens_ptr + r)
    cd = tl.arange(0, BLOCK_D)
    md = cd < D
    q = tl.load(q_ptr + (r * Hq + h) * D + cd, mask=md, other=0.0).to(tl.float32)
    m_run = tl.full((), float("-inf"), tl.float32)
    l_run = tl.zeros((), tl.float32)
    acc = tl.zeros((BLOCK_D,), tl.float32)
    for s0 in range(0, S, BLOCK_S):
        ps = s0 + tl.arange(0, BLOCK_S)
        ms = ps < S
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
    tl.store(o_ptr + (r * Hq + h) * D + cd, (acc / l_run).to(o_ptr.dtype.element_ty), mask=md)


def paged_attention_rows(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, rows: torch.Tensor,
                         starts: torch.Tensor, lens: torch.Tensor, scale: float) -> torch.Tensor:
    """R query rows, each over its own paged prefix, in one launch. q [R, Hq, D]; k/v_pool
    [n_blocks, BLOCK, Hkv, D]; rows [N] flat pool rows; row r's prefix is rows[starts[r] : starts[r] +
    lens[r]] in position order (its own K/V already written, last). -> [R, Hq, D]."""
    n, hq, d = q.shape
    hkv = k_pool.shape[-2]
    o = torch.empty_like(q)
    if n:
        _decode_attention_kernel[(n, hq)](q.contiguous(), k_pool, v_pool, rows.contiguous(), starts.contiguous(),
                                          lens.contiguous(), o, hq, scale, GROUP=hq // hkv, HKV=hkv, D=d,
                                          BLOCK_D=triton.next_power_of_2(d), BLOCK_S=ATTN_BLOCK_S)
    return o


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, rows: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """One new query per head over a paged prefix. q [Hq, D]; k/v_pool [n_blocks, BLOCK, Hkv, D];
    rows [S] flat pool rows of positions 0..S-1 (the new token's K/V already written). -> [Hq, D].
    The multi-row kernel with one row, so B=1 decode, batched decode and the verify share its code."""
    zero = torch.zeros(1, dtype=torch.long, device=q.device)
    lens = torch.full((1,), rows.numel(), dtype=torch.long, device=q.device)
    return paged_attention_rows(q[None], k_pool, v_pool, rows, zero, lens, scale)[0]
