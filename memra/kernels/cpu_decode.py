"""The fp32 ops of a CPU step besides the linears, in C: memra/kernels/cpu/decode.cpp (built with the
linears' library, memra.kernels.cpu_qdot), behind MEMRA_CPU_DECODE. RMSNorm and SwiGLU's activation over
rows (any row count: prompts and decode steps share them), and decode attention in one call per layer.

The torch form of a decode step's attention (reference.paged_decode_attention) gathers the prefix's K/V
out of the pool, repeats each KV head over its query heads (GQA), and runs a matmul, a softmax and a
matmul, with RoPE and the K/V write as five more ops before it: on a 300M Qwen3 shape that was ~10 small
ops a layer whose launch costs outweigh their bytes. The kernel does all of it in one call for every row
and head: RoPE of q and k (torch's bits), the K/V write, and attention read in place from the pool (GQA
by indexing), in the fixed order its twin (memra.kernels.decode_reference) defines, threads splitting
(row, head) pairs only, so a row's bits depend on its own query and prefix alone.
"""

from __future__ import annotations

import torch

from memra.kernels import cpu_qdot

MAX_HEAD_DIM = 1024  # the kernel's stack buffer for a rotated query


def supports(q: torch.Tensor, k_pool: torch.Tensor, cos: torch.Tensor | None) -> bool:
    """Can the kernel run this layer? fp32 everywhere on CPU, a head size that is a multiple of 8 (its eight
    lanes), query heads a multiple of the KV heads, a rotary width that fits the head."""
    d = q.shape[-1]
    return (q.dtype == k_pool.dtype == torch.float32 and q.device.type == "cpu" and d % 8 == 0 and d <= MAX_HEAD_DIM
            and q.shape[-2] % k_pool.shape[-2] == 0 and (cos is None or (cos.dtype == torch.float32
                                                                          and cos.shape[-1] % 2 == 0
                                                                          and cos.shape[-1] <= d)))


def rows_ok(x: torch.Tensor) -> bool:
    """Can the row-wise kernels (rms_rows, silu_mul_rows) take x? fp32 on CPU, rows a multiple of 8 wide."""
    return x.dtype == torch.float32 and x.device.type == "cpu" and x.shape[-1] % 8 == 0 and x.numel() > 0


def _ptr(t: torch.Tensor | None) -> int | None:
    if t is None:
        return None
    assert t.is_contiguous() and t.device.type == "cpu", "cpu_decode: a non-contiguous or non-CPU operand"
    return t.data_ptr()


def attend_rows(q: torch.Tensor, k_new: torch.Tensor | None, v_new: torch.Tensor | None, cos: torch.Tensor | None,
                sin: torch.Tensor | None, k_pool: torch.Tensor, v_pool: torch.Tensor, write_rows: torch.Tensor | None,
                read_rows: torch.Tensor, starts: torch.Tensor | None, lens: torch.Tensor | None, scale: float,
                avx2: bool | None = None) -> torch.Tensor:
    """q [R, Hq, D]; k_new / v_new [R, Hkv, D] (unrotated) written to the pool rows write_rows [R] after k's
    RoPE (None: nothing to write, a layer reading an earlier layer's KV); cos / sin [R, Rd] (None: q is
    already rotated). Each row attends over read_rows[starts[r] : starts[r] + lens[r]] (starts / lens None:
    one row over all of read_rows). -> [R, Hq, D]: decode_reference.attend_rows' bits. `avx2=False` runs
    the scalar loops (for the test between the two)."""
    lib = cpu_qdot.library()
    r, hq, d = q.shape
    hkv = k_pool.shape[-2]
    q = q.contiguous()
    if k_new is not None:
        k_new, v_new = k_new.contiguous(), v_new.contiguous()
    if cos is not None:
        cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty(r, hq, d)
    use_avx2 = lib.avx2 if avx2 is None else int(avx2 and lib.avx2)
    lib.memra_attend_rows(q.data_ptr(), r, hq, hkv, d, _ptr(k_new), _ptr(v_new), _ptr(cos), _ptr(sin),
                          0 if cos is None else cos.shape[-1], _ptr(k_pool), _ptr(v_pool), _ptr(write_rows),
                          _ptr(read_rows), _ptr(starts), _ptr(lens), read_rows.numel(), scale, out.data_ptr(),
                          torch.get_num_threads(), use_avx2)
    return out


def rms_rows(x: torch.Tensor, w: torch.Tensor, eps: float, add: torch.Tensor | None = None,
             avx2: bool | None = None):
    """RMSNorm over x's last dim (decode_reference.rms_rows' bits) -> y; with `add`, (x + add, its norm)."""
    lib = cpu_qdot.library()
    n = x.shape[-1]
    x = x.contiguous()
    y = torch.empty(x.shape)
    total = None
    if add is not None:
        add, total = add.contiguous(), torch.empty(x.shape)
    use_avx2 = lib.avx2 if avx2 is None else int(avx2 and lib.avx2)
    lib.memra_rms_rows(x.data_ptr(), _ptr(add), _ptr(total), _ptr(w.contiguous()), x.numel() // n, n, eps,
                       y.data_ptr(), use_avx2)
    return y if add is None else (total, y)


def silu_mul_rows(gate_up: torch.Tensor, avx2: bool | None = None) -> torch.Tensor:
    """[..., 2F] (gate | up) -> [..., F]: decode_reference.silu_mul's bits."""
    lib = cpu_qdot.library()
    f = gate_up.shape[-1] // 2
    gate_up = gate_up.contiguous()
    y = torch.empty(*gate_up.shape[:-1], f)
    use_avx2 = lib.avx2 if avx2 is None else int(avx2 and lib.avx2)
    lib.memra_silu_mul_rows(gate_up.data_ptr(), gate_up.numel() // (2 * f), f, y.data_ptr(), use_avx2)
    return y
