"""Where one decode step's and one mixed step's time goes at scale, on the engine's own path (its captured
graphs and exact kernels, the default doors), run through the device tool:

    python tools/gpu_profile_steps.py [--model random:llama-3-8b] [--rows 256] [--prompt 160] [--new 16] [--join-prompt 512]
                                      [--steps 8] [--top 12]

1. `rows` requests of `prompt` tokens start and run until a step is a pure decode step; the next `steps`
   decode steps are profiled (torch.profiler records the kernels of replayed graphs too).
2. `new` requests of `join-prompt` prompt tokens (512) join while the rows decode: the steps are then mixed steps,
   the decode rows and up to the scheduler's split budget of prompt tokens; `steps` of them are profiled. At 512
   a step primes one prompt; at 160 (the throughput workload's median) three or four pieces, whose GDN chunks and
   attention tiles run side by side instead of one after another. With `new` = 16 (the default), 16 x 160 tokens
   run out after five steps: give `--new 48` there.

For each kind it prints the wall time per step (under the profiler), the GPU kernel time per step, and the
top kernels by time with their share of the step. The matmul kernels (the linears) are summed into one line
with their achieved TFLOP/s and share of the dense bf16 peak: 2 x the trunk's linear weights x the step's
tokens, plus the lm_head's rows. The two kernels whose bytes are known from the step's rows (`read_bytes`) get
their achieved read rate and share of the probed read bandwidth: GDN's state step (each live row's state read and
written, every GDN layer) and decode attention with its combine (each decode row's K and V over its
context, every attention layer). A profiler, not a benchmark: `memra bench throughput` gives the rates.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import memra  # noqa: E402
from gpu_tune_linear import dense_peak  # noqa: E402 - tools/, this script's folder
from memra.bench.probes import measure_read_bandwidth  # noqa: E402
from memra.sampling import SamplingParams  # noqa: E402

LINEAR_NAMES = ("linear", "gemm", "matmul", "_mm", "persistent", "nvjet", "xmma", "cutlass")  # Triton, and cuBLAS on Hopper


def linear_weights(model) -> tuple[int, int]:
    """(the trunk's linear weight elements, the lm_head's): every 2-D layer weight wider than a conv kernel."""
    w = model._weights
    trunk = sum(v.numel() for k, v in w.items() if k.startswith("layers.") and v.dim() == 2 and min(v.shape) >= 64)
    return trunk, w["lm_head"].numel()


def read_bytes(cfg, rows: float, contexts: float) -> dict[str, float]:
    """Bytes a step's memory-bound kernels must move, by kernel name: GDN's state step reads and writes each
    row's state [Hv, Dk, Dv] (fp32 or bf16: GdnConfig.state_dtype) in every GDN layer; decode attention reads
    each decode row's K and V (bf16) over its context in every attention layer (`contexts`: the decode rows'
    positions summed)."""
    kinds = cfg.mixers
    out = {}
    if cfg.gdn is not None:
        g = cfg.gdn
        out["_delta_rule_scan_kernel"] = rows * kinds.count("gdn") * g.n_v_heads * g.k_head_dim * g.v_head_dim * g.state_torch_dtype.itemsize * 2
    a = cfg.attn
    out["_decode_attention_kernel"] = contexts * kinds.count("attention") * a.n_kv_heads * a.head_dim * 2 * 2
    return out


def decoding_contexts(engine) -> float:
    """The decoding sequences' positions, summed (their prompts and outputs so far)."""
    return float(sum(len(s.prompt) + len(s.out) for s in engine.seqs.values() if s.out and not s.done))


def drive(engine, want: str, steps: int, limit: int = 2000) -> tuple[list, float, float, float, int, float]:
    """Step the engine until a step of kind `want` runs, then profile until `steps` more of them ran (at most
    4x that many steps). -> (the profiler's key averages, and per step of that kind: wall seconds, decode
    rows, prompt tokens; how many ran; the decoding contexts at the window's middle, near enough: the mean of
    its ends, both taken once rows decode)."""
    kinds = engine.step_mix.kinds
    for _ in range(limit):
        before = kinds[want].steps
        engine.step()
        if kinds[want].steps > before:
            break
    else:
        raise SystemExit(f"no {want} step in {limit} steps")
    rows0, tok0, n0, all0 = kinds[want].decode_rows, kinds[want].prompt_tokens, kinds[want].steps, engine.steps
    contexts0 = decoding_contexts(engine)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(4 * steps):  # bounded: a workload that runs out of prompts turns to decode steps
            if kinds[want].steps - n0 >= steps:
                break
            engine.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    ran, others = max(1, kinds[want].steps - n0), engine.steps - all0 - (kinds[want].steps - n0)
    if others:
        print(f"note: {others} steps of another kind ran inside the {want} window; its kernels are counted too")
    return (prof.key_averages(), wall / ran, (kinds[want].decode_rows - rows0) / ran,
            (kinds[want].prompt_tokens - tok0) / ran, ran, (contexts0 + decoding_contexts(engine)) / 2)


def report(kind: str, events, wall_s: float, rows: float, tokens: float, steps: int, weights, peak,
           moved: dict[str, float] | None = None, bandwidth: float | None = None, top: int = 12) -> list[str]:
    # kernels and copies only: a CPU op (aten::copy_, aten::cat) also carries the device time it launched
    cuda = [e for e in events if e.device_type.name == "CUDA" and getattr(e, "self_device_time_total", 0) > 0]
    total_us = max(sum(e.self_device_time_total for e in cuda) / steps, 1e-9)
    lines = [f"{kind} step: {rows:.0f} decode rows + {tokens:.0f} prompt tokens; wall {wall_s * 1e3:.2f} ms/step "
             f"(profiled), GPU kernels {total_us / 1e3:.2f} ms/step"]
    lin = [e for e in cuda if any(s in e.key.lower() for s in LINEAR_NAMES)]
    lin_us = sum(e.self_device_time_total for e in lin) / steps
    trunk, head = weights
    flops = 2 * trunk * (rows + tokens) + 2 * head * (rows + (1 if tokens else 0))
    if lin_us > 0:
        tf = flops / (lin_us * 1e-6) / 1e12
        share = f", {100 * tf / peak:.0f}% of the bf16 peak" if peak else ""
        lines.append(f"  linears (matmul kernels, {len(lin)} names): {lin_us / 1e3:.2f} ms/step, "
                     f"{100 * lin_us / total_us:.0f}% of the kernels, {tf:.0f} TFLOP/s{share}")
    lines.append(f"  {'kernel':<70} {'ms/step':>8} {'share':>6} {'calls/step':>10}  read rate")
    for e in sorted(cuda, key=lambda e: -e.self_device_time_total)[:top]:
        us = e.self_device_time_total / steps
        rate = ""
        if moved and bandwidth and e.key in moved:
            gbs = moved[e.key] / (us * 1e-6) / 1e9
            rate = f"  {gbs:,.0f} GB/s, {100 * gbs * 1e9 / bandwidth:.0f}% of {bandwidth / 1e12:.2f} TB/s"
        lines.append(f"  {e.key[:70]:<70} {us / 1e3:>8.3f} {100 * us / total_us:>5.1f}% {e.count / steps:>10.1f}{rate}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:llama-3-8b")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=160)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--join-prompt", type=int, default=512, help="prompt tokens of each joining request")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--top", type=int, default=12, help="kernels listed a step, the longest first")
    args = ap.parse_args()
    bandwidth = measure_read_bandwidth("cuda")  # first: its 4 GiB tensor before the model and its pools
    torch.cuda.empty_cache()
    model = memra.load(args.model, device="cuda")
    longest = max(args.prompt, args.join_prompt, 512)
    llm = memra.LLM(model, max_batch=args.rows + args.new, max_ctx=longest + 512 + 64)  # each prompt and its 512 tokens
    engine, vocab = llm.engine, model.cfg.vocab_size
    params = SamplingParams(max_tokens=512, temperature=1.0, seed=0, ignore_eos=True)
    sink = lambda event: None  # noqa: E731 - the tokens are not the point here
    for i in range(args.rows):
        engine.submit([(i * 7 + j) % vocab for j in range(args.prompt)], params, sink)
    peak, weights = dense_peak(torch.cuda.get_device_name())[0], linear_weights(model)
    out = [f"{args.model} on {torch.cuda.get_device_name()}; doors as loaded; peak {peak} TFLOP/s; read "
           f"bandwidth probed {bandwidth / 1e12:.2f} TB/s"]

    def profiled(kind: str) -> list[str]:
        # the contexts are taken inside the window: before its first step of this kind the rows may not decode
        # yet (no output), which counted them as none and halved the attention's bytes
        events, wall, rows, tokens, ran, contexts = drive(engine, kind, args.steps)
        moved = read_bytes(model.cfg, rows, contexts)
        return report(kind, events, wall, rows, tokens, ran, weights, peak, moved, bandwidth, args.top)

    out += profiled("decode")
    for i in range(args.new):
        engine.submit([(i * 11 + j) % vocab for j in range(args.join_prompt)], params, sink)
    out += profiled("mixed")
    print("\n".join(out))
    llm.close()


if __name__ == "__main__":
    main()
