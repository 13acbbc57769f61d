"""The pipeline across GPUs (what tools/gpu_multi_report.py used to run, now pass/fail). Needs >= 2 CUDA
devices (the 0,1,2,3 placement >= 4): on one GPU every test here skips. Run on a multi-GPU machine:

    MEMRA_TEST_DEVICE=cuda python -m pytest -o addopts='' -m "cuda and not slow" tests/test_cuda_multi.py

For every placement (0,1 / 1,0 / 0,1,2,3; the model on the LAST stage's device, made the current CUDA
device, as the pipeline's head lives there), weights sharded per stage (MEMRA_PP_SHARD=1), the boot
peer probe on (MEMRA_PEER_PROBE=1):

- `memra gate demo --mode pp` and `--mode ppspec`, over the native peer copy and over host bounce: ALL
  GREEN, the probe's lines all PASS, peer copies counted iff the peer transport was asked for;
- the shard: every stage's layer tensors on its own GPU, the embedding with stage 0, the head, final
  norm and MTP with the last; one boot probe per cross-device boundary; the ladder re-run by hand clean;
- the refusals: the unsplit batched walk (MEMRA_BATCH_PP=0), the same under host bounce even with
  MEMRA_PP_ALLOW_UNSPLIT_BATCH=1, the unsplit verify (MEMRA_SPEC_PP=0), and MEMRA_PEER_PROBE=0 without
  host bounce each raise PipelineError with no cache moved; MEMRA_PEER_PROBE=0 with host bounce runs
  (the control) and counts the bypass.

And across processes, rank r on cuda:r over NCCL: `memra gate demo --mode pp --transport dist` ALL GREEN,
and B=1 greedy tokens equal to one process's (graphs on and eager).

NVLink multicast stays off in this process and every rank it starts (NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1). Timings (serial vs dual-active waves, the
peer-read cost of an unsplit walk, the per-token cost of the process boundary): tools/gpu_profile_pp.py.
"""

from __future__ import annotations

import re

import pytest
import torch

import memra
from conftest import greedy, process_doors
from cuda_marks import needs_gpus
from memra import counters
from memra.pp.fence import PipelineError
from memra.pp.walk import active_runtime

SAFETY_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
PLACEMENTS = [pytest.param((0, 1), id="0,1", marks=needs_gpus(2)), pytest.param((1, 0), id="1,0", marks=needs_gpus(2)),
              pytest.param((0, 1, 2, 3), id="0,1,2,3", marks=needs_gpus(4))]
PROBE_LINE = re.compile(r"\bprobe (PASS|PARTIAL|SKIP|BOUNCE)\b")  # "[pp] production-slot probe PASS: ..."
RANK_LINE = re.compile(r"rank (\d+): stage \d+, layers \[\d+, \d+\), (cuda(?::\d+)?|cpu)")

pytestmark = needs_gpus(2)


@pytest.fixture(autouse=True)
def no_multicast():
    with process_doors(**SAFETY_ENV):
        yield


def pp_doors(devs: tuple[int, ...], host_bounce: bool = False, probe: bool = True, **extra: str) -> dict[str, str]:
    """N stages on `devs`, weights sharded per stage, the boot probe on (or off)."""
    d = {"MEMRA_PP_STAGES": str(len(devs)), "MEMRA_PP_DEVICES": ",".join(map(str, devs)), "MEMRA_PP_SHARD": "1",
         "MEMRA_PEER_PROBE": "1" if probe else "0"}
    if host_bounce:
        d["MEMRA_PP_HOST_BOUNCE"] = "1"
    return {**d, **extra}


def load_demo(device: str):
    return memra.load("demo", device=device, dtype="bfloat16", tokenizer=False)


@pytest.mark.parametrize("transport", ["peer", "host_bounce"])
@pytest.mark.parametrize("mode", ["pp", "ppspec"])
@pytest.mark.parametrize("devs", PLACEMENTS)
def test_gate_across_gpus(devs, mode, transport, capsys):
    """`MEMRA_PP_DEVICES=... memra gate demo --device cuda:LAST --mode pp|ppspec`, in this process."""
    from memra.cli import main

    primary = devs[-1]
    before = counters.snapshot()
    with process_doors(**pp_doors(devs, host_bounce=transport == "host_bounce")), torch.cuda.device(primary):
        code = main(["gate", "demo", "--device", f"cuda:{primary}", "--dtype", "bfloat16", "--mode", mode,
                     "--stages", str(len(devs))])
    out, err = capsys.readouterr()
    assert code == 0 and "ALL GREEN" in out, out + err
    probes = PROBE_LINE.findall(out + err)
    assert probes and all(p == "PASS" for p in probes), f"probe log {probes}\n{err}"
    peer_copies = counters.delta(before)["pp_peer_boundary_copies"]
    assert (peer_copies > 0) == (transport == "peer"), f"peer boundary copies +{peer_copies} over {transport}"


def tensors_of(obj, seen: set[int] | None = None):
    """Every tensor reachable from obj through attributes, lists, tuples and dicts (a superset of what the
    shard moves, so a tensor it forgets shows up as misplaced)."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
        return
    if isinstance(obj, dict):
        items = list(obj.values())
    elif isinstance(obj, (list, tuple)):
        items = list(obj)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        items = list(vars(obj).values())
    else:
        return
    for item in items:
        yield from tensors_of(item, seen)


@pytest.mark.parametrize("devs", PLACEMENTS)
def test_shard_and_boot_probe(devs, capsys):
    from memra.pp.probe import probe_boundary

    primary = devs[-1]
    with torch.cuda.device(primary):
        before = counters.snapshot()
        split = load_demo(f"cuda:{primary}").with_doors(**pp_doors(devs))
        rt = active_runtime(split)
        probes = counters.delta(before)["pp_peer_probes"]
        cross = [bd.index for bd in rt.boundaries if bd.cross]
        assert [str(st.device) for st in rt.stages] == [f"cuda:{d}" for d in devs]
        assert len(cross) == sum(a != b for a, b in zip(devs, devs[1:])) and probes == len(cross)
        owners = [(f"stage {st.index}", st.device, split.blocks[st.layers[0]:st.layers[1]]) for st in rt.stages]
        owners += [("embed", rt.stages[0].device, [split.embed]),
                   ("head, final norm, mtp", rt.stages[-1].device, [split.lm_head, split.final_norm, split.mtp])]
        misplaced = {name: sorted({str(t.device) for t in tensors_of(objs) if t.device != dev})
                     for name, dev, objs in owners}
        assert not any(misplaced.values()), f"tensors off their stage's device: {misplaced}"
        for b in cross:  # the ladder again, by hand: every byte through the production slots
            assert probe_boundary(rt, b).mismatches == 0
    _, err = capsys.readouterr()
    assert PROBE_LINE.findall(err) and set(PROBE_LINE.findall(err)) == {"PASS"}, err


REFUSALS = {
    "unsplit batched walk": (dict(MEMRA_BATCH_PP="0"), "batch"),
    "unsplit walk under host bounce, override set": (dict(host_bounce=True, MEMRA_BATCH_PP="0",
                                                          MEMRA_PP_ALLOW_UNSPLIT_BATCH="1"), "batch"),
    "unsplit verify": (dict(MEMRA_SPEC_PP="0"), "verify"),
    "peer probe off without host bounce": (dict(probe=False), "batch"),
}


def primed(model, n: int = 2):
    rt = active_runtime(model)
    caches = [(rt.new_cache(48) if rt is not None else model.new_cache(48)) for _ in range(n)]
    for i, c in enumerate(caches):
        model.prime([(11 + 7 * i + 3 * j) % model.cfg.vocab_size for j in range(10)], c)
    return caches


@pytest.mark.parametrize("refusal", list(REFUSALS))
@pytest.mark.parametrize("devs", PLACEMENTS)
def test_refusal(devs, refusal):
    """Each must raise PipelineError — when the placement is built, or at the step, with no cache moved;
    running anyway is the failure."""
    doors, action = REFUSALS[refusal]
    primary = devs[-1]
    with torch.cuda.device(primary):
        base = load_demo(f"cuda:{primary}")
        caches, pos = [], None
        try:
            model = base.with_doors(**pp_doors(devs, **doors))
            caches = primed(model)
            pos = [c.pos for c in caches]
            if action == "batch":
                model.decode_step_batch([5, 6], caches)
            else:
                model.decode_step_t([5, 6], caches[0].pos, caches[0])
        except PipelineError as err:
            assert pos is None or [c.pos for c in caches] == pos, f"refused ({err}) but a cache moved"
            return
    pytest.fail(f"{refusal}: ran instead of refusing")


@pytest.mark.parametrize("devs", PLACEMENTS)
def test_peer_probe_off_with_host_bounce_runs_and_counts_the_bypass(devs):
    primary = devs[-1]
    with torch.cuda.device(primary):
        before = counters.snapshot()
        model = load_demo(f"cuda:{primary}").with_doors(**pp_doors(devs, host_bounce=True, probe=False))
        caches = primed(model)
        rows = model.decode_step_batch([5, 6], caches)
    assert rows.shape == (2, model.cfg.vocab_size)
    assert counters.delta(before)["pp_peer_probe_bypassed"] == 1


NCCL = {"MEMRA_PP_DIST_BACKEND": "nccl", "MEMRA_PP_DIST_SHARE_GPUS": "0", "MEMRA_PP_DIST_START_TIMEOUT_S": "180"}


def test_dist_gate_over_nccl_one_gpu_per_rank(capsys):
    from memra.cli import main

    with process_doors(**NCCL), torch.cuda.device(0):
        code = main(["gate", "demo", "--device", "cuda:0", "--dtype", "bfloat16", "--mode", "pp", "--transport", "dist",
                     "--stages", "2"])
    text = capsys.readouterr().out
    assert code == 0 and "ALL GREEN: PP-2 across processes" in text, text
    assert "backend=nccl" in text
    assert dict(RANK_LINE.findall(text)) == {"0": "cuda:0", "1": "cuda:1"}, text


@torch.inference_mode()
def test_dist_tokens_over_nccl_equal_one_process():
    from memra.pp.dist import launch_local

    with torch.cuda.device(0):
        model = load_demo("cuda:0")
        prompt = [(7 + 31 * j) % model.cfg.vocab_size for j in range(16)]
        graphed = greedy(model, prompt, n=32)
        eager = greedy(model.with_doors(MEMRA_CUDA_GRAPHS="0"), prompt, n=32)
        with process_doors(**NCCL):
            pipe = launch_local(model, 2)  # rank 1 on cuda:0 + 1
        try:
            ranks = dict(RANK_LINE.findall(pipe.description))
            split = greedy(pipe, prompt, n=32)
        finally:
            codes = pipe.shutdown()
    assert ranks == {"0": "cuda:0", "1": "cuda:1"}, pipe.description
    assert graphed == eager == split
    assert codes == {1: 0}
