"""How many kernels a graphed decode or mixed step launches, counted on CPU (no GPU needed):

    python tools/count_launches.py [--model llama-3-8b|qwen3.5-9b|qwen3.5-35b-a3b] [--batch B] [--mixed N]

The model is built with the real shape's structure (its layers, mixers, heads and experts as the named
shape has them) at toy widths, with the kernel table a CUDA model in exact mode gets, held to CPU
tensors: every Triton launch goes to Triton's interpreter, which counts it (and runs it with --run-kernels;
a captured body has no value-dependent control flow, so the counts are the same). The captured decode step's body
(memra.graphs.StaticDecode.body, what a CUDA graph replays; with --mixed N, memra.mixed_graphs.StaticMixed.body
with N prompts of 20 tokens joining the B decode rows) then runs once, and each Triton launch and
each torch op that launches a kernel on a GPU (not views, not allocations) is counted. Widths do not
change the count. The inputs' upload and the logits' copy out sit outside the graph and are not
counted. Prints the total and the count by kernel.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports Triton: it reads this once
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
from conftest import _triton_interpreter_numpy2_fix, gpu_kernel_table  # noqa: E402  (the tests' helpers)

_triton_interpreter_numpy2_fix()

import torch  # noqa: E402
from triton.runtime import interpreter  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import memra.decode_plan as decode_plan  # noqa: E402
import memra.random_model as rm  # noqa: E402
from memra import graphs  # noqa: E402
from memra.cache import Cache, RecurrentPool, kv_pool  # noqa: E402
from memra.kernels.table import KernelTable  # noqa: E402
from memra.mixed_graphs import StaticMixed, token_bucket  # noqa: E402
from memra.model.hybrid import HybridModel  # noqa: E402

# aten ops that launch no kernel on a GPU: views, metadata, allocations
NO_KERNEL = {"view", "_unsafe_view", "slice", "select", "t", "transpose", "expand", "as_strided", "detach", "alias",
             "unsqueeze", "squeeze", "permute", "split", "split_with_sizes", "unbind", "reshape", "_reshape_alias",
             "empty", "empty_like", "empty_strided", "lift_fresh", "narrow", "unflatten", "flatten", "view_as",
             "sym_size", "sym_stride", "detach_"}


def toy(cfg):
    """cfg's structure at toy widths: the same layers, mixers, head counts and experts."""
    a = dataclasses.replace(cfg.attn, head_dim=16)
    rope = dataclasses.replace(cfg.rope, dim=min(cfg.rope.dim, 16))
    gdn = dataclasses.replace(cfg.gdn, k_head_dim=16, v_head_dim=16) if cfg.gdn else None
    moe = dataclasses.replace(cfg.moe, expert_ffn=32, shared_ffn=32 if cfg.moe.shared_ffn else 0) if cfg.moe else None
    return dataclasses.replace(cfg, vocab_size=256, hidden_size=64, intermediate_size=128, attn=a, rope=rope, gdn=gdn,
                               moe=moe)


def mixed_step(model, kv, rec, caches: list[Cache], n_prompts: int):
    """A StaticMixed of the B decode rows and n_prompts new 20-token prompts, filled for one step (its body not run)."""
    scratch = graphs.scratch_of(kv, rec, model.graph_scratch)
    new = [Cache(kv=kv, rec=rec, max_ctx=64, slot=rec.allocate() if rec else None) for _ in range(n_prompts)]
    pieces = [torch.arange(3, 23) for _ in new]
    for c in new:
        c.reserve(20)
    tokens = token_bucket(20 * n_prompts)
    static = StaticMixed(model, kv, rec, graphs.bucket_for(len(caches)), tokens, graphs.table_blocks(64))
    static.fill(torch.tensor([5] * len(caches)), caches, pieces, new, scratch)
    return static


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3-8b", choices=sorted(rm.SHAPES))
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--mixed", type=int, default=0, help="count a mixed step with this many prompts joining")
    p.add_argument("--run-kernels", action="store_true", help="run each Triton launch in the interpreter as well "
                   "(minutes for a mixed step; the counts are the same: a captured body's launches follow its shapes)")
    args = p.parse_args()
    cfg = toy(rm.SHAPES[args.model](None))
    table = gpu_kernel_table()  # a CUDA model's exact table, for CPU tensors
    KernelTable.build = classmethod(lambda cls, device, settings: table)
    decode_plan.verify_plan = lambda model, plan, seed=0: True  # the CPU's torch ops are not the GPU's
    graphs.graphable = lambda model, caches: True  # off the GPU the static step's body runs eagerly
    weights = rm.random_weights(cfg, "cpu", torch.bfloat16)
    model = HybridModel(cfg, weights, torch.device("cpu"), torch.bfloat16).with_doors(MEMRA_DECODE_PLAN="stacked",
                                                                        MEMRA_CUDA_GRAPHS="1")
    b = args.batch
    seqs = b + args.mixed  # the decode rows, then the joining prompts
    kv = kv_pool(cfg, seqs * 4 + 2, model.dtype, model.device)
    rec = RecurrentPool(cfg, seqs + 2, model.dtype, model.device) if cfg.gdn_layers else None
    caches = [Cache(kv=kv, rec=rec, max_ctx=64, slot=rec.allocate() if rec else None) for _ in range(b)]
    for c in caches:
        model.prime([1, 2, 3, 4], c)
        c.reserve(64 - c.pos)
    if args.mixed:
        static = mixed_step(model, kv, rec, caches, args.mixed)
    else:
        graphs.graphed_decode(model, torch.tensor([5] * b), caches)  # builds the bucket's static step
        static = next(iter(model.decode_graphs.values()))

    counts: collections.Counter = collections.Counter()
    inside = [False]  # the interpreter's own torch calls are not the model's

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if not inside[0] and name not in NO_KERNEL:
                counts["torch " + name] += 1
            return func(*args, **(kwargs or {}))

    plain, run_kernels = interpreter.InterpretedFunction.run, args.run_kernels

    def counted(self, *args, **kwargs):  # every Triton launch, lean or not, counted where the interpreter would run it
        counts["triton " + self.fn.__name__] += 1
        if run_kernels:
            inside[0] = True
            try:
                return plain(self, *args, **kwargs)
            finally:
                inside[0] = False

    interpreter.InterpretedFunction.run = counted
    with Count():
        static.body()
    what = f"mixed step, B={b} + {args.mixed} prompts" if args.mixed else f"decode step, B={b}"
    print(f"{args.model} (structure at toy widths), graphed {what}: {sum(counts.values())} launches")
    for name, n in counts.most_common():
        print(f"{n:6d}  {name}")


if __name__ == "__main__":
    main()
