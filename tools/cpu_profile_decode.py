"""Where a CPU decode step's time goes (issue 48): one GGUF (or demo), B=1, process CPU time per token and a
cProfile of the step by function, in buckets.

    MEMRA_CPU_DECODE=1 python tools/cpu_profile_decode.py FILE [--tokens 24] [--threads 1]

The C kernels are ctypes calls, so their time is their Python caller's (cpu_qdot.linear: the packed
linears; cpu_layer.decode: a dense layer's whole step; cpu_gdn.step_rows / heads_rows: the delta rule /
q-k norms; cpu_decode.*: attention, norms, SwiGLU). cProfile's own overhead inflates the Python buckets a
little; the first line (no profiler) is the step's real cost.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from memra.loading.checkpoint import load  # noqa: E402

BUCKETS = {  # (file suffix, function) -> bucket; cumulative time of the outermost match
    ("cpu_qdot.py", "linear"): "packed linears (C)",
    ("cpu_layer.py", "decode"): "dense layer, one C call (its linears included)",
    ("cpu_gdn.py", "step_rows"): "GDN delta rule (C)",
    ("cpu_gdn.py", "heads_rows"): "GDN q/k norms (C)",
    ("reference.py", "gdn_gates"): "GDN gates (torch)",
    ("reference.py", "causal_conv_step"): "GDN conv step (torch)",
    ("reference.py", "causal_conv"): "GDN conv (torch)",
    ("reference.py", "gated_rms_norm"): "GDN output norm (torch)",
    ("reference.py", "delta_rule_step"): "GDN delta rule (torch)",
    ("reference.py", "gdn_heads"): "GDN q/k norms + gates (torch)",
    ("cpu_decode.py", "attend_rows"): "attention (C)",
    ("cpu_decode.py", "rms_rows"): "norms (C)",
    ("cpu_decode.py", "silu_mul_rows"): "SwiGLU (C)",
    ("reference.py", "paged_decode_attention"): "attention (torch)",
    ("reference.py", "rms_norm"): "norms (torch)",
    ("reference.py", "add_rms_norm"): "norms (torch)",
    ("quant.py", "tiled_linear"): "packed linears (tiled twin)",
}


def steps(model, cache, tok, n):
    for _ in range(n):
        cache.reserve(1)
        tok = int(model.decode_step(tok, cache).argmax())
    return tok


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("path")
    p.add_argument("--tokens", type=int, default=24)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = load(args.path, device="cpu", tokenizer=False)
    cache = model.new_cache(16 + 3 * args.tokens + 8)
    tok = int(model.prime(list(range(10, 26)), cache).argmax())
    tok = steps(model, cache, tok, 4)  # plans bound, caches warm
    c0, w0 = time.process_time(), time.perf_counter()
    tok = steps(model, cache, tok, args.tokens)
    cpu, wall = (time.process_time() - c0) / args.tokens, (time.perf_counter() - w0) / args.tokens
    print(f"{Path(args.path).name}: {cpu * 1e3:.2f} ms CPU, {wall * 1e3:.2f} ms wall a token ({args.threads} threads)")
    prof = cProfile.Profile(time.process_time)  # CPU time: other processes on the cores do not count
    c0 = time.process_time()
    prof.enable()
    steps(model, cache, tok, args.tokens)
    prof.disable()
    total = time.process_time() - c0
    st = pstats.Stats(prof)
    sums: dict[str, float] = {}
    for (file, _, fn), (_, _, _, cum, callers) in st.stats.items():
        bucket = next((b for (f, name), b in BUCKETS.items() if file.endswith(f) and fn == name), None)
        if bucket is None or any(c[0].endswith(tuple(f for f, n in BUCKETS if n == fn)) and c[2] == fn for c in callers):
            continue
        sums[bucket] = sums.get(bucket, 0.0) + cum
    print(f"under cProfile: {total / args.tokens * 1e3:.2f} ms a token")
    for bucket, t in sorted(sums.items(), key=lambda kv: -kv[1]):
        print(f"  {bucket:50s} {t / args.tokens * 1e3:7.2f} ms")
    print(f"  {'the rest (Python, torch glue, head, sampling)':50s} {(total - sum(sums.values())) / args.tokens * 1e3:7.2f} ms")


if __name__ == "__main__":
    main()
