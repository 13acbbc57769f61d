"""Programmatic dependent launch (MEMRA_PDL, memra.kernels.triton.launch): every lean kernel opens with
common.wait_for_previous(PDL), so none can read or write before the kernel ahead of it has finished; the
door is parsed and decided once per process; and on a GPU, a model's logits and tokens with PDL on are
the bits they are with it off (a launch attribute changes no value)."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import hf_dir
from cuda_marks import cuda_only
from memra.errors import MemraError
from memra.settings import Settings

TRITON_DIR = Path(__file__).resolve().parents[1] / "memra" / "kernels" / "triton"


def _lean_kernels():
    for path in sorted(TRITON_DIR.glob("*.py")):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.FunctionDef) and any(ast.unparse(d) == "lean" for d in node.decorator_list):
                yield path.name, node


def test_every_lean_kernel_waits_for_the_previous_one_first():
    kernels = list(_lean_kernels())
    assert len(kernels) >= 17  # every family's kernels (a new one must open with the wait too)
    for name, fn in kernels:
        params = {a.arg: a for a in fn.args.args}
        assert "PDL" in params and ast.unparse(params["PDL"].annotation) == "tl.constexpr", f"{name}:{fn.name}"
        body = fn.body[1:] if isinstance(fn.body[0], ast.Expr) and isinstance(fn.body[0].value, ast.Constant) else fn.body
        assert ast.unparse(body[0]) == "wait_for_previous(PDL)", f"{name}:{fn.name} reads before it waits"


def test_the_door_is_parsed_off_by_default_and_refused_by_name():
    assert Settings.from_env({}).pdl == "0"  # off until a device run shows it faster
    for raw, want in (("auto", "auto"), ("1", "1"), ("on", "1"), ("0", "0"), ("", "0")):
        assert Settings.from_env({"MEMRA_PDL": raw}).pdl == want
    with pytest.raises(MemraError, match="MEMRA_PDL"):
        Settings.from_env({"MEMRA_PDL": "sometimes"})
    assert Settings.from_env(Settings(pdl="auto").as_env()).pdl == "auto"


def test_the_launch_mode_is_decided_once(monkeypatch):
    pytest.importorskip("triton")
    from memra.kernels.triton import launch

    monkeypatch.setattr(launch, "_pdl", None)
    launch.set_pdl(False)
    launch.set_pdl(False)  # the same decision again: fine
    with pytest.raises(MemraError, match="same MEMRA_PDL"):
        launch.set_pdl(True)
    assert not launch.pdl_on()


_PROBE = """
import hashlib, json, sys, torch, memra
m = memra.load(sys.argv[1], device="cuda")
llm = memra.LLM(m, max_batch=4, max_ctx=256)
outs = llm.generate([[1, 5, 9, 33] * 20, [7] * 70, [2, 3]], [memra.SamplingParams(max_tokens=24, seed=3, temperature=0.9,
                    logprobs=0)] * 3, use_tqdm=False)
from memra.kernels.triton import launch
print(json.dumps({"pdl": launch.pdl_on(), "tokens": [o.outputs[0].token_ids for o in outs],
                  "logprobs": [o.outputs[0].logprobs for o in outs]}))
"""


@cuda_only
@pytest.mark.parametrize("arch", ["llama", "qwen3_5"])
def test_pdl_changes_no_bit_on_the_gpu(arch):
    runs = {}
    for door in ("0", "1"):
        env = {**os.environ, "MEMRA_PDL": door}
        run = subprocess.run([sys.executable, "-c", _PROBE, str(hf_dir(arch))], capture_output=True, text=True,
                             env=env, timeout=600, check=False)
        assert run.returncode == 0, run.stderr[-2000:]
        runs[door] = json.loads(run.stdout.strip().splitlines()[-1])
    assert runs["1"]["pdl"] and not runs["0"]["pdl"]  # the path under test ran
    assert runs["1"]["tokens"] == runs["0"]["tokens"] and runs["1"]["logprobs"] == runs["0"]["logprobs"]
