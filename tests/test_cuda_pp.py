"""The in-process pipeline on one GPU, each stage on its own CUDA stream (what tools/gpu_pp_report.py used
to print, now pass/fail):

- `memra gate --mode pp` on the bundled demo (bf16) with 2 and 4 stages (dual waves Auto: serial on
  one device);
- the same battery, PP-2, on a random-weight Qwen3.5-9B-shaped model (bf16, 4 of its layers);
- deferred readback on the last stage's readback stream == the immediate logits.

Every fixture architecture, fence, dual mode and transport runs on CPU threads in tests/test_pp.py.
Decode tokens/s unsplit vs split: tools/gpu_profile_pp.py.
"""

from __future__ import annotations

import pytest
import torch

import memra
from cuda_marks import needs_cuda
from memra.gate.pp_battery import run_pp_battery
from memra.pp.walk import active_runtime
from memra.random_model import random_model

pytestmark = needs_cuda


def battery(model, stages: int, **kwargs) -> None:
    lines: list[str] = []
    ok = run_pp_battery(model, stages=stages, out=lines.append, **kwargs)
    assert ok, "\n".join(lines)
    assert lines[-1].startswith("ALL GREEN")


@pytest.mark.parametrize("stages", [2, 4])
def test_pp_gate_demo_bf16_stage_streams(stages):
    demo = memra.load("demo", device="cuda", dtype="bfloat16", tokenizer=False)
    battery(demo, stages, batches=(1, 4, 8), steps=8, reps=2)
    rt = active_runtime(demo.with_doors(MEMRA_PP_STAGES=str(stages)))
    assert rt.n_stages == stages and all(st.stream is not None for st in rt.stages)  # a stream per stage


def test_pp_gate_9b_shape_bf16():
    model = random_model("qwen3.5-9b", "cuda", torch.bfloat16, n_layers=4)
    try:
        battery(model, 2, batches=(1, 4), steps=2, reps=1, plen=8)
    finally:
        del model
        torch.cuda.empty_cache()


@torch.inference_mode()
def test_deferred_readback_equals_immediate_logits():
    demo = memra.load("demo", device="cuda", dtype="bfloat16", tokenizer=False).with_doors(MEMRA_PP_STAGES="2")
    rt = active_runtime(demo)
    c = rt.new_cache(64)
    demo.prime([3, 4, 5, 6], c)
    snap = c.snapshot()
    now = demo.decode_step(7, c).cpu()
    demo.restore(c, snap)
    with rt.stages[-1].scope():
        pending = rt.defer(demo.decode_step(7, c))
    assert torch.equal(pending.wait(), now)
