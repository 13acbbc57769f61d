"""The dense linear at large M as one persistent kernel (MEMRA_LINEAR_PERSISTENT), with the bucket kernel's bits.

triton.linear launches one program per output tile, each loading its tiles through pointer arithmetic:
at M >= 256 that reaches about half of the bf16 matmul peak on Hopper. The kernel here is the classic
way past that: a grid of one program per SM, each walking output tiles in a fixed grouped order (GROUP_M
row-tiles across all column-tiles, so a group's weight columns stay in L2 while its rows pass), its
operands read through tensor descriptors (TMA on sm_90) and multiplied with wgmma, one large tile.

What fixes a row's bits is unchanged (triton.linear's module notes): the K products of an output tile are
summed from k = 0 upward, BLOCK_K at a time, into one fp32 accumulator, with no split-K. M changes only how
many tiles there are and which program computes which, never how one tile reduces; so every row equals
triton.linear's row, which the self-test (memra.kernels.exact, with the door on) re-checks on the running
GPU across the buckets and this kernel, refusing the stacked plan on a mismatch. The epilogues are the
bucket kernel's, step for step: bias, the residual add (fp32, rounded once), and SwiGLU (gate and up
each rounded to the dtype, then silu_mul_values).

Routing (`linear`, `linear_silu_mul`, the names the kernel table calls when the door is on): calls of more
than PERSISTENT_ABOVE rows whose operands a tensor descriptor can describe (16-byte aligned base and row
strides) take this kernel; everything else takes triton.linear unchanged. Under TRITON_INTERPRET (CI's CPU
runs, which support tensor descriptors) the kernel runs with LINEAR_INTERPRET_CONFIG's tile, the one the
bucket kernel uses there, because numpy's dot sums in an order set by the tile shape.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.runtime import _allocation  # Triton's record of the allocator (install_scratch reads it)

from memra.kernels.triton import linear as bucket
from memra.kernels.triton.common import _interpreting
from memra.kernels.triton.launch import lean
from memra.kernels.triton.linear import _epilogue, _mma

# Calls of more rows than this take the persistent kernel (triton.linear's two buckets above 256 rows).
PERSISTENT_ABOVE = 256
# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, GROUP_M, FLATTEN, EPILOGUE_SPLIT): one tile for every M, the best of
# tools/gpu_tune_linear.py --quick's candidates on an H100 (1.30x the bucket kernel's layer time at M=1024 and
# M=4096, 72-80% of the bf16 peak there); docs/PERFORMANCE.md has the table.
# SwiGLU halves BLOCK_N (a gate and an up tile a K step: the plain tile's bytes and accumulator registers);
# fit_shared_memory trims a variant's stages (the residual's) or width (fp32's) to what a block may use.
PERSISTENT_CONFIG = (128, 256, 64, 8, 3, 8, False, 2)
SHARED_MEMORY_LIMIT = 227 * 1024  # bytes sm_90 gives a block (H100, H200): its pipeline and its epilogue's tiles
INTERPRET_PROGRAMS = 3  # programs under the interpreter: fewer than its tiles, so each program walks several


@triton.jit
def _tile_of(tile, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """Output tile number -> (row tile, column tile), GROUP_M row tiles at a time across every column tile."""
    in_group = GROUP_M * tiles_n
    first_m = (tile // in_group) * GROUP_M
    group_m = tl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (tile % in_group) % group_m, (tile % in_group) // group_m


@triton.jit
def _halves(t, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """[BM, BN] -> its column halves [BM, BN/2] (the left, the right)."""
    return tl.split(tl.permute(tl.reshape(t, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))


@lean
@triton.jit(do_not_specialize=["M"])
def _linear_persistent_kernel(x_ptr, w_ptr, b_ptr, r_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_rm, stride_ym,
                              programs, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, IEEE: tl.constexpr,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                              GROUP_M: tl.constexpr, FLATTEN: tl.constexpr, EPILOGUE_SPLIT: tl.constexpr,
                              SWIGLU: tl.constexpr = False, LIBDEVICE: tl.constexpr = False):
    # x [M, K], w [N, K] (SWIGLU: [2N, K], gate rows then up rows), y [M, N]. The descriptors zero-fill
    # reads past M, N and K, as the bucket kernel's masks do, and clip the store. EPILOGUE_SPLIT (1 or 2):
    # the epilogue in column halves, so the stored block (and the residual's) takes half the shared memory.
    x_desc = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[stride_xm, 1], block_shape=[BLOCK_M, BLOCK_K])
    g_desc = tl.make_tensor_descriptor(w_ptr, shape=[N, K], strides=[stride_wn, 1], block_shape=[BLOCK_N, BLOCK_K])
    u_desc = g_desc
    if SWIGLU:
        u_desc = tl.make_tensor_descriptor(w_ptr + N * stride_wn, shape=[N, K], strides=[stride_wn, 1],
                                           block_shape=[BLOCK_N, BLOCK_K])
    y_desc = tl.make_tensor_descriptor(y_ptr, shape=[M, N], strides=[stride_ym, 1],
                                       block_shape=[BLOCK_M, BLOCK_N // EPILOGUE_SPLIT])
    ty = y_ptr.dtype.element_ty
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    k_steps = tl.cdiv(K, BLOCK_K)
    start = tl.program_id(0)
    done = start - programs  # the tile the epilogue stores, counted apart (what lets FLATTEN fuse the loops)
    for tile in tl.range(start, tiles_m * tiles_n, programs, flatten=FLATTEN):
        tm, tn = _tile_of(tile, tiles_m, tiles_n, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # SWIGLU only (otherwise never computed)
        for ks in range(k_steps):  # K from 0 upward, as triton.linear walks it: the bits
            a = x_desc.load([tm * BLOCK_M, ks * BLOCK_K])
            acc = _mma(a, g_desc.load([tn * BLOCK_N, ks * BLOCK_K]).T, acc, IEEE)
            if SWIGLU:
                up = _mma(a, u_desc.load([tn * BLOCK_N, ks * BLOCK_K]).T, up, IEEE)
        done += programs
        tm, tn = _tile_of(done, tiles_m, tiles_n, GROUP_M)
        rm = tm * BLOCK_M + tl.arange(0, BLOCK_M)
        if EPILOGUE_SPLIT == 1:
            rn = tn * BLOCK_N + tl.arange(0, BLOCK_N)
            y = _epilogue(acc, up, b_ptr, r_ptr, rm, rn, M, N, stride_rm, ty, HAS_BIAS, HAS_RESIDUAL, SWIGLU, LIBDEVICE)
            y_desc.store([tm * BLOCK_M, tn * BLOCK_N], y)
        else:
            a0, a1 = _halves(acc, BLOCK_M, BLOCK_N)
            u0, u1 = a0, a1
            if SWIGLU:
                u0, u1 = _halves(up, BLOCK_M, BLOCK_N)
            rn = tn * BLOCK_N + tl.arange(0, BLOCK_N // 2)
            y = _epilogue(a0, u0, b_ptr, r_ptr, rm, rn, M, N, stride_rm, ty, HAS_BIAS, HAS_RESIDUAL, SWIGLU, LIBDEVICE)
            y_desc.store([tm * BLOCK_M, tn * BLOCK_N], y)
            y = _epilogue(a1, u1, b_ptr, r_ptr, rm, rn + BLOCK_N // 2, M, N, stride_rm, ty, HAS_BIAS, HAS_RESIDUAL,
                        SWIGLU, LIBDEVICE)
            y_desc.store([tm * BLOCK_M, tn * BLOCK_N + BLOCK_N // 2], y)


def _scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """Global memory for the descriptors a program builds (128 bytes each), in torch's caching allocator
    (inside a CUDA graph capture: the graph's pool)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def install_scratch() -> None:
    """Give Triton the allocator the kernel's device-side descriptors need, in this thread's context.
    triton.set_allocator sets a ContextVar, which a new thread (the engine's, the server's) does not
    inherit: so the table installs it at load and each launch re-installs it where it is missing."""
    if _allocation._allocator.get() is not _scratch:
        triton.set_allocator(_scratch)


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _programs(x: torch.Tensor, tiles: int) -> int:
    """One program per SM (fewer where there are fewer tiles); which program takes a tile never changes its bits."""
    sms = _sm_count(x.device.index if x.device.index is not None else torch.cuda.current_device()) if x.is_cuda \
        else INTERPRET_PROGRAMS
    return max(1, min(sms, tiles))


def persistent_config(elem_bytes: int = 2) -> tuple[int, int, int, int, int, int, bool, int]:
    """The kernel's (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, GROUP_M, FLATTEN, EPILOGUE_SPLIT): under the interpreter the
    bucket kernel's tile (its numpy dot's order follows the tile), else PERSISTENT_CONFIG."""
    if _interpreting():
        bm, bn, bk, warps, stages = bucket.LINEAR_INTERPRET_CONFIG
        return bm, bn, bk, warps, stages, 2, False, 1
    return PERSISTENT_CONFIG


@functools.cache  # a launch's variant is one of a handful: decided once, looked up after
def fit_shared_memory(config: tuple, elem_bytes: int, residual: bool, swiglu: bool) -> tuple:
    """`config` for one variant on the GPU: SwiGLU's halves take half the columns each; then the epilogue in
    column halves, fewer stages, narrower tiles, in that order, until the pipelined operand tiles and the
    epilogue's (the stored block, and the residual's beside it) fit in what sm_90 gives a block. None of
    these moves a bit."""
    bm, bn, bk, warps, stages, group, flatten, split = config
    weight_tiles = 2 if swiglu else 1
    if swiglu:
        bn = max(16, bn // 2)

    def need(bn: int, stages: int, split: int) -> int:
        epilogue = bm * (bn // split) * (2 if residual else 1)
        return (stages * (bm + weight_tiles * bn) * bk + epilogue) * elem_bytes + 1024

    if need(bn, stages, split) > SHARED_MEMORY_LIMIT and bn >= 32:
        split = 2
    while need(bn, stages, split) > SHARED_MEMORY_LIMIT and stages > 2:
        stages -= 1
    while need(bn, stages, split) > SHARED_MEMORY_LIMIT and bn > 32:
        bn //= 2
    return bm, bn, bk, warps, stages, group, flatten, split


def describable(*tensors: torch.Tensor) -> bool:
    """Can a tensor descriptor (TMA) read these [rows, cols] tensors? 16-byte aligned base and row stride,
    unit column stride."""
    return all(t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0
               for t in tensors)


def persistent_linear(x2: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
                      residual: torch.Tensor | None = None, swiglu: bool = False,
                      config: tuple | None = None) -> torch.Tensor:
    """x2 [M, K] @ w[N, K]^T (+ b) (+ residual [M, N]) -> [M, N] through the persistent kernel, whatever M
    (the tests and tools/gpu_tune_linear.py call it directly; `linear` routes). swiglu: w [2F, K] gate|up
    rows -> silu(gate) * up [M, F]. `config` overrides persistent_config() (the tuning tool's candidates)."""
    m, k = x2.shape
    n = w.shape[0] // 2 if swiglu else w.shape[0]
    y = torch.empty(m, n, dtype=x2.dtype, device=x2.device)
    if not m:
        return y
    config = config or persistent_config(x2.element_size())
    if not _interpreting():  # (the interpreter keeps its one tile: its dot's order follows the tile)
        config = fit_shared_memory(config, x2.element_size(), residual is not None, swiglu)
    bm, bn, bk, warps, stages, group, flatten, split = config
    r = residual if residual is not None else y
    if x2.is_cuda:
        install_scratch()
    programs = _programs(x2, triton.cdiv(m, bm) * triton.cdiv(n, bn))
    _linear_persistent_kernel[(programs,)](
        x2, w, b if b is not None else w, r, y, m, n, k, x2.stride(0), w.stride(0), r.stride(0), y.stride(0), programs,
        HAS_BIAS=b is not None, HAS_RESIDUAL=residual is not None, IEEE=x2.dtype == torch.float32 or _interpreting(),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group, FLATTEN=flatten, EPILOGUE_SPLIT=split, SWIGLU=swiglu,
        LIBDEVICE=not _interpreting(), num_warps=warps, num_stages=stages)
    return y


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
           residual: torch.Tensor | None = None, tile=None) -> torch.Tensor:
    """triton.linear.linear's contract and bits; more than PERSISTENT_ABOVE rows through the persistent kernel.
    tile: None (the frozen tiles), or (m, n, k, persistent) -> the call's tile (triton.linear_shaped's choice)."""
    lead, x2, w = bucket._operands(x, w)
    m, n, k = x2.shape[0], w.shape[0], x2.shape[1]
    r = residual.reshape(m, n) if residual is not None else None
    if r is not None and r.stride(-1) != 1:
        r = r.contiguous()
    if m <= PERSISTENT_ABOVE or not describable(x2, w) or (n * x.element_size()) % 16:
        return bucket.linear(x, w, b, residual, config=tile and tile(m, n, k, False))
    return persistent_linear(x2, w, b, r, config=tile and tile(m, n, k, True)).reshape(*lead, n)


def linear_silu_mul(x: torch.Tensor, w: torch.Tensor, tile=None) -> torch.Tensor:
    """triton.linear.linear_silu_mul's contract and bits; more than PERSISTENT_ABOVE rows through the persistent
    kernel. tile: as `linear`'s, asked with n = 2F (a program's gate and up tiles together)."""
    lead, x2, w = bucket._operands(x, w)
    m, f, k = x2.shape[0], w.shape[0] // 2, x2.shape[1]
    if m <= PERSISTENT_ABOVE or not describable(x2, w, w[f:]) or (f * x.element_size()) % 16:
        return bucket.linear_silu_mul(x, w, config=tile and tile(m, 2 * f, k, False))
    return persistent_linear(x2, w, swiglu=True, config=tile and tile(m, 2 * f, k, True)).reshape(*lead, f)
