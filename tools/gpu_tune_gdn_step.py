"""The GDN decode step's bandwidth at the engine's shapes, with the state in fp32 and in bf16, at each value-column
tile (run through the device tool, on one GPU):

    python tools/gpu_tune_gdn_step.py [--rows 64,180,256] [--padded-rows 180,304] [--heads 32] [--dk 128] [--dv 128]

A decode step's delta rule reads every row's state and writes it back once (memra.kernels.triton.gdn
.delta_rule_step_into: the graphed decode's call, in place in a pool), so its floor is 2 x rows x heads x Dk x Dv x
the state's item size over the read bandwidth. For each row count and state dtype it times one layer's step
(slots shuffled, as a pool's end up) at the tiles GDN_BLOCK_DV may take, each at 4 and 8 warps (GDN_STEP_WARPS),
and prints the achieved bandwidth beside the device's read probe. A tile changes which lanes reduce a column's sums
over Dk, so each tile is its own bits: the table says whether each matches the frozen tile's (a tile with other bits
would be a new reference for decode and the verify together, never a silent change).

Last, the frozen launch as a captured step makes it: the live rows padded with inert ones up to the graph bucket
(memra.kernels.slots: a padding row's state is neither read nor written) against the live rows alone, and padded
with the inert rows' programs returning at once (MEMRA_INERT_SKIP, whose live rows' bits it checks). A mixed step's
GDN step ran at 78% of the read bandwidth against a decode step's 93% (docs/PERFORMANCE.md); this times the padding's
share of that.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_tune_linear import bench  # noqa: E402 - tools/, this script's folder
from memra.bench.probes import measure_read_bandwidth  # noqa: E402
from memra.graphs import bucket_for  # noqa: E402
from memra.kernels.slots import INERT_SLOT  # noqa: E402
from memra.kernels.triton import gdn  # noqa: E402

TILES = (16, 32, 64, 128)
WARPS = (4, 8)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="64,180,256")
    ap.add_argument("--padded-rows", default="180,304", help="live rows padded to their graph bucket (192, 384)")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--dk", type=int, default=128)
    ap.add_argument("--dv", type=int, default=128)
    a = ap.parse_args()
    h, dk, dv = a.heads, a.dk, a.dv
    read = measure_read_bandwidth("cuda")
    print(f"GDN decode step, {h} heads of {dk} x {dv}, one layer; read probe {read / 1e12:.2f} TB/s")
    print("  rows  state     tile  warps   us/step    TB/s   of probe   bits as frozen")
    g = torch.Generator(device="cuda").manual_seed(0)
    for rows in (int(r) for r in a.rows.split(",")):
        q = torch.nn.functional.normalize(torch.randn(rows, h, dk, device="cuda", generator=g), dim=-1) * dk ** -0.5
        k = torch.nn.functional.normalize(torch.randn(rows, h, dk, device="cuda", generator=g), dim=-1)
        v = torch.randn(rows, h, dv, device="cuda", generator=g)
        beta = torch.sigmoid(torch.randn(rows, h, device="cuda", generator=g))
        decay = -torch.rand(rows, h, device="cuda", generator=g) * 0.2
        slots = torch.randperm(rows + 8, device="cuda", generator=g)[:rows]
        for dtype in (torch.float32, torch.bfloat16):
            pool = (torch.randn(rows + 8, h, dk, dv, device="cuda", generator=g) * 0.1).to(dtype)
            frozen = gdn.GDN_BLOCK_DV, gdn.GDN_STEP_WARPS

            def step_once():  # -> (o, the stepped pool) at the tile set now
                stepped = pool.clone()
                return gdn.delta_rule_step_into(q, k, v, beta, decay, stepped, slots), stepped

            want = step_once()
            for tile, warps in ((t, w) for t in TILES for w in WARPS):
                gdn.GDN_BLOCK_DV, gdn.GDN_STEP_WARPS = tile, warps
                same = all(torch.equal(x, y) for x, y in zip(step_once(), want))
                work = pool.clone()
                seconds = bench(lambda: gdn.delta_rule_step_into(q, k, v, beta, decay, work, slots), 1e9)
                moved = 2 * rows * h * dk * dv * pool.element_size()
                print(f"  {rows:4d}  {str(dtype)[6:]:8s}  {tile:4d}  {warps:5d}  {seconds * 1e6:8.1f}"
                      f"  {moved / seconds / 1e12:6.2f}   {moved / seconds / read:7.0%}   {'yes' if same else 'NO'}"
                      + ("   (frozen)" if (tile, warps) == frozen else ""), flush=True)
            gdn.GDN_BLOCK_DV, gdn.GDN_STEP_WARPS = frozen
    padded_table(a.padded_rows, h, dk, dv, read, g)


def padded_table(rows_list: str, h: int, dk: int, dv: int, read: float, g: torch.Generator) -> None:
    """The frozen launch over live rows alone, then padded with inert rows to the graph bucket (as a captured
    decode or mixed step runs it), then so padded with the inert rows skipped (MEMRA_INERT_SKIP); the live rows'
    bytes over the padded times."""
    print("  rows  bucket  state     live only, us   padded, us   skipped, us   of the read probe: padded / skipped"
          "   live bits")
    for rows in (int(r) for r in rows_list.split(",")):
        bucket = bucket_for(rows) or rows
        for dtype in (torch.float32, torch.bfloat16):
            pool = (torch.randn(rows + 8, h, dk, dv, device="cuda", generator=g) * 0.1).to(dtype)
            slots = torch.randperm(rows + 8, device="cuda", generator=g)[:rows]
            inert = torch.full((bucket - rows,), INERT_SLOT, device="cuda", dtype=slots.dtype)
            padded = torch.cat((slots, inert))
            q = torch.nn.functional.normalize(torch.randn(bucket, h, dk, device="cuda", generator=g), dim=-1)
            k = torch.nn.functional.normalize(torch.randn(bucket, h, dk, device="cuda", generator=g), dim=-1)
            v, beta = torch.randn(bucket, h, dv, device="cuda", generator=g), torch.rand(bucket, h, device="cuda", generator=g)
            decay = -torch.rand(bucket, h, device="cuda", generator=g) * 0.2
            live = [x[:rows] for x in (q, k, v, beta, decay)]
            outs = [gdn.delta_rule_step_into(q, k, v, beta, decay, pool.clone(), padded, skip)[:rows] for skip in (False, True)]
            times = [bench(lambda: gdn.delta_rule_step_into(*live, pool, slots), 1e9)]
            times += [bench(lambda: gdn.delta_rule_step_into(q, k, v, beta, decay, pool, padded, skip), 1e9)
                      for skip in (False, True)]
            moved = 2 * rows * h * dk * dv * pool.element_size()
            print(f"  {rows:4d}  {bucket:6d}  {str(dtype)[6:]:8s}  {times[0] * 1e6:13.1f}  {times[1] * 1e6:11.1f}"
                  f"  {times[2] * 1e6:12.1f}   {moved / times[1] / read:7.0%} / {moved / times[2] / read:4.0%}"
                  f"   {'same' if torch.equal(*outs) else 'DIFFER'}", flush=True)


if __name__ == "__main__":
    main()
