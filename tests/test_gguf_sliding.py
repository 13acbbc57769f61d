"""Gemma 4 and Step-3.5 from llama.cpp's GGUFs: the same network as from their HF directories.

tests/fixtures/gguf/{gemma4,step3p5}-f32.gguf are the hf/ fixtures converted by llama.cpp's own
convert_hf_to_gguf.py (llama-cpp-python 0.3.36's vendor/llama.cpp; tools/make_fixture_gguf_sliding.py
says how). test_models.py holds their logits and greedy tokens against HF; here the stronger claim: the
config and every canonical weight equal the HF directory's load, bit for bit, so every promise proved on
the HF fixture holds for the GGUF. A gate run on the GGUF checks the path end to end.
"""

from __future__ import annotations

import dataclasses

import gguf
import pytest
import torch

from conftest import gguf_file, hf_dir
from gguf_edit import rewrite_gguf
from memra.errors import ConfigError
from memra.gate import run_battery
from memra.loading.checkpoint import load_weights
from memra.tokenizer import Tokenizer

WINDOW = 16
ARCHS = ["gemma4", "step3p5"]
cpu = torch.device("cpu")


@pytest.mark.parametrize("arch", ARCHS)
def test_config_and_weights_equal_the_hf_directorys(arch):
    cfg_gguf, w_gguf, _ = load_weights(gguf_file(f"{arch}-f32"), cpu, torch.float32)
    cfg_hf, w_hf, _ = load_weights(hf_dir(arch), cpu, torch.float32)
    # GGUF stores eps as float32 (1e-5 reads back as 9.99999975e-06); the norm computes in fp32, same value there
    assert torch.tensor(cfg_gguf.norm_eps, dtype=torch.float32) == torch.tensor(cfg_hf.norm_eps, dtype=torch.float32)
    assert dataclasses.replace(cfg_gguf, norm_eps=cfg_hf.norm_eps) == cfg_hf
    assert sorted(w_gguf) == sorted(w_hf)
    differ = [k for k in w_hf if not torch.equal(w_gguf[k], w_hf[k])]
    assert not differ, differ


@pytest.mark.parametrize("arch", ARCHS)
def test_gate_all_green_on_the_gguf_past_the_window(arch, load_model):
    lines: list[str] = []
    model = load_model(gguf_file(f"{arch}-f32"))
    assert run_battery(model, steps=4, batch=3, mode="config", plen=WINDOW + 8, out=lines.append), "\n".join(lines)
    assert lines[-1].startswith("ALL GREEN")


def test_the_gemma4_gguf_carries_a_gemma4_vocabulary():
    tok = Tokenizer.from_gguf(gguf_file("gemma4-f32"))
    text = "ROMEO: But soft,  what light\n\nthrough yonder window breaks?"
    ids = tok.encode(text, add_special=True)
    assert ids[0] == tok.bos_id == 2 and tok.decode(ids[1:]) == text and "Gemma 4" in tok.summary()


U32 = gguf.GGUFValueType.UINT32


@pytest.mark.parametrize("name, key, value, message", [
    ("gemma4", "gemma4.expert_count", (4, U32), "Gemma 4 with experts"),
    ("step3p5", "step35.expert_gating_func", (1, U32), "without sigmoid routing"),
    ("step3p5", "step35.attention.head_count_kv", ([2, 1, 2, 2], gguf.GGUFValueType.ARRAY, U32), "differ across layers"),
])
def test_what_memra_does_not_run_is_refused_in_one_line(tmp_path, name, key, value, message):
    out = rewrite_gguf(gguf_file(f"{name}-f32"), tmp_path / "edited.gguf", meta={key: value})
    with pytest.raises(ConfigError, match=message) as err:
        load_weights(out, cpu, torch.float32)
    assert "\n" not in str(err.value)
