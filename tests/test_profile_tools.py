"""tools/gpu_profile_steps.py's byte counts, which turn its kernel times into read rates: the figures
docs/PERFORMANCE.md derives by hand for the 256-row decode steps (Qwen3.5-9B's GDN state, 25.8 GB, half that in
bf16; Llama-3-8B's KV at ~170 positions a row)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import gpu_profile_steps as profile  # noqa: E402
from memra.random_model import SHAPES  # noqa: E402


def test_the_memory_bound_kernels_bytes_follow_the_shapes():
    qwen = profile.read_bytes(SHAPES["qwen3.5-9b"](None), rows=256, contexts=256 * 170)
    # 24 GDN layers x 32 value heads x 128 x 128 fp32, read and written, for 256 rows
    assert qwen["_delta_rule_scan_kernel"] == 256 * 24 * 32 * 128 * 128 * 4 * 2
    # 8 attention layers x 4 KV heads of 256, K and V in bf16
    assert qwen["_decode_attention_kernel"] == 256 * 170 * 8 * 4 * 256 * 2 * 2
    cfg = SHAPES["qwen3.5-9b"](None)
    bf16 = dataclasses.replace(cfg, gdn=dataclasses.replace(cfg.gdn, state_dtype="bfloat16"))  # the state in bf16
    state = profile.read_bytes(bf16, rows=256, contexts=0)["_delta_rule_scan_kernel"]
    assert state == 256 * 24 * 32 * 128 * 128 * 2 * 2
    llama = profile.read_bytes(SHAPES["llama-3-8b"](None), rows=256, contexts=256 * 170)
    assert "_delta_rule_scan_kernel" not in llama  # no GDN layer
    assert llama["_decode_attention_kernel"] == 256 * 170 * 32 * 8 * 128 * 2 * 2
