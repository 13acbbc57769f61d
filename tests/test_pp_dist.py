"""Pipeline stages in separate processes (memra.pp.dist): split across processes == unsplit, to the bit.

Real torch.distributed with gloo on localhost: this test process is rank 0 (the driver), the other
ranks are `python -m memra.pp.dist_worker` children. Starting a rank costs ~2 s on a small box, so
the healthy pipelines are module-scoped and shared; tests that break a pipeline (a killed or stopped
worker, a bring-up refusal) start their own small one. Only one process group can live in a process,
so a fixture shuts down the previous pipeline before it starts the next (tests run in file order).
Models are pinned to CPU (gloo), whatever MEMRA_TEST_DEVICE says: NCCL needs one GPU per rank.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from conftest import hf_dir, process_doors
from memra import counters
from memra.errors import ContextOverflowError, MemraError
from memra.gate.pp_battery import run_pp_dist_battery
from memra.pp import dist_wire as wire
from memra.pp import fence as pf
from memra.pp.dist import DistCache, PipelineError, launch_local
from memra.pp.dist_launch import DistConfig, dist_fence, doors_from_env

FAST = dict(batches=(1, 4), steps=4, reps=2, plen=8)
_LIVE: list = []  # the pipeline this module has running (at most one: one process group per process)


def _close_live() -> None:
    while _LIVE:
        _LIVE.pop().shutdown()


def _launch(model, stages: int, **doors):
    _close_live()
    with process_doors(**doors):
        pipe = launch_local(model, stages, keep_full_model=True)
    _LIVE.append(pipe)
    return pipe


def _reaped(pid: int) -> bool:
    """The child is gone and reaped (a zombie keeps its /proc entry until its parent waits on it)."""
    return not os.path.exists(f"/proc/{pid}")


@pytest.fixture(scope="module")
def llama2(load_model):
    pipe = _launch(load_model(hf_dir("llama"), device="cpu"), 2)
    yield pipe
    pipe.shutdown()


@pytest.fixture(scope="module")
def hybrid3(load_model):
    pipe = _launch(load_model(hf_dir("qwen3_5"), device="cpu"), 3, MEMRA_PP_DIST_TIMEOUT_S="10")
    yield pipe
    pipe.shutdown()


# --- no processes: the wire, the fence and the doors ----------------------------------------------------


def test_wire_moves_bytes_unchanged():
    """encode/decode round trip: tensors come back with the sender's exact bytes, in their dtype."""
    h = torch.randn(3, 5).to(torch.bfloat16)
    logits = torch.randn(2, 7)
    msg = wire.Message(wire.Op.VERIFY, cmd=9, flags=wire.Flag.TRAIL | wire.Flag.CANARY, seqs=(4,), positions=(17,),
                       args=(2, -1), tensors=(h, logits), text="rank 1: ok ✓")
    _, size = wire.body_size(msg)
    header, body = torch.zeros(wire.HEADER_WORDS, dtype=torch.int64), torch.zeros(size + 24, dtype=torch.uint8)
    assert wire.encode(msg, 5, 1, header, body) == size
    got = wire.decode(wire.parse_header(header.tolist(), "test"), body[:size])
    assert (got.op, got.cmd, got.flags, got.seqs, got.positions, got.args, got.text) == \
        (msg.op, 9, msg.flags, (4,), (17,), (2, -1), "rank 1: ok ✓")
    assert got.tensors[0].dtype == torch.bfloat16 and torch.equal(got.tensors[0].view(torch.int16), h.view(torch.int16))
    assert torch.equal(got.tensors[1].view(torch.int32), logits.view(torch.int32))
    with pytest.raises(PipelineError, match="magic"):
        wire.parse_header([0] * wire.HEADER_WORDS, "test")


def test_fence_and_door_refusals():
    assert dist_fence(6, 3, {}).bounds == (0, 2, 4, 6)
    assert dist_fence(6, 2, {"MEMRA_PP_SPLITS": "1"}).bounds == (0, 1, 6)
    with pytest.raises(PipelineError, match="one rank runs one stage"):
        dist_fence(6, 2, {"MEMRA_PP_STAGES": "3"})
    with pytest.raises(PipelineError, match="MEMRA_PP_DEVICES"):
        dist_fence(6, 2, {"MEMRA_PP_DEVICES": "0,1"})
    pf.reset_warnings()  # the warning is once per (door, value) and process
    with pytest.warns(pf.PpDoorWarning), pytest.raises(PipelineError, match="no usable stage fence"):
        dist_fence(6, 3, {"MEMRA_PP_SPLITS": "4,2"})
    with pytest.raises(MemraError, match="MEMRA_PP_DIST_TIMEOUT_S"):
        doors_from_env({"MEMRA_PP_DIST_TIMEOUT_S": "soon"})
    with pytest.raises(PipelineError, match="at least 2 ranks"):
        DistConfig(rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1", master_port=1234, backend="gloo")
    cfg = DistConfig.from_env("cpu", {"RANK": "1", "WORLD_SIZE": "3", "MASTER_PORT": "29500"})
    assert (cfg.local_rank, cfg.backend, cfg.timeout_s, cfg.own_store) == (1, "gloo", 30.0, False)


# --- two ranks: llama ----------------------------------------------------------------------------------


def test_gate_all_green_two_ranks(llama2, load_model):
    lines: list[str] = []
    before = counters.snapshot()
    ok = run_pp_dist_battery(load_model(hf_dir("llama"), device="cpu"), 2, out=lines.append, pipeline=llama2, **FAST)
    assert ok, "\n".join(lines)
    assert lines[-1].startswith("ALL GREEN")
    d = counters.delta(before)
    assert d["pp_dist_sends"] > 0 and d["pp_dist_replies"] > 0 and d["pp_dist_prime_pieces"] > 0


def test_canary_fails_the_gate(llama2, load_model):
    lines: list[str] = []
    canary = load_model(hf_dir("llama"), device="cpu").with_doors(MEMRA_GATE_CANARY="1")
    ok = run_pp_dist_battery(canary, 2, out=lines.append, pipeline=llama2, **FAST)
    assert not ok
    assert any(line.startswith("decode (") and line.endswith("FAIL") for line in lines), "\n".join(lines)
    assert any(line.startswith("prime (") and line.endswith("PASS") for line in lines)  # only the canary's arm


def test_generate_loop_takes_the_pipeline_in_place_of_the_model(llama2, load_model):
    """The offline generation loop (seeded sampling) yields the same tokens through the pipeline."""
    from memra.generate import generate_tokens
    from memra.sampling import SamplingParams

    model = load_model(hf_dir("llama"), device="cpu")
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=12)
    prompt = [(11 * i + 5) % model.cfg.vocab_size for i in range(70)]  # two aligned prime pieces
    want = list(generate_tokens(model, prompt, params))  # the model itself: its PP door is shut
    assert list(generate_tokens(llama2, prompt, params)) == want


def test_refusals_move_no_rank(llama2, load_model):
    """Every refusal happens on rank 0 before any rank moves; the pipeline then carries on in step."""
    model = load_model(hf_dir("llama"), device="cpu")
    c = llama2.new_cache(24)
    with pytest.raises(ContextOverflowError):
        llama2.prime(list(range(30)), c)
    with pytest.raises(MemraError, match="outside the vocabulary"):
        llama2.prime([1, model.cfg.vocab_size], c)
    with pytest.raises(PipelineError, match="hidden"):
        llama2.prime([1, 2], c, hidden=True)
    with pytest.raises(MemraError, match="not a cache of this pipeline"):
        llama2.decode_step(1, model.new_cache(8))
    with pytest.raises(MemraError, match="pos0=3"):
        llama2.decode_step_t([1, 2], 3, c)
    assert c.pos == 0
    logits = llama2.prime([5, 6, 7], c)
    ref_c = model.new_cache(24)  # the model itself: its PP door is shut
    assert torch.equal(logits, model.prime([5, 6, 7], ref_c))
    assert torch.equal(llama2.decode_step(8, c), model.decode_step(8, ref_c))
    c.free()
    assert llama2.stats()[1]["sequences"] == 0


def test_orderly_shutdown_leaves_no_zombies(llama2):
    pids = llama2.workers.pids
    assert llama2.shutdown() == {1: 0}
    assert not dist.is_initialized()
    assert all(_reaped(pid) for pid in pids.values())
    with pytest.raises(PipelineError, match="shut down"):
        llama2.new_cache(8)


# --- three ranks: the hybrid (GDN + attention) ----------------------------------------------------------


def test_gate_all_green_three_ranks_hybrid(hybrid3, load_model):
    lines: list[str] = []
    ok = run_pp_dist_battery(load_model(hf_dir("qwen3_5"), device="cpu"), 3, out=lines.append, pipeline=hybrid3, **FAST)
    assert ok, "\n".join(lines)
    assert "fence=[0, 2, 4, 6]" in lines[0]
    assert any("rank 2 ran" in line for line in lines)


def test_killed_worker_is_a_clear_error_in_bounded_time(hybrid3):
    """SIGKILL the middle rank: the next call raises PipelineError naming what happened, well inside the
    timeout door; later calls refuse at once; shutdown reaps every worker."""
    c = hybrid3.new_cache(32)
    hybrid3.prime([1, 2, 3], c)
    pids = hybrid3.workers.pids
    os.kill(pids[1], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(PipelineError, match="died or was killed|lost its upstream") as err:
        for _ in range(3):  # the first send may still land in the socket before the loss is seen
            hybrid3.decode_step(4, c)
    elapsed = time.monotonic() - t0
    assert elapsed < 12.0, elapsed  # MEMRA_PP_DIST_TIMEOUT_S=10 for this pipeline, and no hang
    assert "pipeline is down" in str(err.value) or "pipeline failed" in str(err.value)
    assert "rank 1" in str(err.value)
    with pytest.raises(PipelineError, match="the pipeline is down"):
        hybrid3.decode_step(4, c)
    codes = hybrid3.shutdown()
    assert codes[1] == -signal.SIGKILL
    assert all(_reaped(pid) for pid in pids.values())
    assert not dist.is_initialized()


# --- pipelines of their own: a hung worker, a bring-up refusal, the CLI --------------------------------


def test_hung_worker_times_out_with_a_clear_error(load_model):
    pipe = _launch(load_model(hf_dir("llama"), device="cpu"), 2, MEMRA_PP_DIST_TIMEOUT_S="2")
    c = pipe.new_cache(16)
    pipe.prime([1, 2, 3], c)
    pid = pipe.workers.pids[1]
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with pytest.raises(PipelineError, match=r"did not answer within 2s"):
            pipe.decode_step(4, c)
        assert time.monotonic() - t0 < 10.0
    finally:
        codes = pipe.shutdown()  # kills the stopped worker
    assert codes == {1: -signal.SIGKILL}
    assert _reaped(pid)


def test_bring_up_refuses_ranks_that_disagree(load_model):
    """Workers given another fence than rank 0's: rank 1 refuses at HELLO, rank 2 relays the refusal,
    launch_local raises it, and every worker is reaped."""
    _close_live()
    with pytest.raises(PipelineError, match=r"rank 1 computed the fence \[0, 1, 5, 6\]"):
        launch_local(load_model(hf_dir("qwen3_5"), device="cpu"), 3, keep_full_model=True, env={"MEMRA_PP_SPLITS": "1,5"})
    assert not dist.is_initialized()


def test_cli_gate_transport_dist(capsys):
    from memra.cli import main

    _close_live()
    code = main(["gate", str(hf_dir("llama")), "--device", "cpu", "--mode", "pp", "--transport", "dist", "--stages", "2",
                 "--steps", "3", "--reps", "1", "--plen", "6", "--batch", "1,3"])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "ALL GREEN: PP-2 across processes" in text and "workers exited {1: 0}" in text


def test_pipeline_is_a_drop_in_cache_api(load_model):
    """DistCache answers what the step API's callers read (pos, max_ctx) and refuses snapshots."""
    pipe = _launch(load_model(hf_dir("llama"), device="cpu"), 2)
    try:
        c = pipe.new_cache(16)
        assert isinstance(c, DistCache) and (c.pos, c.max_ctx) == (0, 16)
        with pytest.raises(PipelineError, match="snapshot"):
            c.snapshot()
        rows, picked = pipe.decode_step_batch_sampled([3], [c], [None])
        assert picked == [None] and rows[0].shape == (pipe.cfg.vocab_size,) and c.pos == 1
    finally:
        assert pipe.shutdown() == {1: 0}
