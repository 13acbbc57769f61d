"""Cost of the exact training forward (issue 47): memra.train.Trainer forward + backward against plain PyTorch
eager on the same packed sequences: HF transformers where the architecture has one (each sequence its own
forward, the loss summed, one backward), and memra's own layers in the prompt form (the trainer's gradient walk
alone: what a plain trainer over memra's model definition costs). The rows run in rounds, one call of each per
round (after one untimed round), so that every ratio compares calls made under the same load: the best of --reps
rounds in seconds, its ratio to HF's best, and the spread (lowest..highest) of the per-round ratios. On a CPU the
clock is the process's CPU time (other processes' load then barely moves it; --threads 1, the default, keeps it
equal to the work's wall time on a quiet machine), on a GPU the wall clock.

    python tools/bench_train.py [MODEL] [--seqs 8] [--prompt 20] [--completion 48] [--reps 3] [--threads 1]
                                [--device cuda --dtype bfloat16]
"""

from __future__ import annotations

import argparse
import time

import torch

import memra
from memra.bench.timing import sync
from memra.train import Trainer
from memra.train.exact import sampler_logprobs, sampler_logprobs_batch, walked_logprobs
from memra.train.params import derive
from memra.train.walk import Walk


def main() -> None:
    ap = argparse.ArgumentParser(description="trainer forward+backward against plain eager (issue 47)")
    ap.add_argument("model", nargs="?", default="demo")
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=20)
    ap.add_argument("--completion", type=int, default=48)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="model dtype (default: fp32 on CPU, bf16 on a GPU)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = memra.LLM(args.model, device=args.device, dtype=args.dtype, warm_up=False, seed=1)
    model = llm.model
    trainer = Trainer(llm)
    g = torch.Generator().manual_seed(0)
    n = args.prompt + args.completion
    ids = torch.randint(0, model.cfg.vocab_size, (args.seqs * n,), generator=g).to(model.device)
    lens, starts = [n] * args.seqs, [args.prompt] * args.seqs
    coef = torch.randn(ids.numel(), generator=g).to(model.device)
    seqs = trainer._split(ids, lens, starts)

    def exact_fb():
        trainer.zero_grad()
        (coef * trainer(ids, lens, starts)).sum().backward()

    def scorer_values():
        if model.device.type == "cpu":  # the trainer's CPU form: the generated tokens verified together
            sampler_logprobs_batch(trainer._view, seqs)
            return
        for s in seqs:
            sampler_logprobs(trainer._view, s)

    def walk_values():
        if model.device.type != "cpu":  # the walk reproduces the sampler only on the CPU's reference ops
            return
        walked_logprobs(model, derive(model, {k: p.detach() for k, p in trainer.named_weights().items()}), seqs)

    def walk_fb():
        trainer.zero_grad()
        w = derive(model, trainer.named_weights())
        lp = Walk(model, w).logprobs(seqs, "prompt")
        sum((c[:-1] * x).sum() for c, x in zip(coef.split(lens), lp)).backward()

    def trained(t: Trainer):
        def fb():
            t.zero_grad()
            (coef * t(ids, lens, starts)).sum().backward()
        return fb

    rows = [("memra.train.Trainer forward+backward (exact values)", exact_fb),
            ("  the same, checkpointing=True (each layer recomputed)", trained(Trainer(llm, checkpointing=True)))]
    from memra.kernels import cpu_qdot

    if model.device.type == "cpu" and cpu_qdot.library() is not None and not model.settings.cpu_decode:
        c_model = model.with_doors(MEMRA_CPU_DECODE="1")  # the sampler's norms, SwiGLU, decode attention in C
        rows.append(("  the same on a sampler with MEMRA_CPU_DECODE=1 (its C kernels)", trained(Trainer(c_model))))
    if model.device.type == "cpu" and cpu_qdot.library() is not None and model.settings.cpu_flin:
        mkl_model = model.with_doors(MEMRA_CPU_FLIN="0")  # MKL's linears: the row plan, the walk's values
        rows.append(("  the same on a sampler with MEMRA_CPU_FLIN=0 (MKL's linears)", trained(Trainer(mkl_model))))
    default = trainer.values
    rows += [(f"  of which the sampler's values (walk, no grad{': the default' if default == 'walk' else ''})",
              walk_values),
             (f"  the sampler's values from the scorer (no grad{': the default' if default == 'scorer' else ''})",
              scorer_values),
             ("memra's layers, prompt form, forward+backward (plain eager)", walk_fb)]
    try:
        import transformers

        hf = transformers.AutoModelForCausalLM.from_pretrained(model.source, dtype=model.dtype,
                                                               attn_implementation="eager").to(model.device)

        def hf_fb():
            hf.zero_grad()
            total, at = 0, 0
            for k in lens:
                x = ids[at : at + k]
                logp = torch.log_softmax(hf(x[None]).logits[0].float(), -1)[:-1].gather(1, x[1:, None])[:, 0]
                total = total + (coef[at : at + k - 1] * logp).sum()
                at += k
            total.backward()

        rows.append(("HF transformers eager forward+backward", hf_fb))
    except Exception as e:  # no transformers, or no HF class for this architecture
        print(f"(HF transformers skipped: {str(e).splitlines()[0]})")
    times = rounds([fn for _, fn in rows], args.reps, torch.device(args.device))
    print(f"{args.model}: {args.seqs} sequences x ({args.prompt} prompt + {args.completion} generated) tokens, "
          f"{torch.get_num_threads()} thread(s), {model.device} {model.dtype}, best of {args.reps} rounds "
          f"(per-round ratio to the last row: lowest..highest)")
    base = times[-1]
    for (name, _), ts in zip(rows, times):
        per_round = [t / b for t, b in zip(ts, base)]
        print(f"  {name:66s} {min(ts):7.3f} s  {min(ts) / min(base):5.2f}x  ({min(per_round):.2f}..{max(per_round):.2f})")


def rounds(fns, reps: int, device: torch.device) -> list[list[float]]:
    """Each fn's seconds in each of `reps` rounds (one call of every fn a round, after an untimed round)."""
    clock = time.process_time if device.type == "cpu" else time.perf_counter
    for fn in fns:
        fn()
    out: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for fn, ts in zip(fns, out):
            sync(device)
            t0 = clock()
            fn()
            sync(device)
            ts.append(clock() - t0)
    return out


if __name__ == "__main__":
    main()
