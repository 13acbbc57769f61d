"""Step-3.5 / 3.7 (text): what its config becomes, and the gates across its sliding window.

The fixture hf/step3p5 (tools/make_fixture_sliding.py) is a Step3p7ForConditionalGeneration saved by
transformers in the checkpoints' own layout (`moe.gate_proj`, `moe.router_bias`, `share_expert`, a tiny
vision tower memra does not load): full and sliding layers (window 16) with different head counts and
RoPEs, a per-head attention gate, a dense layer then MoE layers with sigmoid routing, a random choice
bias, a routed-sum scale and a shared expert, SwiGLU clamps. Its HF logits and greedy tokens are held
in tests/test_models.py, and it runs through every file that walks HF_ARCHS.
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
    return json.loads((hf_dir("step3p5") / "config.json").read_text())


def test_the_fixture_config_becomes_per_layer_geometry():
    cfg = from_hf_config(_raw())
    assert cfg.windows == (None, 16, 16, None) and cfg.ffns == ("dense", "moe", "moe", "moe")
    assert [cfg.attn_of(i).n_heads for i in range(4)] == [4, 2, 2, 4]
    assert all(cfg.attn_of(i).head_gate and cfg.attn_of(i).scale == 0.25 for i in range(4))
    assert (cfg.rope.dim, cfg.rope.theta, cfg.ropes[0].dim, cfg.ropes[0].theta) == (8, 5e6, 16, 1e4)
    assert cfg.moe.n_experts == 4 and cfg.moe.shared_ffn == 48 and cfg.moe_scale == 2.5
    assert cfg.swiglu_limits == (None, None, 0.5, 0.5) and cfg.shared_limits == (None, None, None, 0.5)


def test_hub_configs_padded_with_mtp_layers_are_read():
    """Step's hub config.json lists the MTP layers' types after the trunk's; they are not the trunk."""
    text = dict(_raw()["text_config"])
    text["layer_types"] = text["layer_types"] + ["full_attention"]
    text["mlp_layer_types"] = text["mlp_layer_types"] + ["sparse"]
    text["num_nextn_predict_layers"] = 1
    cfg = from_hf_config({"model_type": "step3p7", "text_config": text})
    assert cfg.n_layers == 4 and cfg.windows == (None, 16, 16, None) and cfg.n_mtp == 0


@pytest.mark.parametrize("change, message", [
    ({"gating": "per-element"}, "gating"),
    ({"layer_types": ["full_attention", "minimax_m3_sparse", "sliding_attention", "full_attention"]}, "layer_types"),
    ({"mlp_bias": True}, "mlp_bias"),
])
def test_what_memra_does_not_run_is_refused_in_one_line(change, message):
    raw = _raw()
    with pytest.raises(ConfigError, match=message):
        from_hf_config({**raw, "text_config": {**raw["text_config"], **change}})


@pytest.mark.parametrize("mode", ["config", "strict"])
def test_gate_all_green_past_the_window(mode, load_model):
    lines: list[str] = []
    model = load_model(hf_dir("step3p5"))
    assert run_battery(model, steps=6, batch=3, mode=mode, plen=WINDOW + 8, out=lines.append), "\n".join(lines)
    assert lines[-1].startswith("ALL GREEN")


def test_gate_canary_fails(load_model):
    lines: list[str] = []
    model = load_model(hf_dir("step3p5")).with_doors(MEMRA_GATE_CANARY="1")
    assert not run_battery(model, steps=4, batch=2, mode="config", plen=WINDOW + 8, out=lines.append)
    assert lines[-1].startswith("FAILED")


def test_pp3_gate_all_green_past_the_window(load_model):
    lines: list[str] = []
    model = load_model(hf_dir("step3p5"))
    ok = run_pp_battery(model, stages=3, batches=[1, 3], steps=4, reps=1, plen=WINDOW + 8, out=lines.append)
    assert ok, "\n".join(lines)
