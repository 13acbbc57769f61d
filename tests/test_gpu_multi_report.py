"""tools/gpu_multi_report.py on a CPU box: its plan names every run the multi-GPU issue asks for, it is
harmless without GPUs, and it reads gate output the way the gates print it."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "tools" / "gpu_multi_report.py"


def run(*args, timeout=120):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def report():
    spec = importlib.util.spec_from_file_location("gpu_multi_report", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up while being defined
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def plan4():
    r = run("--dry-run", "--gpus", "4")
    assert r.returncode == 0, r.stderr
    return r.stdout


def _blocks(plan: str) -> dict[str, str]:
    """Run title -> its block of the plan (header line, arms and commands)."""
    out, title = {}, None
    for line in plan.splitlines():
        if line.startswith("["):
            title = line.split("] ", 1)[1].split("  (", 1)[0]
            out[title] = line + "\n"
        elif title is not None:
            out[title] += line + "\n"
    return out


@pytest.mark.parametrize("devs", ["0,1", "1,0", "0,1,2,3"])
@pytest.mark.parametrize("mode", ["pp", "ppspec"])
def test_plan_has_every_gate_with_peer_and_host_bounce(plan4, devs, mode):
    blocks = _blocks(plan4)
    n = len(devs.split(","))
    primary = devs.split(",")[-1]
    for transport in ("peer", "host bounce"):
        block = blocks[f"gate {mode} {devs} {transport}"]
        assert block.startswith("[RUN]")
        assert f"MEMRA_PP_DEVICES={devs}" in block and f"MEMRA_PP_STAGES={n}" in block
        assert "MEMRA_PEER_PROBE=1" in block and "MEMRA_PP_SHARD=1" in block
        assert ("MEMRA_PP_HOST_BOUNCE=1" in block) == (transport == "host bounce")
        assert f"gate demo --device cuda:{primary} --dtype bfloat16 --mode {mode} --stages {n}" in block


@pytest.mark.parametrize("devs", ["0,1", "1,0", "0,1,2,3"])
def test_plan_has_shard_exactness_and_refusals_per_placement(plan4, devs):
    block = _blocks(plan4)[f"in-process {devs}"]
    for arm in ("shard + memory + probe ladder", "split == unsplit, peer", "split == unsplit, host bounce",
                "refuse: unsplit batched walk", "refuse: unsplit verify", "refuse: peer probe off without host bounce",
                "accept: peer probe off with host bounce (control)"):
        assert f"- {arm}: " in block
    lines = {ln.strip().removeprefix("- ").rsplit(": MEMRA_", 1)[0]: ln for ln in block.splitlines()[1:]}
    assert "MEMRA_BATCH_PP=0" in lines["refuse: unsplit batched walk"]
    assert "MEMRA_PP_ALLOW_UNSPLIT_BATCH" not in lines["refuse: unsplit batched walk"]
    probe_off = lines["refuse: peer probe off without host bounce"]
    assert "MEMRA_PEER_PROBE=0" in probe_off and "MEMRA_PP_HOST_BOUNCE" not in probe_off
    assert "MEMRA_SPEC_PP=0" in lines["refuse: unsplit verify"]


def test_plan_has_the_benchmark_and_the_peer_read_cost(plan4):
    block = _blocks(plan4)["bench PP-2 0,1"]
    for b in (1, 8, 16, 32):
        assert f"- B={b} serial walker: " in block and "MEMRA_DUAL_PP=0" in block
        assert f"- B={b} dual-active waves: " in block
    assert "MEMRA_DUAL_PP=1 MEMRA_PP_OVERLAP=1" in block
    assert "qwen3.5-9b" in block and "MEMRA_PP_DEVICES=0,1" in block
    unsplit = next(ln for ln in block.splitlines() if "unsplit over sharded weights" in ln)
    assert "MEMRA_BATCH_PP=0" in unsplit and "MEMRA_PP_ALLOW_UNSPLIT_BATCH=1" in unsplit


def test_plan_has_the_dist_transport_over_nccl(plan4):
    blocks = _blocks(plan4)
    gate = blocks["dist gate 2 ranks nccl"]
    assert "MEMRA_PP_DIST_BACKEND=nccl" in gate and "MEMRA_PP_DIST_SHARE_GPUS=0" in gate
    assert "-m memra gate demo --device cuda:0 --dtype bfloat16 --mode pp --transport dist --stages 2" in gate
    assert "MEMRA_PP_DEVICES" not in gate  # the dist launcher refuses it
    assert "2 ranks nccl" in blocks["dist B=1 latency"]
    assert "NCCL_NVLS_ENABLE=0" in plan4.splitlines()[0]  # NVLink multicast stays off


def test_two_gpus_plan_skips_the_four_gpu_runs():
    r = run("--dry-run", "--gpus", "2")
    assert r.returncode == 0, r.stderr
    blocks = _blocks(r.stdout)
    for title, block in blocks.items():
        assert block.startswith("[SKIP (needs 4 GPUs") == ("0,1,2,3" in title), title


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="with 2+ GPUs this would run the whole report")
def test_without_two_gpus_it_says_what_it_skipped_and_exits_0():
    r = run()
    assert r.returncode == 0, r.stderr
    assert "needs >= 2 GPUs" in r.stdout
    assert "SKIPPED gate pp 0,1 peer" in r.stdout and "SKIPPED dist gate 2 ranks nccl" in r.stdout


def test_gate_output_is_read_as_the_gates_print_it(report):
    res = lambda rc, text, timed_out=False: report.ChildResult(rc, text, timed_out, 3.0)
    green = "pp mode: ...\narm1 (split == unsplit, batches [1]): PASS\nALL GREEN: batched PP-2 battery\n"
    ok, verdict = report.gate_verdict(res(0, green), 100)
    assert not ok and "ALL GREEN" in verdict and "NOT LOGGED" in verdict  # green needs the probe's PASS line too
    ok, verdict = report.gate_verdict(res(0, "[pp] production-slot peer probe PASS: widths\n" + green), 100)
    assert ok and "probe log PASS" in verdict
    ok, verdict = report.gate_verdict(res(1, "arm2 (unsplit walk): FAIL\narm1 (split): PASS\n"), 100)
    assert not ok and "FAIL arms arm2" in verdict
    ok, verdict = report.gate_verdict(res(1, "Traceback (most recent call last):\nRuntimeError: two devices\n"), 100)
    assert not ok and verdict.startswith("CRASH: RuntimeError: two devices")
    ok, verdict = report.gate_verdict(res(2, "error: PP start refused\n"), 100)
    assert not ok and verdict.startswith("REFUSED")
    ok, verdict = report.gate_verdict(res(-9, "-- B=1\n", timed_out=True), 100)
    assert not ok and verdict.startswith("TIMEOUT after 100s")


def test_dist_gate_needs_nccl_and_a_gpu_per_rank(report):
    text = ("pp dist mode: 2 processes over 8 layers, fence=[0, 4, 8], backend=nccl, timeout=30s\n"
            "  rank 0: stage 0, layers [0, 4), cuda:0, pid 1 (driver)\n  rank 1: stage 1, layers [4, 8), {d}, pid 2\n"
            "ALL GREEN: PP-2 across processes\n")
    ok, verdict = report.dist_gate_verdict(report.ChildResult(0, text.format(d="cuda:1"), False, 1.0), 100)
    assert ok and "rank 0 cuda:0, rank 1 cuda:1" in verdict
    ok, verdict = report.dist_gate_verdict(report.ChildResult(0, text.format(d="cuda:0"), False, 1.0), 100)
    assert not ok and "NOT one GPU per rank" in verdict
