"""Gemma 4 (text): what its config becomes, and the gates across its sliding window.

The fixture hf/gemma4 (tools/make_fixture_sliding.py) has every text feature at once: sliding layers
(window 16) and global ones with their own head size, one KV head and K as V, proportional RoPE; the
last two layers reading earlier layers' K/V with a double-wide FFN; per-layer embeddings; a logit
soft-cap. Its HF logits and greedy tokens are held in tests/test_models.py, and it runs through every
file that walks HF_ARCHS (E1, E4, E5, the gates, PP-2).
"""

from __future__ import annotations

import json

import pytest

from conftest import hf_dir
from memra.config import from_hf_config
from memra.errors import ConfigError
from memra.gate import run_battery
from memra.gate.pp_battery import run_pp_battery

WINDOW = 16


def _raw() -> dict:
    return json.loads((hf_dir("gemma4") / "config.json").read_text())


def test_the_fixture_config_becomes_per_layer_geometry():
    cfg = from_hf_config(_raw())
    assert cfg.windows == (16, 16, None, 16, 16, None)
    glob, slide = cfg.attn_of(2), cfg.attn_of(0)
    assert (glob.head_dim, glob.n_kv_heads, glob.k_eq_v, glob.rope) == (32, 1, True, 1)
    assert (slide.head_dim, slide.n_kv_heads, slide.k_eq_v, slide.rope) == (16, 2, False, 0)
    assert [cfg.attn_of(i).kv_from for i in range(6)] == [None, None, None, None, 3, 2]
    assert cfg.ffn_widths == (64, 64, 64, 64, 128, 128) and cfg.ple_dim == 8 and cfg.final_softcap == 30.0
    assert cfg.ropes[0].dim == 32 and cfg.ropes[0].zero_pairs == 16 - 4  # a quarter of the pairs rotate
    assert cfg.stream_width == 64 + 6 * 8 and cfg.tie_embeddings and cfg.embed_scale == 8.0


def test_the_hub_spelling_of_the_global_geometry_and_the_wrapper():
    """Google's config.json: a `gemma4` wrapper with `text_config`, `global_head_dim` and
    `num_global_key_value_heads` rather than transformers' per_layer_config."""
    text = {k: v for k, v in _raw().items() if k != "per_layer_config"}
    text.update(model_type="gemma4_text", global_head_dim=32, num_global_key_value_heads=1)
    cfg = from_hf_config({"model_type": "gemma4", "text_config": text})
    assert cfg.attn_of(5).head_dim == 32 and cfg.attn_of(5).n_kv_heads == 1


@pytest.mark.parametrize("change, message", [
    ({"enable_moe_block": True}, "enable_moe_block"),
    ({"use_bidirectional_attention": "all"}, "bidirectional"),
    ({"hidden_activation": "relu"}, "hidden_activation"),
    ({"vocab_size_per_layer_input": 512}, "vocab_size_per_layer_input"),
])
def test_what_memra_does_not_run_is_refused_in_one_line(change, message):
    with pytest.raises(ConfigError, match=message):
        from_hf_config({**_raw(), **change})


@pytest.mark.parametrize("mode", ["config", "strict"])
def test_gate_all_green_past_the_window(mode, load_model):
    lines: list[str] = []
    model = load_model(hf_dir("gemma4"))
    assert run_battery(model, steps=6, batch=3, mode=mode, plen=WINDOW + 8, out=lines.append), "\n".join(lines)
    assert lines[-1].startswith("ALL GREEN")


def test_gate_canary_fails(load_model):
    lines: list[str] = []
    model = load_model(hf_dir("gemma4")).with_doors(MEMRA_GATE_CANARY="1")
    assert not run_battery(model, steps=4, batch=2, mode="config", plen=WINDOW + 8, out=lines.append)
    assert lines[-1].startswith("FAILED")


def test_pp3_gate_all_green_past_the_window(load_model):
    """Three stages (layers 0-1 | 2-3 | 4-5): the per-layer embeddings cross both boundaries with the
    hidden state, and layer 5 reads layer 2's K/V across a fence (one device here)."""
    lines: list[str] = []
    model = load_model(hf_dir("gemma4"))
    ok = run_pp_battery(model, stages=3, batches=[1, 3], steps=4, reps=1, plen=WINDOW + 8, out=lines.append)
    assert ok, "\n".join(lines)
