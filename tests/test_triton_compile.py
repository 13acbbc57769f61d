"""Every Triton kernel memra launches, in every variant its loaders and plans choose, compiled by Triton's
real compiler for Hopper (sm_90) and Ampere (sm_80), on a machine with no GPU. CI's CPU suite runs the
kernels in Triton's interpreter, which accepts code the compiler refuses (7f3a875's prefill kernel named
an int32 and then a [64, 64] bool `seen`: no model loaded on CUDA); this test fails on such a kernel.

Where the variants come from: the models themselves, not a list. tests/triton_launches.py runs every
fixture model (tests/fixtures/hf/*, in each dtype the loader takes) through the engine on CPU as a GPU
serves it (prefill waves of several prompts' pieces, stacked decode, mixed steps, sampled and filtered
rows), the model API's solo prime and decode, random-weight models for the shapes the fixtures lack
(a context past ATTN_SPLIT, a wave past the last M bucket, an MoE decode on the per-pair plan, an MoE
FFN without its residual as Gemma's sandwich norms call it), the dense linears' epilogues and a model's
waves again with MEMRA_LINEAR_PERSISTENT=1 (the persistent kernel's table), the shaped linear's table
(MEMRA_LINEAR_SHAPED=1) on a weight it gives other tiles, the batch sampler and the RoPE as
MEMRA_SAMPLE_SPLIT=1 and MEMRA_ROPE_TILE=1 launch them, and every packed layout in
memra.kernels.split.SPLIT_TYPES through the table's linear. Each kernel-table op
is answered twice: first recorded as a CUDA model's table would launch it -- each family's launcher
computing tiles, buckets, splits and flags as on a GPU (`_interpreting()` answers False), each kernel
launch kept (argument types as Triton specializes them, constexprs, options) and not run -- then by the
pure-torch twin, whose values the model goes on with. So a new kernel, flag or tile bucket is compiled
as soon as a model path launches it, with no one listing it. Why not record the interpreter's own
launches: the launchers choose other constexprs under the interpreter (one tile for every M, IEEE dots,
no libdevice), so those are not the kernels a GPU compiles; and running the models at the twin's speed
keeps the collection to seconds.

What makes it fail, besides a kernel that does not compile (or asks for more shared memory than the
GPU gives a block): a @triton.jit function in memra that no collected launch compiles (neither
launched nor called by a launched kernel), and a boolean constexpr of a launched kernel compiled one
way only (a path the drive no longer reaches), but for the values a GPU never chooses (GPU_NEVER).

Budget: the collected launches make some 270 variants per target, ~550 compiles to a cubin, minutes of
CPU (a K-quant or IEEE-dot tile takes seconds, GDN's chunk prep for sm_80 tens). The default run sends
every variant through Triton's code generator for both targets (where an interpreter-only kernel is
refused: it types the kernel; the 7f3a875 fault fails there) and each kernel's first variant on to a
cubin (the backends, ptxas and the shared-memory limit, once per kernel); the `slow` test takes every
variant to a cubin. Compiles run in a worker process without TRITON_INTERPRET (under it every
@triton.jit is an interpreted function the compiler cannot take), over the CPUs this process may use,
with Triton's cache in the test's temporary directory.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

from conftest import FIXTURES  # noqa: E402

from memra.kernels.triton.linear_persistent import PERSISTENT_CONFIG  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TARGETS = (90, 80)  # sm_90 (H100 / H200), sm_80 (A100)
# Boolean constexprs a GPU never takes one way, with why; every other one must be compiled both ways.
GPU_NEVER = {
    ("LIBDEVICE", False): "libdevice is off only under the interpreter, which has none",
    ("ROUND_IN_INTEGERS", True): "bf16 rounding in integers is for the interpreter, whose cast truncates",
    ("FLATTEN", not PERSISTENT_CONFIG[6]): "a tuning choice frozen in linear_persistent.PERSISTENT_CONFIG (it moves "
                                            "no bits; tools/gpu_tune_linear.py times both)",
}


def _collect() -> list:
    import torch

    import memra
    from memra.kernels.table import KernelTable
    from memra.loading.checkpoint import _DTYPES

    import triton_launches as tl

    launches = tl.Launches()
    table = tl.recording_table(launches)
    persistent = tl.recording_table(launches, persistent_linear=True)  # MEMRA_LINEAR_PERSISTENT=1's table
    shaped = tl.recording_table(launches, shaped_linear=True)  # MEMRA_LINEAR_SHAPED=1's
    with pytest.MonkeyPatch.context() as mp, tl.self_test_passed():
        mp.setattr(KernelTable, "build", classmethod(
            lambda cls, device, settings: shaped if settings.linear_shaped else
            persistent if settings.linear_persistent else table))
        for dtype in sorted(set(_DTYPES.values()), key=str):
            for path in sorted((FIXTURES / "hf").iterdir()):
                model = memra.load(path, device="cpu", dtype=dtype)
                tl.drive_model(model)
                tl.drive_solo(model)
            long_llama, moe = tl.tiny_models(dtype)
            tl.drive_api(long_llama, (3, 600))
            tl.drive_api(moe, (3, 40))
            tl.drive_solo(moe)
            tl.drive_ffn_alone(moe)
            tl.drive_packed(table, dtype)
            for door in (table, persistent, shaped):
                tl.drive_dense(door, dtype)
            if dtype == torch.bfloat16:  # a model's wave past 256 rows through the door's table
                tl.drive_api(long_llama.with_doors(MEMRA_LINEAR_PERSISTENT="1"), (3, 600))
        tl.drive_doors(tl.recording_table(launches, sample_split=True, rope_tile=True, attn_short_rows=True,
                                          attn_skip_empty=True, moe_fused_act=True, moe_fused_gate=True,
                                          sample_prune=True))  # those doors open
        for short, merge in ((False, False), (True, False), (False, True)):  # walked; MEMRA_ATTN_SHORT_ROWS=1's;
            tl.drive_split_walk(tl.recording_table(launches, attn_skip_empty=True, attn_split_walk=True,  # and
                                                   attn_short_rows=short, attn_walk_combine=merge))  # the merge's
    return launches.records()


def _compile(records: list, tmp: Path, how: str, targets: tuple = TARGETS) -> dict[int, list]:
    """Each target's results (tests/triton_compile_worker.py, in a process without the interpreter)."""
    (tmp / "launches.json").write_text(json.dumps(records))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]), TRITON_CACHE_DIR=str(tmp / "cache"))
    jobs = max(1, min(4, len(os.sched_getaffinity(0))))
    run = subprocess.run([sys.executable, str(REPO / "tests" / "triton_compile_worker.py"), ",".join(map(str, targets)),
                          str(tmp / "launches.json"), str(tmp / "results.json"), str(jobs), how],
                         env=env, capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, f"the compile worker failed:\n{run.stdout[-2000:]}{run.stderr[-3000:]}"
    results = {cap: [] for cap in targets}
    for r in json.loads((tmp / "results.json").read_text()):
        results[r["target"]].append(r)
    return results


@pytest.fixture(scope="module")
def records():
    return _collect()


@pytest.fixture(scope="module")
def compiled(records, tmp_path_factory):
    return records, _compile(records, tmp_path_factory.mktemp("triton_compile"), "quick")


def _why(error: str) -> str:
    """A compile error's own message: the last line that says something (Triton prints the source first)."""
    lines = [ln.strip() for ln in error.splitlines() if ln.strip() and not set(ln.strip()) <= {"^", "~"}]
    return lines[-1] if lines else error


def _all_compiled(records, results, least: int = 40) -> None:
    failed = [f"sm_{cap} {r['kernel']} {r['constexprs']} {sorted(set(r['signature'].values()))}: {_why(r['error'])}"
              for cap, rs in results.items() for r in rs if not r["ok"]]
    assert not failed, f"{len(failed)} kernel variants do not compile:\n" + "\n".join(failed)
    counts = {cap: len(rs) for cap, rs in results.items()}
    cubins = {cap: sum(r["stage"] == "cubin" for r in rs) for cap, rs in results.items()}
    assert len(set(counts.values())) == 1 and counts[TARGETS[0]] >= least, f"variants compiled per target: {counts}"
    print(f"\n{len(records)} distinct launches -> {counts[TARGETS[0]]} kernel variants for each of "
          f"{', '.join(f'sm_{c}' for c in results)} ({cubins[TARGETS[0]]} to a cubin)")


def test_every_launched_variant_compiles_for_hopper_and_ampere(compiled):
    """Every variant through Triton's code generator for both targets (what the interpreter never does:
    type the kernel), and each kernel's first variant all the way to a cubin."""
    _all_compiled(*compiled)


@pytest.mark.slow
def test_every_launched_variant_compiles_to_a_cubin(records, tmp_path_factory):
    """The whole sweep: every variant to a cubin for both targets (minutes; the default run takes the code
    generator for most of them)."""
    _all_compiled(records, _compile(records, tmp_path_factory.mktemp("triton_full"), "full"))


PERSISTENT = "memra.kernels.triton.linear_persistent._linear_persistent_kernel"


@pytest.mark.slow  # 34 s on CI's 2 cores; the quick run still types every variant and compiles the kernel's first
def test_every_persistent_linear_variant_compiles_to_a_cubin(records, tmp_path_factory):
    """The persistent linear's variants differ most in shared memory (TMA's stored tile, the residual's beside
    it, fp32's tiles): each one to an sm_90 cubin, so a variant over the block's limit fails here (the quick run
    takes only a kernel's first variant that far; on sm_80 descriptors lower to plain loads, with no stored
    tile to stage). Recorded with MEMRA_LINEAR_PERSISTENT=1's table."""
    mine = [r for r in records if r[0] == PERSISTENT]
    kinds = {(r[2]["SWIGLU"], r[2]["HAS_BIAS"], r[2]["HAS_RESIDUAL"]) for r in mine}
    assert len(kinds) == 4, f"the drive no longer reaches every epilogue of the persistent linear: {sorted(kinds)}"
    _all_compiled(mine, _compile(mine, tmp_path_factory.mktemp("triton_persistent"), "full", (90,)), least=len(kinds))


def _unreached(defined, results: list) -> list[str]:
    """The @triton.jit functions (qualified names) that no result launched or called."""
    reached = {r["kernel"] for r in results} | {f for r in results for f in r.get("called", ())}
    return sorted(set(defined) - reached)


def _one_way(results: list) -> tuple[list[str], int]:
    """(each boolean constexpr compiled with one value only, but for GPU_NEVER's; how many flags were read)."""
    seen = collections.defaultdict(set)
    for r in results:
        for name, value in r["constexprs"].items():
            if value in ("True", "False"):
                seen[(r["kernel"], name)].add(value == "True")
    one_way = [f"{kernel} {name}={not only} never compiled" for (kernel, name), (only,) in
               ((key, tuple(values)) for key, values in sorted(seen.items()) if len(values) == 1)
               if (name, not only) not in GPU_NEVER]
    return one_way, len(seen)


def test_every_triton_function_in_memra_is_compiled(compiled):
    """A kernel or helper no collected launch reaches is one this test cannot vouch for."""
    from triton_launches import jit_functions

    _, results = compiled
    missing = _unreached(jit_functions(), [r for rs in results.values() for r in rs])
    assert not missing, ("no launch the drive collects compiles these @triton.jit functions (drive their path in "
                         "tests/triton_launches.py): " + ", ".join(missing))


def test_every_boolean_constexpr_is_compiled_both_ways(compiled):
    _, results = compiled
    one_way, flags = _one_way(results[TARGETS[0]])
    assert not one_way, "a flag's other value is no longer reached by any driven path:\n" + "\n".join(one_way)
    assert flags > 10  # liveness: the flags were read off the compiled variants


def test_the_coverage_gates_fail_on_what_they_guard():
    """Canaries: a helper no kernel calls, and a flag compiled one way, are caught (GPU_NEVER's values aside)."""
    results = [{"kernel": "m.k", "called": ["m.helper"], "constexprs": {"PIECES": "True", "LIBDEVICE": "True"}}]
    assert _unreached(["m.k", "m.helper", "m.orphan"], results) == ["m.orphan"]
    assert _one_way(results) == (["m.k PIECES=False never compiled"], 2)
    results.append({"kernel": "m.k", "constexprs": {"PIECES": "False", "LIBDEVICE": "True"}})
    assert _one_way(results) == ([], 2)
