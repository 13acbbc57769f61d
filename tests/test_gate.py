"""The exactness battery on every fixture architecture, and its canary."""

import os
import subprocess
import sys

import pytest

from conftest import HF_ARCHS, hf_dir
from memra.gate import run_battery


@pytest.mark.parametrize("mode", ["config", "strict"])
@pytest.mark.parametrize("arch", HF_ARCHS)
def test_gate_all_green(arch, mode, load_model):
    lines = []
    assert run_battery(load_model(hf_dir(arch)), steps=6, batch=3, mode=mode, plen=12, out=lines.append), "\n".join(lines)
    assert lines[-1].startswith("ALL GREEN")
    assert sum(line.endswith(": PASS") for line in lines) == 5  # gate1, gate2, gate3, gate4, liveness


@pytest.mark.parametrize("mode", ["config", "strict"])
def test_canary_must_fail(mode, load_model):
    lines = []
    model = load_model(hf_dir("qwen3_5_moe")).with_doors(MEMRA_GATE_CANARY="1")
    assert not run_battery(model, steps=6, batch=3, mode=mode, plen=12, out=lines.append)
    assert "gate1 (" in "\n".join(lines) and any(l.startswith("gate1 (") and l.endswith("FAIL") for l in lines)
    assert any(l.startswith("gate2 (") and l.endswith("FAIL") for l in lines)
    assert any(l.startswith("gate4 (") and l.endswith("FAIL") for l in lines)  # the verify arm sees it too
    assert lines[-1].startswith("FAILED")


def test_gate_seed_varies_prompts_and_cli_exit_codes(tmp_path):
    base = [sys.executable, "-m", "memra", "gate", str(hf_dir("qwen3")), "--steps", "4", "--batch", "2"]
    ok = subprocess.run(base, capture_output=True, text=True, timeout=300, env={**os.environ, "MEMRA_GATE_SEED": "3"})
    assert ok.returncode == 0 and "seed 3" in ok.stdout and "ALL GREEN" in ok.stdout
    bad = subprocess.run(base, capture_output=True, text=True, timeout=300, env={**os.environ, "MEMRA_GATE_CANARY": "1"})
    assert bad.returncode == 1 and "FAILED" in bad.stdout
    door = subprocess.run(base, capture_output=True, text=True, timeout=300, env={**os.environ, "MEMRA_GATE_SEED": "x"})
    assert door.returncode == 2 and "MEMRA_GATE_SEED" in door.stderr and "Traceback" not in door.stderr


def test_pp_gate_cli_exit_codes():
    """`memra gate --mode pp`: ALL GREEN exits 0, the canary exits 1, a bad --batch list is a clear error."""
    base = [sys.executable, "-m", "memra", "gate", str(hf_dir("qwen3_5")), "--mode", "pp", "--stages", "3",
            "--batch", "1,2", "--steps", "3", "--reps", "1", "--plen", "6"]
    ok = subprocess.run(base, capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0 and "ALL GREEN: batched PP-3" in ok.stdout, ok.stdout + ok.stderr
    bad = subprocess.run(base, capture_output=True, text=True, timeout=300, env={**os.environ, "MEMRA_GATE_CANARY": "1"})
    assert bad.returncode == 1 and "arm1 (" in bad.stdout
    junk = subprocess.run(base[:-6] + ["--batch", "1,x"], capture_output=True, text=True, timeout=300)
    assert junk.returncode == 2 and "--batch" in junk.stderr and "Traceback" not in junk.stderr
