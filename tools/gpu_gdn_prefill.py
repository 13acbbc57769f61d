"""GDN's chunked prefill on the GPU: the three-launch Triton form against the reference's chunk loop
(run through the device tool; MEMRA_GDN_KERNEL turns the kernel on in the model, by default):

    python tools/gpu_gdn_prefill.py [--tokens 4096] [--heads 32] [--dk 128] [--dv 128] [--variants]

--variants also times the frozen launch configs' neighbours, each with whether its output has the frozen
config's bits.

Prints, for one layer of the Qwen3.5-9B shape: the largest relative difference of outputs and final
state from the reference (fp32: a product replaces the triangular solve), whether the kernel's bits
are the same when the prompt comes in 64-aligned pieces, and milliseconds per layer for both forms.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import triton  # noqa: E402

from memra.kernels import reference  # noqa: E402
from memra.kernels.exact import gdn_prefill_inputs  # noqa: E402
from memra.kernels.triton import gdn as gdn_triton  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--dk", type=int, default=128)
    ap.add_argument("--dv", type=int, default=128)
    ap.add_argument("--variants", action="store_true", help="also time the launch configs around the frozen one")
    a = ap.parse_args()
    t, h, dk, dv = a.tokens, a.heads, a.dk, a.dv
    q, k, v, beta, decay, s0 = gdn_prefill_inputs(t, h, dk, dv)
    o_ref, s_ref = reference.gdn_prefill(q, k, v, beta, decay, s0, 0)
    o, s = gdn_triton.gdn_prefill(q, k, v, beta, decay, s0, 0)
    rel = lambda x, y: ((x - y).abs().max() / y.abs().max()).item()  # noqa: E731
    cut = t // 2 // 64 * 64
    o1, s1 = gdn_triton.gdn_prefill(q[:cut], k[:cut], v[:cut], beta[:cut], decay[:cut], s0, 0)
    o2, s2 = gdn_triton.gdn_prefill(q[cut:], k[cut:], v[cut:], beta[cut:], decay[cut:], s1, cut)
    same = torch.equal(torch.cat((o1, o2)), o) and torch.equal(s2, s)
    ms_ref = triton.testing.do_bench(lambda: reference.gdn_prefill(q, k, v, beta, decay, s0, 0), rep=200)
    ms_ker = triton.testing.do_bench(lambda: gdn_triton.gdn_prefill(q, k, v, beta, decay, s0, 0), rep=200)
    print(f"GDN prefill, {t} tokens, {h} heads, Dk {dk}, Dv {dv} (one layer)")
    print(f"  max relative difference: output {rel(o, o_ref):.2e}, final state {rel(s, s_ref):.2e}")
    print(f"  bits equal in two 64-aligned pieces: {'yes' if same else 'NO'}")
    print(f"  reference chunk loop {ms_ref:8.2f} ms   Triton kernel {ms_ker:8.2f} ms   ({ms_ref / ms_ker:.2f}x)")
    if a.variants:  # the frozen launch config against others (each config is its own bits)
        names = ("GDN_SCAN_BLOCK_DV", "GDN_SCAN_WARPS", "GDN_SCAN_STAGES", "GDN_PREP_WARPS", "GDN_DOT_PRECISION")
        frozen = tuple(getattr(gdn_triton, n) for n in names)
        # ("ieee" products are left out: 14x slower, and each such config takes minutes to compile)
        configs = [frozen, (32, 4, 2, 4, "tf32x3"), (32, 8, 1, 4, "tf32x3"), (16, 4, 1, 4, "tf32x3"),
                   (64, 4, 1, 4, "tf32x3"), (32, 4, 1, 8, "tf32x3")]
        bounds = torch.arange(0, t + 1, 64, dtype=torch.int32, device="cuda")
        f32 = dict(dtype=torch.float32, device="cuda")
        u, w, o_, gc = (torch.empty(t, h, dv, **f32), torch.empty(t, h, dk, **f32), torch.empty(t, h, dv, **f32),
                        torch.empty(t, h, **f32))
        p, s_ = torch.empty(t // 64, h, 64, 64, **f32), torch.empty(h, dk, dv, **f32)
        piece = torch.tensor([[0, t, 0, 0, t // 64]], dtype=torch.int32, device="cuda")  # one piece: every chunk
        print("  scan BLOCK_DV/warps/stages  prep warps  precision   prep ms   scan ms   max rel diff   bits as frozen")
        for cfg in configs:
            for n, x in zip(names, cfg):
                setattr(gdn_triton, n, x)
            try:
                ov, _ = gdn_triton.gdn_prefill(q, k, v, beta, decay, s0, 0)
                prep = lambda: gdn_triton.chunk_prep(q, k, v, beta, decay, bounds, u, w, p, gc)  # noqa: E731
                scan = lambda: gdn_triton.chunk_scan(q, k, u, w, p, gc, s0, o_, s_, bounds, piece, 0)  # noqa: E731
                ms_p, ms_s = triton.testing.do_bench(prep, rep=50), triton.testing.do_bench(scan, rep=50)
                print(f"  {cfg[0]:9d}/{cfg[1]}/{cfg[2]:<14d} {cfg[3]:10d}  {cfg[4]:9s} {ms_p:8.2f}  {ms_s:8.2f}   "
                      f"{rel(ov, o_ref):.2e}   "
                      f"{'yes' if torch.equal(ov, o) else 'NO'}"
                      + ("   (frozen)" if cfg == frozen else ""), flush=True)
            except Exception as e:  # a config that does not compile (registers, shared memory)
                print(f"  {cfg}: failed: {type(e).__name__}: {str(e)[:80]}", flush=True)
        for n, x in zip(names, frozen):
            setattr(gdn_triton, n, x)


if __name__ == "__main__":
    main()
