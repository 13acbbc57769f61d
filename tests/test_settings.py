"""Settings are read once, at load (memra.settings): the environment changing afterwards changes
nothing, bad door values are refused when read, and a second mode is a view of the same weights."""

from __future__ import annotations

import pytest
import torch

import memra
from conftest import hf_dir
from memra.errors import MemraError
from memra.settings import DOORS, Settings


def test_every_door_is_parsed_with_its_default_and_refused_by_name():
    s = Settings.from_env({})
    assert s == Settings() and s.exact and s.cuda_graphs and s.decode_plan == "auto" and s.pp_doors == ()
    env = {"MEMRA_EXACT": "0", "MEMRA_TRITON": "off", "MEMRA_GDN_KERNEL": "false", "MEMRA_SAMPLE_KERNEL": "0",
           "MEMRA_CUDA_GRAPHS": "no", "MEMRA_DECODE_PLAN": "Row", "MEMRA_GATE_SEED": "7", "MEMRA_GATE_CANARY": "1",
           "MEMRA_PP_STAGES": "2", "MEMRA_PRIME_PIPE": "0", "MEMRA_MIXED_TOKENS": "2048", "HOME": "/root"}
    s = Settings.from_env(env)
    assert (s.exact, s.triton, s.gdn_kernel, s.sample_kernel, s.cuda_graphs) == (False,) * 5
    assert s.decode_plan == "row" and s.gate_seed == 7 and s.gate_canary and s.mixed_tokens == 2048
    assert s.pp_env == {"MEMRA_PP_STAGES": "2", "MEMRA_PRIME_PIPE": "0"}  # the pipeline's doors, for its parser
    assert Settings.from_env(s.as_env()) == s  # what as_env writes reads back the same
    for name, bad in (("MEMRA_EXACT", "maybe"), ("MEMRA_GATE_SEED", "x"), ("MEMRA_DECODE_PLAN", "sideways"),
                      ("MEMRA_MIXED_TOKENS", "768"), ("MEMRA_MIXED_TOKENS", "big")):
        with pytest.raises(MemraError, match=name):
            Settings.from_env({name: bad})
    with pytest.raises(MemraError, match="not a door"):
        s.with_doors(MEMRA_NO_SUCH_DOOR="1")
    # the cuBLAS door's default follows MEMRA_LINEAR_SHAPED's, through with_doors as through the environment
    shaped = Settings().with_doors(MEMRA_LINEAR_SHAPED="1")
    assert shaped.linear_shaped and not shaped.linear_cublas and Settings.from_env(shaped.as_env()) == shaped
    assert not Settings().with_doors(MEMRA_LINEAR_CUBLAS="0").linear_cublas
    with pytest.raises(MemraError, match="MEMRA_LINEAR_CUBLAS=1 and MEMRA_LINEAR_SHAPED=1"):
        Settings().with_doors(MEMRA_LINEAR_SHAPED="1", MEMRA_LINEAR_CUBLAS="1")
    named = " ".join(d[0] for d in DOORS)
    for door in ("MEMRA_EXACT", "MEMRA_TRITON", "MEMRA_GDN_KERNEL", "MEMRA_SAMPLE_KERNEL", "MEMRA_CUDA_GRAPHS",
                 "MEMRA_DECODE_PLAN", "MEMRA_GATE_SEED", "MEMRA_GATE_CANARY", "MEMRA_API_KEY", "MEMRA_PP_STAGES"):
        assert door in named


def test_the_environment_after_load_changes_nothing(monkeypatch):
    model = memra.load(hf_dir("llama"), tokenizer=False)
    c = model.new_cache(16)
    before = model.prime([1, 2, 3], c)
    for door, value in (("MEMRA_EXACT", "0"), ("MEMRA_PP_STAGES", "2"), ("MEMRA_DECODE_PLAN", "bogus")):
        monkeypatch.setenv(door, value)
    assert model.settings == Settings()  # read once, at load
    c2 = model.new_cache(16)
    assert torch.equal(model.prime([1, 2, 3], c2), before)
    assert torch.equal(model.decode_step_batch([4], [c])[0], model.decode_step_batch([4], [c2])[0])


def test_a_view_with_other_doors_shares_the_weights():
    model = memra.load(hf_dir("qwen3_5"), tokenizer=False, settings=Settings())
    fast = model.with_doors(MEMRA_EXACT="0")
    assert model.settings.exact and model.ops.exact and not fast.settings.exact and not fast.ops.exact
    assert fast.embed is model.embed and fast.blocks[0].mixer.w_in is model.blocks[0].mixer.w_in
    assert model.with_doors(MEMRA_EXACT="1") is model  # nothing changes: the model itself


def test_the_readme_lists_every_door_with_its_default():
    """docs/SETTINGS.md's table of doors is settings.DOORS; a door added in code without a line there fails."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "docs" / "SETTINGS.md").read_text()
    for name, default, meaning in DOORS:
        assert f"| `{name}` | {default} | {meaning} |" in readme, name
