"""The exactness gates on the GPU, as a user runs them (`memra gate MODEL --mode ... --device cuda`), and
speculation through memra.LLM: what tools/gpu_check_new_arms.sh printed, now pass/fail.

Each gate exits 0 only when every arm is green with its liveness counters; the canary runs prove the same
arms can fail there. Run through the device tool: MEMRA_TEST_DEVICE=cuda pytest -o addopts='' -m cuda.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
from pathlib import Path

import pytest

import memra
from conftest import hf_dir, process_doors
from cuda_marks import needs_cuda

pytestmark = needs_cuda
ROOT = Path(__file__).resolve().parent.parent


def gate(*args: str) -> tuple[int, str]:
    """`memra gate ARGS --device cuda` -> (exit code, what it printed)."""
    from memra.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(["gate", *args, "--device", "cuda"])
    return code, buf.getvalue()


@pytest.mark.parametrize("arch", ["qwen3_5", "llama", "qwen3_5_moe"])
def test_prefix_gate_is_green_with_its_load_arm(arch):
    code, out = gate(str(hf_dir(arch)), "--mode", "prefix")
    assert code == 0 and "prefix-load" in out and "ALL GREEN" in out, out


def test_prefix_gate_canary_fails_on_the_gpu():
    with process_doors(MEMRA_GATE_CANARY="1"):
        code, out = gate(str(hf_dir("qwen3_5")), "--mode", "prefix")
    assert code == 1 and "FAILED" in out, out


def test_score_gate_is_green():
    code, out = gate(str(hf_dir("qwen3_5")), "--mode", "score")
    assert code == 0 and "ALL GREEN" in out, out


@pytest.mark.parametrize("arch", ["mistral", "gemma4", "step3p5"])
def test_config_gate_of_the_sliding_window_and_step_models_is_green(arch):
    """Step-3.5's MoE crashed the decode graph's capture (its reference fallback synced the host)."""
    code, out = gate(str(hf_dir(arch)), "--mode", "config", "--plen", "24")
    assert code == 0 and "ALL GREEN" in out, out


def test_nvfp4_config_gate_is_green(tmp_path):
    spec = importlib.util.spec_from_file_location("make_fixture_quant", ROOT / "tools" / "make_fixture_quant.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    made = tool.make_set(tmp_path)
    name = next(n for n in made if "nvfp4" in n)
    code, out = gate(str(made[name]), "--mode", "config")
    assert code == 0 and "ALL GREEN" in out, out


@pytest.mark.parametrize("spec", ["mtp", "ngram"])
def test_speculation_through_llm_gives_plain_decoding_bits(spec):
    prompts = ["ROMEO:", "JULIET:\nO Romeo, Romeo,", "First Citizen:\nBefore we proceed", "KING LEAR:\nBlow, winds,"] * 4
    params = [memra.SamplingParams(max_tokens=48, logprobs=0, temperature=t, seed=i)
              for i, t in enumerate([0.0, 0.8] * 8)]
    with memra.LLM("demo", device="cuda", max_batch=8, max_model_len=256) as llm:
        plain = llm.generate(prompts, params, use_tqdm=False)
    with memra.LLM("demo", device="cuda", max_batch=8, max_model_len=256, speculative=spec) as llm:
        got = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(plain, got):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs
