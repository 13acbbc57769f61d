"""The decode attention kernel's read bandwidth at the engine's shapes, and its launch options (run through the
device tool, on one GPU):

    python tools/gpu_tune_attention.py [--cases 256x200,128x600,64x1500,16x4000]
    python tools/gpu_tune_attention.py --mixed [--cases 258x170]

A decode step's attention streams every row's K and V once (the KV of its whole prefix), so its floor is those
bytes over the read bandwidth. For each case (rows x context) and each attention shape (Llama-3-8B: 32 query / 8
KV heads of 128; Qwen3.5-9B's gated attention: 16 / 4 of 256), it times triton.attention.paged_attention_rows
over one layer's paged pool (blocks handed out in a shuffled order, as a server's pool ends up) and prints the
achieved bandwidth for the kernel as launched today (its default warps and stages) and for other warps and
stages; then as a captured step launches it where its table is wider than one split (the splits of a
2,048-position table, most of them past the rows' prefixes, and the combine), with its bits compared to the
unsplit call's. --mixed instead takes a case apart as a captured mixed step launches it: its rows alone, then with
a graph bucket's padding rows (one position each, all on one scratch position), then told a table four splits
wide (a decode row past 512 positions beside them: the table then covers the rows' max_ctx, 2,048 positions in
the profiles' and the throughput runs' steps), then both, then both with MEMRA_ATTN_SHORT_ROWS, then both
with MEMRA_ATTN_SKIP_EMPTY (the splits past a row's prefix write and read no partials), then with
MEMRA_ATTN_SPLIT_WALK as well (a program walks its row's splits, where the rows are many), then walked with
MEMRA_ATTN_SHORT_ROWS (a short row's walk ends in its output, no partial, no combine read), then walked with
MEMRA_ATTN_WALK_COMBINE (each program merges its row's splits itself, no combine launch), and the skipped call's
split launch (and the same launch with its first split's programs only: what the empty ones cost) and combine
timed apart. Warps and
stages reorder no sum in the K/V loop, but a row's softmax sums (tl.sum over BLOCK_S) may
reduce in another tree under another layout: each variant's output is compared bit for bit with today's, and
the table says which differ (a variant with other bits would be a new reference, never a silent change).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import triton  # noqa: E402

from gpu_tune_linear import bench  # noqa: E402 - tools/, this script's folder
from memra.graphs import BUCKETS  # noqa: E402
from memra.kernels.cuts import ATTN_SPLIT  # noqa: E402
from memra.kernels.triton import attention as A  # noqa: E402

SHAPES = {"llama-3-8b": (32, 8, 128), "qwen3.5-9b": (16, 4, 256)}  # (query heads, KV heads, head size)
VARIANTS = [(w, s) for w in (4, 8) for s in (1, 2, 3, 4)]  # (warps, stages) beside the launch as memra makes it
BLOCK = 16
TABLE = 2048  # positions a captured step's table covers (a 1,088-position max_ctx rounds up to it)


def seconds(fn) -> float:
    """GPU seconds per call (gpu_tune_linear's CUDA-graph timing, 20 calls a replay)."""
    return bench(fn, 1e10)


def pool_for(rows: int, ctx: int, hkv: int, d: int, gen: torch.Generator):
    """A paged pool holding `rows` prefixes of `ctx` positions in shuffled blocks -> (k, v, flat rows, starts, lens)."""
    per = -(-ctx // BLOCK)
    n_blocks = rows * per + 1
    k = torch.randn(n_blocks, BLOCK, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(n_blocks, BLOCK, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    order = torch.randperm(n_blocks - 1, device="cuda", generator=gen).view(rows, per)
    flat = (order[:, :, None] * BLOCK + torch.arange(BLOCK, device="cuda")).reshape(rows, -1)[:, :ctx]
    starts = torch.arange(rows, device="cuda") * ctx
    lens = torch.full((rows,), ctx, device="cuda", dtype=torch.long)
    return k, v, flat.reshape(-1).contiguous(), starts, lens


def launch(q, k, v, rows, starts, lens, scale, ctx, options: dict | None, short_rows: bool = False,
           skip_empty: bool = False, split_walk: bool = False, walk_combine: bool = False):
    """paged_attention_rows, with warps/stages given to the split kernel where `options` says; ctx: the bound
    on the rows' prefixes the launch is told (a captured step: its table's width); short_rows: MEMRA_ATTN_SHORT_ROWS;
    skip_empty: MEMRA_ATTN_SKIP_EMPTY; split_walk: MEMRA_ATTN_SPLIT_WALK; walk_combine: MEMRA_ATTN_WALK_COMBINE."""
    if options is None:
        return A.paged_attention_rows(q, k, v, rows, starts, lens, scale, max_len=ctx, short_rows=short_rows,
                                      skip_empty=skip_empty, split_walk=split_walk, walk_combine=walk_combine)
    n, hq, d = q.shape
    hkv = k.shape[-2]
    n_splits = triton.cdiv(ctx, ATTN_SPLIT)
    shape = {**A.decode_shape(q, k), **options}
    o = torch.empty_like(q)
    qk = scale * 1.4426950408889634
    if n_splits <= 1:
        A._decode_attention_kernel[(n, hkv, 1)](q, k, v, rows, starts, lens, o, o, o, o, hq, qk, 0, 1, PARTIAL=False,
                                                **shape)
        return o
    split, combine = split_launches(q, k, v, rows, starts, lens, scale, ctx, shape, o)
    split()
    combine()
    return o


def split_launches(q, k, v, rows, starts, lens, scale, ctx, shape: dict, o, skip: bool = False):
    """The split launch and the combine of a call told `ctx` positions, as two callables on their own buffers."""
    n, hq, d = q.shape
    n_splits = triton.cdiv(ctx, ATTN_SPLIT)
    m = torch.empty(n, hq, n_splits, dtype=torch.float32, device=q.device)
    l, part = torch.empty_like(m), torch.empty(n, hq, n_splits, d, dtype=torch.float32, device=q.device)
    qk, flag = scale * 1.4426950408889634, int(skip)
    split = lambda splits=n_splits: A._decode_attention_kernel[(n, k.shape[-2], splits)](  # noqa: E731
        q, k, v, rows, starts, lens, part, m, l, o, hq, qk, flag, n_splits, PARTIAL=True, **shape)
    combine = lambda: A._combine_splits_kernel[(n, hq)](  # noqa: E731
        m, l, part, o, lens, hq, flag, N_SPLITS=n_splits, D=d, BLOCK_D=shape["BLOCK_D"], SPLIT=ATTN_SPLIT)
    return split, combine


def with_padding(rows: int, flat, starts, lens):
    """The case's rows, then a graph bucket's padding rows (memra.graphs.BUCKETS), each one position long on one
    scratch position (a block past the pool's others) -> (bucket, flat, starts, lens)."""
    bucket = next(b for b in BUCKETS if b >= rows)
    scratch = torch.tensor([0], device="cuda")
    pad = bucket - rows
    starts = torch.cat([starts, torch.full((pad,), flat.numel(), device="cuda", dtype=starts.dtype)])
    return bucket, torch.cat([flat, scratch]), starts, torch.cat([lens, torch.ones(pad, device="cuda", dtype=lens.dtype)])


def mixed(cases: list[tuple[int, int]], gen: torch.Generator) -> None:
    """Each case as a captured mixed step launches its decode rows: alone, padded, told two splits, both."""
    print("case            shape        alone us | padded to bucket | told 4 splits | both | both, short rows "
          "| both, empty splits skipped | and walked | walked, short rows | walked, merged | live rows' bits")
    for rows, ctx in cases:
        for name, (hq, hkv, d) in SHAPES.items():
            k, v, flat, starts, lens = pool_for(rows, ctx, hkv, d, gen)
            bucket, pflat, pstarts, plens = with_padding(rows, flat, starts, lens)
            q = torch.randn(bucket, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
            scale, wide = d ** -0.5, TABLE  # a captured step's table of max_ctx 2,048: four splits
            ref = launch(q[:rows], k, v, flat, starts, lens, scale, ctx, None)
            runs = [(q[:rows], flat, starts, lens, ctx, False, False, False),
                    (q, pflat, pstarts, plens, ctx, False, False, False),
                    (q[:rows], flat, starts, lens, wide, False, False, False),
                    (q, pflat, pstarts, plens, wide, False, False, False),
                    (q, pflat, pstarts, plens, wide, True, False, False),
                    (q, pflat, pstarts, plens, wide, False, True, False),
                    (q, pflat, pstarts, plens, wide, False, True, True),
                    (q, pflat, pstarts, plens, wide, True, True, True),
                    (q, pflat, pstarts, plens, wide, False, True, True, True)]
            times = [seconds(lambda r=r: launch(r[0], k, v, r[1], r[2], r[3], scale, r[4], None, *r[5:])) for r in runs]
            same = all(torch.equal(launch(r[0], k, v, r[1], r[2], r[3], scale, r[4], None, *r[5:])[:rows], ref)
                       for r in runs)
            print(f"{rows}x{ctx} (+{bucket - rows}) {name:11s} " + " | ".join(f"{t * 1e6:8.1f}" for t in times)
                  + f" | {'equal' if same else 'DIFFER'}", flush=True)
            # the last column's two launches timed apart: where the four-split call's cost over one split lies
            split, combine = split_launches(q, k, v, pflat, pstarts, plens, scale, wide, A.decode_shape(q, k),
                                            torch.empty_like(q), skip=True)
            split()
            print(f"{'':15s} {name:11s} that call taken apart: split launch {seconds(split) * 1e6:8.1f} us "
                  f"(its first split's programs alone {seconds(lambda: split(1)) * 1e6:8.1f}), "
                  f"combine {seconds(combine) * 1e6:8.1f} us", flush=True)
            del k, v


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=None, help="rows x context, comma-separated (default 256x200,128x600,64x1500,"
                                                  "16x4000; with --mixed 258x170,376x400)")
    ap.add_argument("--mixed", action="store_true", help="the decode rows of a captured mixed step, taken apart")
    a = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"device: {torch.cuda.get_device_name()}; Triton {triton.__version__}; ATTN_SPLIT {ATTN_SPLIT}")
    cases = a.cases or ("258x170,376x400" if a.mixed else "256x200,128x600,64x1500,16x4000")
    if a.mixed:
        return mixed([tuple(int(x) for x in c.split("x")) for c in cases.split(",")], gen)
    print("case            shape        today: us  TB/s | best variant (warps, stages): us  TB/s | variants with other bits")
    for case in cases.split(","):
        rows, ctx = (int(x) for x in case.split("x"))
        for name, (hq, hkv, d) in SHAPES.items():
            k, v, flat, starts, lens = pool_for(rows, ctx, hkv, d, gen)
            q = torch.randn(rows, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
            scale = d ** -0.5
            kv_bytes = 2 * rows * ctx * hkv * d * 2
            ref = launch(q, k, v, flat, starts, lens, scale, ctx, None)
            today = seconds(lambda: launch(q, k, v, flat, starts, lens, scale, ctx, None))
            best, other_bits = None, []
            for w, s in VARIANTS:
                opts = dict(num_warps=w, num_stages=s)
                try:
                    out = launch(q, k, v, flat, starts, lens, scale, ctx, opts)
                    t = seconds(lambda: launch(q, k, v, flat, starts, lens, scale, ctx, opts))
                except Exception as e:  # noqa: BLE001 -- a variant the compiler refuses (shared memory)
                    print(f"  {case} {name} ({w}, {s}): {type(e).__name__}: {str(e)[:120]}")
                    continue
                if not torch.equal(out, ref):
                    other_bits.append((w, s))
                if best is None or t < best[0]:
                    best = (t, (w, s))
            print(f"{case:15s} {name:11s} {today * 1e6:8.1f} {kv_bytes / today / 1e12:5.2f} | "
                  f"{best[1]}: {best[0] * 1e6:8.1f} {kv_bytes / best[0] / 1e12:5.2f} | {other_bits or 'none'}", flush=True)
            for short, skip in ((False, False), (True, False), (False, True)) if ctx < TABLE else ():  # a table's splits
                wide = launch(q, k, v, flat, starts, lens, scale, TABLE, None, short, skip)
                t_wide = seconds(lambda: launch(q, k, v, flat, starts, lens, scale, TABLE, None, short, skip))
                said = ", short rows" if short else ", empty splits skipped" if skip else ""
                print(f"{'':15s} {name:11s} told a table of {TABLE}{said}: "
                      f"{t_wide * 1e6:8.1f} us ({kv_bytes / t_wide / 1e12:5.2f} TB/s); bits "
                      f"{'equal' if torch.equal(wide, ref) else 'DIFFER'}", flush=True)
            del k, v


if __name__ == "__main__":
    main()
