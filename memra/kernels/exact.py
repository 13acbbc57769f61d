"""What the exact path relies on, checked on the running platform (and what it deliberately avoids).

Results change with the batch because kernels pick a reduction order from the shape of the call. The
exact path therefore never lets the batch or the chunking choose a shape (memra/step.py): a decode row
runs with exactly its B=1 shapes, and prefill runs as forwards cut at absolute multiples of TILE. What
remains to rely on is determinism — the same call on the same inputs gives the same bits — and that is
what `require_exact` verifies before the first exact step on each (device, dtype), failing closed.

`self_test` also probes the shortcuts a stacked batch would need, so their status on this platform is
on record (the gate prints it): whether a row's matmul bits survive other rows in a fixed TILE-row
tile, whether row reductions match, and whether elementwise ops give a value the same bits at any
offset in a tensor. Measured on our CPU: tiles are row-invariant, but softplus / sigmoid / SiLU are not
offset-invariant (vectorized body vs scalar tail) — which is why rows are not simply stacked.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from memra.errors import MemraError
from memra.kernels import quant, reference
from memra.kernels.cuts import TILE
from memra.kernels.table import linear_module, triton_ops


class ExactnessError(MemraError):
    """This platform breaks an invariance the exact path relies on."""


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def _check(name: str, a: torch.Tensor, b: torch.Tensor, failures: list[str]) -> None:
    if not torch.equal(_bits(a), _bits(b)):
        failures.append(name)


@torch.inference_mode()
def self_test(dtype: torch.dtype, device: torch.device | str, shapes: tuple[tuple[int, int], ...] = ((256, 64), (640, 256)),
              linear_family: str = "bucket") -> list[str]:
    """Check, on this device and dtype, every invariance the exact plans rely on. Returns failed checks.
    linear_family (KernelTable.linear_family): the dense linears as the model runs them ('persistent': the
    persistent kernel above 256 rows; 'shaped': with triton.linear_shaped's tiles) are what the Triton probes
    hold to each other."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=gen).to(device=device, dtype=dtype)
    failures: list[str] = []
    for n_out, k in shapes:
        w = rnd(n_out, k)
        row = rnd(1, k)
        alone = F.linear(row, w)
        # determinism, which the exact path relies on: repeated identical calls give identical bits
        _check(f"linear[1x{k}] repeat", F.linear(row.clone(), w), alone, failures)
        block = rnd(TILE, k)
        _check(f"linear[{TILE}x{k}] repeat", F.linear(block.clone(), w), F.linear(block, w), failures)
        _check(f"softmax[{TILE}x{k}] repeat", torch.softmax(block.float().clone(), -1), torch.softmax(block.float(), -1), failures)
        # tile plan: the row's bits at every position of a TILE tile, neighbours random or zero
        in_tile = F.linear(torch.cat((row, torch.zeros(TILE - 1, k, device=device, dtype=dtype))), w)[0:1]
        for pos in (0, 1, 7, 31, TILE - 1):
            tile = rnd(TILE, k)
            tile[pos] = row[0]
            _check(f"linear[{TILE}x{k}] row {pos}", F.linear(tile, w)[pos : pos + 1], in_tile, failures)
        # row reductions used per group (norms, softmax) at every position of a tile
        x = rnd(TILE, k)
        ref_norm = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True))
        ref_soft = torch.softmax(x.float(), -1)
        for pos in (0, 5, TILE - 1):
            _check(f"row norm [{TILE}x{k}] row {pos} vs alone", torch.rsqrt(x[pos:pos + 1].float().pow(2).mean(-1, keepdim=True)), ref_norm[pos:pos + 1], failures)
            _check(f"row softmax [{TILE}x{k}] row {pos} vs alone", torch.softmax(x[pos:pos + 1].float(), -1), ref_soft[pos:pos + 1], failures)
    # elementwise transcendental ops: a value's result must not depend on its offset in the tensor
    v = rnd(1, 37).float()
    for name, fn in (("exp", torch.exp), ("sigmoid", torch.sigmoid), ("silu", F.silu), ("softplus", F.softplus),
                     ("rsqrt", lambda t: torch.rsqrt(t.abs() + 1)), ("cos", torch.cos), ("sin", torch.sin),
                     ("gelu_tanh", lambda t: F.gelu(t, approximate="tanh")), ("tanh", torch.tanh)):  # Gemma
        alone = fn(v)
        for lead in (1, 3, 8, 13, 64):
            padded = torch.cat((rnd(1, lead).float(), v), dim=1)
            _check(f"{name} at offset {lead}", fn(padded)[:, lead:], alone, failures)
    if torch.device(device).type == "cuda":
        _triton_probes(rnd, failures, linear_family)
    return failures


def _triton_probes(rnd, failures: list[str], linear_family: str = "bucket") -> None:
    """The batch-invariant kernels' promise, probed at the model's kind of shapes: a row's bits in
    calls of 1..TILE rows, and a row alone vs inside a full tile. Named 'triton ...' so the decode
    plan can refuse stacking on exactly these failures. With the persistent family the 600-row calls (and
    the 300-row ones) run the persistent kernel, so its rows are held to every bucket's; with the shaped family
    the [1024 x 4096] weight takes its other tiles (64x64 at 100 rows, 128x128 at 300 and 600)."""
    tk = triton_ops()
    if tk is None:
        return
    # routes as the table does (Triton is present); 'cublas' runs the bucket kernel up to 64 rows and has its cuBLAS
    # rows held at load to that kernel's on the model's own shapes (triton.linear_cublas.hold_rows)
    linear_triton = linear_module("bucket" if linear_family == "cublas" else linear_family)
    tk = types.SimpleNamespace(**{**vars(tk), "linear": linear_triton.linear})
    persistent_linear = linear_family in ("persistent", "shaped")

    wide = 600  # beyond the largest M bucket, so every bucket's tile is held to the same rows
    for n_out, k in ((256, 64), (640, 256), (1024, 4096)):
        w, x, nw = rnd(n_out, k), rnd(wide, k), rnd(k).float().abs() + 0.5
        full, full_norm = tk.linear(x, w), tk.rms_norm(x[:TILE], nw, 1e-6, True)
        for m in (1, 2, 7, 20, 33, TILE, 100, 300):  # one or more M in each bucket (triton.linear.LINEAR_BUCKETS)
            _check(f"triton linear[{m}x{k}] vs rows of [{wide}x{k}]", tk.linear(x[:m].clone(), w), full[:m], failures)
        _check(f"triton linear[{k}] row 5 alone", tk.linear(x[5:6].clone(), w), full[5:6], failures)
        _check(f"triton rms_norm[{k}] row 3 alone", tk.rms_norm(x[3:4].clone(), nw, 1e-6, True), full_norm[3:4], failures)
        _check(f"triton silu_mul[{k}] row 7 alone", tk.silu_mul(x[7:8].clone()), tk.silu_mul(x)[7:8], failures)
        swiglu = linear_triton.linear_silu_mul(x, torch.cat((w, w.flip(0))))  # gate rows, then up rows
        for m in (1, 20, TILE, 300):  # its tiles: half a bucket's columns each, for gate and for up
            _check(f"triton linear_silu_mul[{m}x{k}] vs rows of [{wide}x{k}]",
                   linear_triton.linear_silu_mul(x[:m].clone(), torch.cat((w, w.flip(0)))), swiglu[:m], failures)
        if persistent_linear:  # the residual epilogue: the add's bits, done apart, at a persistent and a bucket M
            r = rnd(wide, n_out)
            for m in (20, wide):
                _check(f"triton linear+residual[{m}x{k}] vs the add apart", tk.linear(x[:m], w, residual=r[:m]),
                       r[:m] + full[:m], failures)
    _quant_probes(rnd, failures)
    _moe_probes(rnd, tk, failures)
    _prefill_probes(rnd, tk, failures)


def _quant_probes(rnd, failures: list[str]) -> None:
    """The packed-weight kernels: a row's bits in calls of 1..100 rows and inside a 300-row call, across
    triton.quant.QUANT_BUCKETS and its two ways of adding K's chunks (tiles of 16 rows were tried on the
    H200 and this probe caught them changing bits against 64-row ones)."""
    from memra.kernels.split import split_layout
    from memra.kernels.triton import quant as quant_triton  # Triton is present: _triton_probes found it

    wide, k = 300, 2 * quant_triton.QUANT_CHUNK_K + 256  # past one chunk: the split and the one-program sums
    x = rnd(wide, k)
    for pack in (quant.quantize_q8_0, quant.quantize_q4_k):
        qw = split_layout(pack(rnd(320, k).float() * 0.05, x.dtype))
        full = quant_triton.linear(x, qw)
        for m in (1, 9, 40, 100):
            _check(f"triton {qw.qtype.name} linear[{m}x{k}] vs rows of [{wide}x{k}]", quant_triton.linear(x[:m].clone(), qw),
                   full[:m], failures)


def _prefill_probes(rnd, tk, failures: list[str]) -> None:
    """Prefill attention's promise: a query's bits in one 300-token piece, in aligned and unaligned
    pieces, and alone (what lets the exact prefill take whole chunks, memra.step.exact_piece)."""
    n, hq, hkv, d = 300, 8, 2, 128
    k_pool, v_pool, q = rnd(n // 16 + 1, 16, hkv, d), rnd(n // 16 + 1, 16, hkv, d), rnd(n, hq, d)
    rows = torch.randperm(k_pool.shape[0] * 16, generator=torch.Generator().manual_seed(1))[:n].to(q.device)
    whole = tk.prefill_attention(q, k_pool, v_pool, rows, 0, d ** -0.5)
    for a, b in ((0, 64), (64, 200), (130, 131), (131, 300)):
        _check(f"triton prefill attention[{n}] queries {a}:{b} as a piece",
               tk.prefill_attention(q[a:b].clone(), k_pool, v_pool, rows[:b], a, d ** -0.5), whole[a:b], failures)
    # the chunked delta-rule kernel (a model with MEMRA_GDN_KERNEL=0 disregards a failure here)
    from memra.kernels.triton import gdn as gdn_triton  # Triton is present: _triton_probes found it

    h, dk, dv = 4, 128, 128
    qk = lambda: torch.nn.functional.normalize(rnd(n, h, dk).float(), dim=-1)  # noqa: E731
    gq, gk, gv, s0 = qk() * dk ** -0.5, qk(), rnd(n, h, dv).float(), rnd(h, dk, dv).float() * 0.1
    beta, decay = torch.sigmoid(rnd(n, h).float()), -torch.sigmoid(rnd(n, h).float())
    o, s = gdn_triton.gdn_prefill(gq, gk, gv, beta, decay, s0, 0)
    o1, s1 = gdn_triton.gdn_prefill(gq[:128], gk[:128], gv[:128], beta[:128], decay[:128], s0, 0)
    o2, s2 = gdn_triton.gdn_prefill(gq[128:], gk[128:], gv[128:], beta[128:], decay[128:], s1, 128)
    _check(f"triton gdn prefill[{n}] in 64-aligned pieces", torch.cat((o1, o2)), o, failures)
    _check(f"triton gdn prefill[{n}] final state in pieces", s2, s, failures)


def _moe_probes(rnd, tk, failures: list[str]) -> None:
    """The grouped MoE kernels share tiles between the tokens routed to one expert: a token's bits
    alone, among others, and as the per-expert loop over the invariant linear gives them."""
    from memra.kernels.triton import moe as moe_triton  # Triton is present: _triton_probes found it

    n_experts, e, f, top_k, t = 16, 256, 128, 4, 96
    w_gate_up, w_down, x = rnd(n_experts, 2 * f, e) * 0.1, rnd(n_experts, e, f) * 0.1, rnd(t, e)
    weights, ids = reference.moe_route(rnd(t, n_experts).float(), top_k, True, x.dtype)
    full = moe_triton.moe_experts(x, weights, ids, w_gate_up, w_down)
    loop = reference.moe_experts(x, weights, ids, w_gate_up, w_down, linear_fn=tk.linear, silu_mul_fn=tk.silu_mul)
    _check(f"triton moe[{t}x{e}] vs the per-expert loop", full, loop, failures)
    for rows in (slice(5, 6), slice(0, 7), slice(30, 90)):
        _check(f"triton moe[{t}x{e}] rows {rows.start}:{rows.stop} alone",
               moe_triton.moe_experts(x[rows].clone(), weights[rows], ids[rows], w_gate_up, w_down), full[rows], failures)


# Memo of self_test results per (device type, dtype, linear family): a property of the platform and
# of the kernels a model runs, computed once per process.
_VERIFIED: dict[tuple[str, str, str], list[str]] = {}


def platform_report(dtype: torch.dtype, device: torch.device | str, linear_family: str = "bucket") -> list[str]:
    """The self-test's failures for this (device type, dtype), computed once per process; linear_family:
    the dense linears' family of the model's table (KernelTable.linear_family)."""
    key = (str(torch.device(device).type), str(dtype), linear_family)
    if key not in _VERIFIED:
        _VERIFIED[key] = self_test(dtype, device, linear_family=linear_family)
    return _VERIFIED[key]


def require_exact(dtype: torch.dtype, device: torch.device | str) -> None:
    """Refuse exact mode (before any state moves) if this platform is not deterministic."""
    key = (str(torch.device(device).type), str(dtype))
    failed = [f for f in platform_report(dtype, device) if "repeat" in f]  # determinism is what the exact path relies on
    if failed:
        raise ExactnessError(
            f"exact mode refused on {key[0]} {key[1]}: repeated identical calls gave different bits in "
            f"{', '.join(failed[:4])}{' ...' if len(failed) > 4 else ''}, so no run can be reproduced here; "
            "set MEMRA_EXACT=0 to run the non-exact path knowingly."
        )


def gdn_prefill_inputs(t: int, h: int, dk: int, dv: int, device: str = "cuda", seed: int = 0):
    """Seeded, well-conditioned arguments for gdn_prefill at T=t, h heads (unit-norm keys, queries
    scaled by dk^-1/2, a small state, betas in (0, 1), mild decays): what its kernel's checks and timers
    feed it. -> (q, k, v, beta, decay, state)."""
    g = torch.Generator(device=device).manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, device=device, generator=g)  # noqa: E731
    q = torch.nn.functional.normalize(rnd(t, h, dk), dim=-1) * dk ** -0.5
    k = torch.nn.functional.normalize(rnd(t, h, dk), dim=-1)
    v, s0 = rnd(t, h, dv), rnd(h, dk, dv) * 0.1
    beta, decay = torch.sigmoid(rnd(t, h)), -torch.nn.functional.softplus(rnd(t, h)) * 0.2
    return q, k, v, beta, decay, s0
