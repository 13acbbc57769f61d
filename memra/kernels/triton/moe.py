"""The mixture-of-experts FFN as grouped matmuls (Triton): one launch per projection for every
(token, expert) pair of a call, planned on the device, with no host round trip.

The reference (reference.moe_experts) asks the host which experts were chosen and runs two linears per
expert: for a 256-expert layer that is up to 512 launches and a device sync per layer, which also makes
a MoE step impossible to capture in a CUDA graph. Here instead:

    plan      sort the T*k pairs by expert on the device; give each expert whole BLOCK_M tiles of its
              pairs; a tile table of static length (an upper bound) says, per tile, its expert and the
              span of sorted pairs it covers (empty spans for the unused tail). While the pairs are few
              beside the experts (a decode step of a few rows) a tile per pair instead: no sort and no
              table to build: a pair's tile, token and expert are read off its program id and ids
    gate_up   y1[p] = x[token(p)] @ w_gate_up[expert(p)]^T          one grid over (tile, N block)
    silu_mul  h = silu(gate) * up                                       triton.activation (torch's bits)
    down      y2[p] = h[p] @ w_down[expert(p)]^T                       one grid over (tile, N block)
    combine   out[t] = sum_j  weight[t, j] * y2[pair(t, j)]           each row's pairs in ascending
                                                                        expert id, rounded as it goes

Bits: a pair's product walks K exactly as triton.linear.linear does (same fp32 accumulator, same K
blocks, same MMA step), so it has the bits that kernel gives its row alone, whatever tile it shares
(the linear kernel's promise, re-checked by memra.kernels.exact's self-test). The combine adds a row's
weighted expert outputs in the reference's order with the reference's roundings (product rounded to
the dtype, then the running sum). So this path equals the per-expert loop run with the invariant
linear, bit for bit, and a row's result does not depend on which tokens share the call (promise E1).
tests/test_moe_kernel.py holds it to both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from memra.kernels.triton.activation import sigmoid_values, silu_mul, silu_mul_values
from memra.kernels.triton.common import _interpreting, round_to_dtype
from memra.kernels.triton.linear import _mma, linear_config, swiglu_tile


@triton.jit
def _grouped_linear_kernel(x_ptr, rows_ptr, w_ptr, y_ptr, tile_expert_ptr, tile_start_ptr, tile_stop_ptr,
                           N, K, stride_xm, stride_we, stride_wn, stride_ym,
                           GATHER: tl.constexpr, IEEE: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           PER_PAIR: tl.constexpr = False, TOP_K: tl.constexpr = 1,
                           SWIGLU: tl.constexpr = False, LIBDEVICE: tl.constexpr = False):
    # Program (tile, N block): BLOCK_M sorted pairs of one expert times BLOCK_N of its output rows.
    # PER_PAIR: tile p is pair p alone (token p // TOP_K, expert ids[p] at tile_expert_ptr): no table.
    # SWIGLU (MEMRA_MOE_FUSED_ACT): the expert's rows [0, N) are the gate's and [N, 2N) the up's; the
    # program sums both for its columns as the plain kernel sums each, and stores silu(gate) * up from the
    # two rounded products, as triton.linear's fused SwiGLU does: grouped_linear then silu_mul, in one launch.
    tile = tl.program_id(0)
    if PER_PAIR:
        start = tile
        stop = tile + 1
    else:
        start = tl.load(tile_start_ptr + tile)
        stop = tl.load(tile_stop_ptr + tile)
    if start < stop:  # the tile table's unused tail has empty spans
        expert = tl.load(tile_expert_ptr + tile).to(tl.int64)
        rp = start + tl.arange(0, BLOCK_M)  # positions in the expert-sorted pair list
        in_tile = rp < stop
        if GATHER and PER_PAIR:
            rx = rp // TOP_K
        elif GATHER:  # the pair's token row of x (gate_up reads x in token order)
            rx = tl.load(rows_ptr + rp, mask=in_tile, other=0)
        else:  # x is already in pair order (down reads h)
            rx = rp
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        w_base = w_ptr + expert * stride_we
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # SWIGLU only (otherwise never computed)
        for k0 in range(0, K, BLOCK_K):  # the linear kernel's K order: same bits per row
            kk = k0 + rk
            a = tl.load(x_ptr + rx[:, None] * stride_xm + kk[None, :], mask=in_tile[:, None] & (kk[None, :] < K), other=0.0)
            mask_w = (rn[None, :] < N) & (kk[:, None] < K)
            b = tl.load(w_base + rn[None, :] * stride_wn + kk[:, None], mask=mask_w, other=0.0)
            acc = _mma(a, b, acc, IEEE)
            if SWIGLU:
                b = tl.load(w_base + (N + rn)[None, :] * stride_wn + kk[:, None], mask=mask_w, other=0.0)
                up = _mma(a, b, up, IEEE)
        ty = y_ptr.dtype.element_ty
        if SWIGLU:
            y = silu_mul_values(acc.to(ty).to(tl.float32), up.to(ty).to(tl.float32), ty, LIBDEVICE)
        else:
            y = acc.to(ty)
        tl.store(y_ptr + rp[:, None] * stride_ym + rn[None, :], y, mask=in_tile[:, None] & (rn[None, :] < N))


@triton.jit
def _add_rounded(acc, x_ptr, at, mask, dt: tl.constexpr):
    """acc + x, both values of the dtype, as torch adds two tensors of it: in fp32, rounded once."""
    return round_to_dtype(acc + tl.load(x_ptr + at, mask=mask, other=0.0).to(tl.float32), dt)


@triton.jit
def _combine_kernel(y_ptr, pos_ptr, w_ptr, out_ptr, s_ptr, g_ptr, r_ptr, E, stride_g, TOP_K: tl.constexpr,
                    BLOCK: tl.constexpr,
                    PER_PAIR: tl.constexpr = False, SHARED: tl.constexpr = False, GATE: tl.constexpr = False,
                    RESIDUAL: tl.constexpr = False, LIBDEVICE: tl.constexpr = False):
    # Program (token, E block): the running sum of the token's weighted expert outputs, slot by slot in
    # ascending expert id, each product and each partial sum rounded to the dtype as torch rounds
    # `out += y * w` -- the reference's order and roundings. The sum is held in fp32 registers but only
    # ever holds values of the dtype. Launched with fp fusion off: in fp32 a multiply-add contracted
    # into one FMA rounds once where torch rounds twice (seen on the H200). SHARED, RESIDUAL: then
    # `out + shared` and `residual + out`, the MoE block's two adds, each rounded as torch's. GATE
    # (MEMRA_MOE_FUSED_GATE): the shared expert's output scaled by sigmoid(its gate logit, g_ptr[t * stride_g])
    # first, as torch's `torch.sigmoid(g) * shared` rounds: the sigmoid to the dtype, then the product.
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < E
    dt = out_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        if PER_PAIR:  # pairs in pair order
            p = (t * TOP_K + j).to(tl.int64)
        else:
            p = tl.load(pos_ptr + t * TOP_K + j).to(tl.int64)  # where pair (t, j) sits in sorted order
        y = tl.load(y_ptr + p * E + cols, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + t * TOP_K + j).to(tl.float32)
        acc = round_to_dtype(acc + round_to_dtype(y * w, dt), dt)
    if SHARED:
        if GATE:
            g = tl.load(g_ptr + t * stride_g + 0 * cols).to(tl.float32)  # [BLOCK], one value
            gate = sigmoid_values(g, dt, LIBDEVICE)
            shared = round_to_dtype(gate * tl.load(s_ptr + t * E + cols, mask=mask, other=0.0).to(tl.float32), dt)
            acc = round_to_dtype(acc + shared, dt)
        else:
            acc = _add_rounded(acc, s_ptr, t * E + cols, mask, dt)
    if RESIDUAL:
        acc = _add_rounded(acc, r_ptr, t * E + cols, mask, dt)
    tl.store(out_ptr + t * E + cols, acc.to(dt), mask=mask)


@triton.jit
def _route_kernel(p_ptr, w_ptr, ids_ptr, X, TOP_K: tl.constexpr, NORMALIZE: tl.constexpr, BLOCK: tl.constexpr):
    # Program t: token t's TOP_K experts by probability (the lower id first among equal ones), written
    # in ascending id -- the order the combine sums them in -- with their weights, renormalised over
    # the chosen where NORMALIZE, in the model dtype. One row per program: batch-invariant.
    t = tl.program_id(0)
    e = tl.arange(0, BLOCK)
    p = tl.load(p_ptr + t * X + e, mask=e < X, other=float("-inf"))
    left = p
    chosen = e < 0
    for _ in tl.static_range(TOP_K):
        pick = tl.min(tl.where(left == tl.max(left, axis=0), e, BLOCK), axis=0)
        chosen = chosen | (e == pick)
        left = tl.where(e == pick, float("-inf"), left)
    w = tl.where(chosen, p, 0.0)
    if NORMALIZE:
        w = w / tl.sum(w, axis=0)
    slot = tl.cumsum(chosen.to(tl.int32), axis=0) - 1
    tl.store(w_ptr + t * TOP_K + slot, w.to(w_ptr.dtype.element_ty), mask=chosen)
    tl.store(ids_ptr + t * TOP_K + slot, e.to(tl.int64), mask=chosen)


def moe_route(router_logits: torch.Tensor, top_k: int, normalize: bool, dtype: torch.dtype):
    """reference.moe_route's choice in two launches where it takes seven: torch's softmax (its bits),
    then the top k, their renormalisation and the ascending-id order moe_experts sums in, in one. The
    chosen experts are the reference's, but among exactly equal probabilities this takes the lower ids
    (torch.topk's choice there is unspecified); a weight may differ from the reference's in the last
    place, since the renormalising sum adds in another order. -> (weights [T, k], ids [T, k] ascending)."""
    probs = torch.softmax(router_logits.float(), dim=-1)  # [T, X]
    t_rows, n = probs.shape
    weights = torch.empty(t_rows, top_k, dtype=dtype, device=probs.device)
    ids = torch.empty(t_rows, top_k, dtype=torch.int64, device=probs.device)
    if t_rows:
        _route_kernel[(t_rows,)](probs, weights, ids, n, TOP_K=top_k, NORMALIZE=normalize,
                                 BLOCK=triton.next_power_of_2(n))
    return weights, ids


@dataclass(frozen=True)
class GroupPlan:
    """Where every (token, slot) pair goes, computed on the device. P = T * top_k pairs. A per-pair plan
    (`per_pair`) has no tables: pair p is tile p, in pair order, its expert ids[p] (tile_expert)."""

    pairs: int  # P
    top_k: int
    tile_expert: torch.Tensor  # [n_tiles] int64
    token_of: torch.Tensor | None  # [P] int64: the token row of the p-th pair in expert-sorted order
    sorted_pos: torch.Tensor | None  # [T * top_k] int64: where pair (t, j) sits in expert-sorted order
    tile_start: torch.Tensor | None  # [n_tiles] int64: first sorted pair of the tile
    tile_stop: torch.Tensor | None  # [n_tiles] int64: one past its last (== start for unused tiles)
    config: tuple[int, int, int, int, int]  # the kernels' (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)

    @property
    def per_pair(self) -> bool:
        return self.token_of is None


def plan_groups(ids: torch.Tensor, n_experts: int, config: tuple[int, int, int, int, int]) -> GroupPlan:
    """ids [T, k] (each row's experts in ascending order) -> the tile table.

    The table's length depends only on the shapes (at most ceil(P / BLOCK_M) full tiles plus one
    partial tile per expert that was chosen), so nothing is read back to the host."""
    t_rows, top_k = ids.shape
    block_m = config[0]
    flat = ids.reshape(-1)
    p = flat.numel()
    order = torch.sort(flat, stable=True).indices  # sorted position -> pair index t * k + j
    sorted_pos = torch.empty_like(order)
    sorted_pos[order] = torch.arange(p, device=ids.device)
    counts = torch.zeros(n_experts, dtype=torch.int64, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))
    ends = counts.cumsum(0)
    tiles = (counts + block_m - 1) // block_m
    tile_ends = tiles.cumsum(0)
    n_tiles = triton.cdiv(p, block_m) + min(n_experts, p)
    tile = torch.arange(n_tiles, device=ids.device)
    expert = torch.searchsorted(tile_ends, tile, right=True).clamp_max(n_experts - 1)
    start = ends[expert] - counts[expert] + (tile - (tile_ends[expert] - tiles[expert])) * block_m
    stop = torch.minimum(start + block_m, ends[expert])
    used = tile < tile_ends[-1]
    zero = torch.zeros_like(start)
    return GroupPlan(p, top_k, expert, order // top_k, sorted_pos, torch.where(used, start, zero),
                     torch.where(used, stop, zero), config)


def plan_pairs(ids: torch.Tensor, config: tuple[int, int, int, int, int]) -> GroupPlan:
    """ids [T, k] -> a plan with one tile per (token, slot) pair, in pair order (sorted position = pair
    index), and no launch to make it: the kernels read a pair's token and expert off its index. Same
    bits as plan_groups' plan, since a pair's product does not depend on the tile it shares; it reads an
    expert that several tokens chose once per token, which costs nothing at T = 1 (a token's experts
    are distinct) and little while pairs are few beside the experts."""
    t_rows, top_k = ids.shape
    return GroupPlan(t_rows * top_k, top_k, ids.reshape(-1), None, None, None, None, config)


def grouped_linear(x: torch.Tensor, w: torch.Tensor, plan: GroupPlan, gather: bool, swiglu: bool = False) -> torch.Tensor:
    """Pair p's row (x[token_of[p]] if gather, else x[p]) times its expert's w[e] [N, K]^T -> [P, N]; swiglu:
    w[e] [2F, K] gate rows then up rows -> silu(gate) * up [P, F], with the bits of this call then silu_mul (a
    program's columns are half the tile's, as triton.linear.linear_silu_mul's: the same bytes a K step)."""
    w = w if w.stride(-1) == 1 else w.contiguous()
    x = x if x.stride(-1) == 1 else x.contiguous()
    p, n, k = plan.pairs, w.shape[1] // (2 if swiglu else 1), w.shape[2]
    y = torch.empty(p, n, dtype=x.dtype, device=x.device)
    if p:
        bm, bn, bk, warps, stages = plan.config
        if swiglu:
            bn, stages = swiglu_tile(bm, bn, bk, x.element_size(), stages)
        table = (plan.tile_expert,) * 3 if plan.per_pair else (plan.token_of, plan.tile_start, plan.tile_stop)  # unread
        _grouped_linear_kernel[(plan.tile_expert.numel(), triton.cdiv(n, bn))](
            x, table[0], w, y, plan.tile_expert, table[1], table[2],
            n, k, x.stride(0), w.stride(0), w.stride(1), y.stride(0),
            GATHER=gather, IEEE=x.dtype == torch.float32 or _interpreting(),
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, PER_PAIR=plan.per_pair, TOP_K=plan.top_k,
            SWIGLU=swiglu, LIBDEVICE=swiglu and not _interpreting(), num_warps=warps, num_stages=stages)
    return y


def tile_config(pairs: int, n_experts: int, elem_bytes: int) -> tuple[int, int, int, int, int]:
    """The linear kernel's tile for the mean rows per chosen expert. Which tile runs changes speed,
    not bits: every linear tile walks K in the same order (triton.linear.LINEAR_BUCKETS)."""
    return linear_config(max(1, pairs // max(1, min(n_experts, pairs))), elem_bytes)


def moe_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w_gate_up: torch.Tensor,
                w_down: torch.Tensor, per_pair: bool | None = None, shared: torch.Tensor | None = None,
                residual: torch.Tensor | None = None, ascending: bool = False, act=None,
                fused_act: bool = False, shared_gate: torch.Tensor | None = None) -> torch.Tensor:
    """reference.moe_experts' meaning and bits, in four launches and no sync.
    x [T, E], weights/ids [T, k], w_gate_up [X, 2F, E], w_down [X, E, F] -> [T, E]. per_pair: a tile per
    (token, slot) pair (plan_pairs) instead of per expert; by default while T * k <= X / 4. shared,
    residual [T, E]: residual + (that + shared) in the combine, with the bits of torch's two adds.
    ascending: each row's ids are in ascending order already (moe_route's), so no sort. act: the experts'
    activation in place of silu_mul (Step's clamped SwiGLU: torch's elementwise ops over every pair at once,
    the bits they give each expert's rows alone, since an elementwise op on a GPU is a function of its element).
    fused_act (MEMRA_MOE_FUSED_ACT): SwiGLU's activation in the gate/up launch, one launch fewer a layer.
    shared_gate [T, 1] (MEMRA_MOE_FUSED_GATE; with shared): the shared expert's gate logits, `shared` scaled by
    their sigmoid in the combine with the bits of torch's `torch.sigmoid(shared_gate) * shared`, two launches
    fewer a layer."""
    t_rows, top_k = ids.shape
    e = x.shape[-1]
    if not ascending:
        ids, perm = ids.sort(dim=1)  # each row's slots in ascending expert id: the reference's summation order
        weights = weights.gather(1, perm).contiguous()
    n_experts = w_gate_up.shape[0]
    config = tile_config(t_rows * top_k, n_experts, x.element_size())
    if per_pair is None:
        per_pair = 4 * t_rows * top_k <= n_experts
    plan = plan_pairs(ids, config) if per_pair else plan_groups(ids, n_experts, config)
    if fused_act and act is None:  # MEMRA_MOE_FUSED_ACT: the activation in the gate/up launch's epilogue
        h = grouped_linear(x, w_gate_up, plan, gather=True, swiglu=True)  # [P, F], torch's bits
    else:
        h = (act or silu_mul)(grouped_linear(x, w_gate_up, plan, gather=True))
    y = grouped_linear(h, w_down, plan, gather=False)  # [P, E], expert-sorted
    out = torch.empty_like(x)
    if t_rows:
        block = min(1024, triton.next_power_of_2(e))
        pos = plan.tile_expert if plan.per_pair else plan.sorted_pos  # unread per pair
        s, r = (v if v is None or v.is_contiguous() else v.contiguous() for v in (shared, residual))
        g = shared_gate  # [T, 1], any row stride (a column of MEMRA_MOE_FRONT's one product)
        gate = s is not None and g is not None
        _combine_kernel[(t_rows, triton.cdiv(e, block))](y, pos, weights, out, s if s is not None else out,
                                                          g if gate else out, r if r is not None else out, e,
                                                          g.stride(0) if gate else 0, TOP_K=top_k, BLOCK=block,
                                                          PER_PAIR=plan.per_pair, SHARED=s is not None, GATE=gate,
                                                          RESIDUAL=r is not None,
                                                          LIBDEVICE=gate and not _interpreting(),
                                                          enable_fp_fusion=False)
    return out
