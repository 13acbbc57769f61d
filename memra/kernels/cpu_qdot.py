"""Packed GGUF linears on CPU as integer block dot products: memra/kernels/cpu/qdot.cpp, built at first use.

Decode on CPU is bound by reading weights, and the tiled twin (quant.tiled_linear) reads each weight
twice over: it widens a tile into an fp32 buffer (4 bytes a value, written and read again) and then hands
it to BLAS. This kernel reads the split layouts' bytes once: each activation row is quantized to int8
per block (llama.cpp's q8_0 / q8_K), each output is integer dot products of int8 with the weight's
quants, widened in registers, then one fixed sequence of fp32 steps (memra.kernels.qdot_reference, its
pure-torch twin, defines them bit for bit). Threads split the output rows only, so an output's bits
depend on its activation row and weight row alone: never on the batch, the chunking or the thread count.

Why this and not the alternatives (docs/PERFORMANCE.md, one [8192, 1536] weight on a 2-core AMD EPYC):
torch's `_weight_int8pack_mm` has one scale per output channel, not per block, so GGUF's blocks do not
map onto it, and it was slower (495 us with bf16 activations against 373 for Q8_0 here); inductor's C++
(torch.compile of a dequant dot) ran 25x slower, compiles per shape and picks its reduction split from
the shape. This C file compiles in seconds, needs no torch headers, and its reductions are written out.

The build: the system C++ compiler (g++, c++ or clang++ on PATH) writes a shared library under
~/.cache/memra/ once per source, compiler and flags; a process loads it with ctypes. AVX2 and F16C are
checked at run time (a scalar loop of the same arithmetic otherwise), and AVX-512 VNNI (cpu/qdot_vnni.cpp:
rows one after another, one stream from memory; the same bits). With no compiler, or a build
that fails, `library()` says so in one line and the table keeps the tiled twin.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import weakref
from pathlib import Path

import torch

from memra.kernels import split

# the library's sources: the linears here, decode attention (memra.kernels.cpu_decode) and the row-invariant
# fp32 linear (memra.kernels.cpu_flin) beside them
SOURCES = tuple(Path(__file__).parent / "cpu" / name
                for name in ("qdot.cpp", "qdot_vnni.cpp", "decode.cpp", "layer.cpp", "flin.cpp"))
FLAGS = ("-O3", "-std=c++17", "-fPIC", "-shared", "-fopenmp", "-ffp-contract=off")  # no implicit FMA (flin.cpp: explicit)
COMPILERS = ("g++", "c++", "clang++")
KINDS = (split.Q8Split, split.Q4KSplit, split.Q5KSplit, split.Q6KSplit)

_i64, _int, _p = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
_SIGNATURES = {
    "memra_qdot_has_avx2": ([], _int),
    "memra_qdot_outputs": ([_int], _i64),
    "memra_quantize_rows": ([_p, _i64, _i64, _i64, _p, _p, _p], None),
    "memra_qdot_q8_0": ([_p, _p, _i64, _i64, _p, _p, _i64, _p, _i64, _int, _int], None),
    "memra_qdot_qk": ([_int, _p, _p, _p, _p, _p, _i64, _i64, _p, _p, _p, _i64, _p, _i64, _int, _int], None),
    "memra_qdot_q6k": ([_p, _p, _p, _p, _i64, _i64, _p, _p, _i64, _p, _i64, _int, _int], None),
    "memra_attend_rows": ([_p, _i64, _i64, _i64, _i64, _p, _p, _p, _p, _i64, _p, _p, _p, _p, _p, _p, _i64,
                           ctypes.c_float, _p, _int, _int], None),
    "memra_rms_rows": ([_p, _p, _p, _p, _i64, _i64, ctypes.c_float, _p, _int], None),
    "memra_silu_mul_rows": ([_p, _i64, _i64, _p, _int], None),
    "memra_gdn_heads_rows": ([_p, _i64, _i64, _i64, _i64, _i64, ctypes.c_float, ctypes.c_float, _p, _p, _int], None),
    "memra_delta_rows": ([_p, _p, _p, _p, _p, _p, _p, _i64, _i64, _i64, _i64, _p, _int], None),
    "memra_delta_scan": ([_p, _p, _p, _p, _p, _p, _i64, _i64, _i64, _i64, _p, _p, _int], None),
    "memra_flin_level": ([], _int),
    "memra_flin_outputs": ([_int], _i64),
    "memra_flin": ([_p, _i64, _p, _p, _i64, _i64, _i64, _p, _i64, _int, _int], None),
    "memra_decode_layer": ([_p, _p, _p, _p, _i64, _p, _p, _p, _p, _i64, _int, _int], None),
}


def _cache_dir() -> Path:
    return Path.home() / ".cache" / "memra"


def _build(compiler: str, out: Path) -> None:
    """Compile SOURCES to `out`, atomically (a temporary beside it, then a rename: concurrent builds are safe)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".so.partial")
    os.close(fd)
    try:
        subprocess.run([compiler, *FLAGS, *map(str, SOURCES), "-o", tmp], check=True, capture_output=True, text=True, timeout=300)
        os.replace(tmp, out)
    finally:
        Path(tmp).unlink(missing_ok=True)


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built kernel library, or None (after one line on stderr saying why) where it cannot be built."""
    compiler = next((c for c in COMPILERS if shutil.which(c)), None)
    if compiler is None:
        _notice("no C++ compiler (g++, c++ or clang++) on PATH")
        return None
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30, check=True).stdout
        key = hashlib.sha256("\0".join((*(s.read_text() for s in SOURCES), version, *FLAGS)).encode()).hexdigest()[:16]
        path = _cache_dir() / f"qdot-{key}.so"
        if not path.exists():
            _build(compiler, path)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", None) or str(e)
        _notice(f"building {', '.join(s.name for s in SOURCES)} with {compiler} failed: {(detail.strip().splitlines() or ['?'])[-1][:200]}")
        return None
    for name, (args, res) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    lib.avx2 = int(lib.memra_qdot_has_avx2())
    return lib


def _notice(why: str) -> None:
    print(f"memra: the CPU's C kernels are off (packed linears run the tiled twin, the decode path torch's ops; "
          f"slower): {why}", file=sys.stderr)


def supports(w) -> bool:
    """Can the kernel multiply by w? (a Q8_0 / Q4_K / Q5_K / Q6_K split layout, or row blocks of them)"""
    parts = w.parts if isinstance(w, split.SplitRows) else (w,)
    return all(isinstance(p, KINDS) for p in parts)


def _ptr(t: torch.Tensor) -> int:
    assert t.is_contiguous() and t.device.type == "cpu"
    return t.data_ptr()


def quantize_rows(x: torch.Tensor, block: int):
    """x fp32 [M, K] contiguous -> (q int8 [M, K], d fp32 [M, K / block], sums int32 [M, K / 16]):
    qdot_reference.quantize_rows, in C."""
    lib = library()
    m, k = x.shape
    q, d = torch.empty(m, k, dtype=torch.int8), torch.empty(m, k // block)
    sums = torch.empty(m, k // 16, dtype=torch.int32)
    lib.memra_quantize_rows(_ptr(x), m, k, block, _ptr(q), _ptr(d), _ptr(sums))
    return q, d, sums


_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _plan(lib, w) -> tuple:
    """(C function, activation block, the weight's leading arguments) of a split layout, made once per
    weight: a decode step calls ~4 linears a layer, and rebuilding these costs more than a small kernel."""
    plan = _PLANS.get(w)
    if plan is None:
        n, k = w.shape
        if isinstance(w, split.Q8Split):
            plan = (lib.memra_qdot_q8_0, 32, (_ptr(w.q), _ptr(w.d), n, k), False)
        elif isinstance(w, split.Q6KSplit):
            plan = (lib.memra_qdot_q6k, 256, (_ptr(w.ql), _ptr(w.qh), _ptr(w.d), _ptr(w.scale), n, k), False)
        else:
            bits, quants = (4, w.qs) if isinstance(w, split.Q4KSplit) else (5, w.q)
            plan = (lib.memra_qdot_qk, 256, (bits, _ptr(quants), _ptr(w.d), _ptr(w.dmin), _ptr(w.scale),
                                             _ptr(w.mins), n, k), True)
        _PLANS[w] = plan
    return plan


def linear(x: torch.Tensor, w, bias: torch.Tensor | None = None, avx2: int | None = None) -> torch.Tensor:
    """x [..., K] @ w^T (+ bias) -> [..., N] in x's dtype: qdot_reference.linear's bits. `avx2` caps the
    instruction level (0 / False: the scalar loops, 1: AVX2, 2: AVX-512 VNNI; None: the CPU's best), for
    the tests between them."""
    lib = library()
    n, k = w.shape
    x2 = x.reshape(-1, k).float().contiguous()  # [M, K]
    m = x2.shape[0]
    out = torch.empty(m, n)
    use_avx2 = lib.avx2 if avx2 is None else min(int(avx2), lib.avx2)
    threads = torch.get_num_threads()
    acts = {}
    col = 0
    for part in (w.parts if isinstance(w, split.SplitRows) else (w,)):
        fn, block, weight_args, sums = _plan(lib, part)
        if block not in acts:
            acts[block] = quantize_rows(x2, block)
        q, d, xs = acts[block]
        act_args = (q.data_ptr(), d.data_ptr(), xs.data_ptr()) if sums else (q.data_ptr(), d.data_ptr())
        # out's columns col.. (row stride n): this part's outputs
        fn(*weight_args, *act_args, m, out.data_ptr() + 4 * col, n, threads, use_avx2)
        col += part.shape[0]
    if bias is not None:
        out = out + bias.float()
    return out.reshape(*x.shape[:-1], n).to(x.dtype)
