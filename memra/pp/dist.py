"""Pipeline stages in separate processes (or nodes) over torch.distributed: the driver, on rank 0.

    pipe = launch_local("model.gguf", stages=3)        # this process = rank 0; ranks 1, 2 spawned here
    c = pipe.new_cache(max_ctx=4096)                    # a sequence on every rank (each its own layers)
    logits = pipe.prime(prompt_ids, c)                  # [V], bit-identical to the single-process model's
    logits = pipe.decode_step(tok, c)                   # [V]
    rows = pipe.decode_step_batch([t1, t2], [c1, c2])   # [B, V]
    pipe.shutdown()                                     # workers exit 0, the process group is destroyed

Under torchrun every rank calls `join_from_env(MODEL)`: rank 0 gets the DistPipeline, the other ranks
serve their stage until rank 0 shuts down, then exit (the call raises SystemExit there).

Rank s runs stage s of the fence (memra.pp.fence doors, one rank per stage). Rank 0 is the driver: it
owns the tokenizer and sampling, runs stage 0 itself (embedding + its layers), and sends each command
down the chain; every rank runs its layer range with the step bodies' code (memra.pp.dist_stage) and
passes its boundary activations on as raw bytes (memra.pp.dist_wire); the last rank applies the final
norm and lm_head and returns fp32 logits to rank 0. So split == unsplit, to the bit (E2).

Failure: every wait is bounded (MEMRA_PP_DIST_TIMEOUT_S). A dead, hung or failing rank makes the
current call raise PipelineError naming it; the pipeline is then down and every later call refuses
until it is shut down and started again (a half-advanced pipeline cannot be trusted).
"""

from __future__ import annotations

import atexit
import os

import torch

from memra.errors import MemraError
from memra.pp import fence as pf
from memra.pp.dist_driver import DistCache, DistPipeline
from memra.pp.dist_launch import (
    DistConfig,
    LocalWorkers,
    backend_for,
    dist_fence,
    doors_from_env,
    free_port,
    join_group,
    launcher_world_size,
    leave_group,
    rank_device,
    spawn_workers,
)
from memra.pp.dist_stage import fingerprint, release_foreign_weights
from memra.pp.dist_worker import run_worker
from memra.settings import Settings, process_env

__all__ = ["DistCache", "DistPipeline", "PipelineError", "join_from_env", "launch_local", "pipeline_for_serving"]

PipelineError = pf.PipelineError


def _bring_up(model, cfg: DistConfig, fence: pf.StageFence, workers: LocalWorkers | None,
              keep_full_model: bool) -> DistPipeline:
    """Rank 0, after joining: check every rank (HELLO), then drop what stage 0 never reads."""
    fp = fingerprint(model)
    if model.settings.exact:
        from memra.decode_plan import decode_plan

        try:  # resolve (and memoize) the decode plan while rank 0 still holds every layer: its on-model
            decode_plan(model)  # check walks the whole model, which a trimmed stage cannot
        except MemraError:
            pass  # refused plans are memoized too, and refused again on the first step
    pipe = DistPipeline(model, cfg, fence, workers)
    pipe._hello(fp)
    if not keep_full_model:
        release_foreign_weights(model, fence, 0)
    return pipe


def _refuse_in_process_split(model) -> None:
    if model.executor.n_stages > 1:
        raise PipelineError("this model was loaded with an in-process pipeline (MEMRA_PP_STAGES); a process "
                            "pipeline's rank 0 runs stage 0 only: load it with MEMRA_PP_STAGES unset, or pass "
                            "the model path and let the pipeline load it")


def worker_source(model) -> str:
    """What a worker loads to hold the same model: its checkpoint path, or for a random-weight model
    (memra.random_model, source `random:NAME`) the recipe `random:NAME:LAYERS` that rebuilds it. Weights
    that differ anyway (another seed, a quantized build) are refused at HELLO by the fingerprint."""
    source = str(model.source)
    if source.startswith("random:") and source.count(":") == 1:
        return f"{source}:{model.cfg.n_layers}"
    return source


def launch_local(model, stages: int | None = None, *, device: str | None = None, dtype: str | None = None,
                 keep_full_model: bool = False, env: dict[str, str] | None = None) -> DistPipeline:
    """Rank 0 in this process, ranks 1..stages-1 spawned on this machine (gloo on CPU, NCCL on CUDA
    unless MEMRA_PP_DIST_BACKEND says gloo). `model`: a loaded model (rank 0 uses it; workers load its
    source path) or a path. keep_full_model: rank 0 keeps every layer's weights (the gate computes its
    unsplit reference with them). `env`: extra environment for the workers only."""
    import memra

    if isinstance(model, (str, os.PathLike)):
        model = memra.load(model, device=device, dtype=dtype, settings=Settings.from_env().in_one_process())
    _refuse_in_process_split(model)
    n = stages if stages is not None else int(process_env().get("MEMRA_PP_STAGES") or 0)
    if n < 2:
        raise PipelineError("launch_local needs stages >= 2 (or MEMRA_PP_STAGES)")
    fence = dist_fence(model.cfg.n_layers, n, {**process_env(), "MEMRA_PP_STAGES": str(n)})
    device_type = model.device.type
    cfg = DistConfig(rank=0, world_size=n, local_rank=model.device.index or 0, master_addr="127.0.0.1",
                     master_port=free_port(), backend=backend_for(device_type, process_env()), own_store=True,
                     **doors_from_env())
    workers = spawn_workers(worker_source(model), cfg, device_type, model.dtype, torch.get_num_threads(),
                            {**process_env(), **(env or {})})
    atexit.register(workers.finish, 0.0)  # never leave orphans behind if the caller forgets shutdown()
    try:
        join_group(cfg, watch=workers.exited)
        return _bring_up(model, cfg, fence, workers, keep_full_model)
    except BaseException:
        leave_group()
        workers.finish(0.5)
        raise


def join_from_env(model, device: str | None = None, dtype: str | None = None) -> DistPipeline:
    """torchrun: every rank calls this with the same model path. Rank 0 loads the model (with its
    tokenizer) on cuda:LOCAL_RANK (or `device`) and returns the driver; every other rank serves its
    stage until rank 0 shuts the pipeline down, then raises SystemExit with its exit code."""
    import memra

    kind = torch.device(device).type if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    cfg = DistConfig.from_env(kind)
    dev = torch.device(device) if device is not None and torch.device(device).index is not None else rank_device(kind, cfg)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if cfg.rank != 0:
        path = model if isinstance(model, (str, os.PathLike)) else model.source
        raise SystemExit(run_worker(str(path), cfg, dev, dtype))
    if isinstance(model, (str, os.PathLike)):
        model = memra.load(model, device=dev, dtype=dtype, settings=Settings.from_env().in_one_process())
    _refuse_in_process_split(model)
    fence = dist_fence(model.cfg.n_layers, cfg.world_size)
    join_group(cfg)
    try:
        return _bring_up(model, cfg, fence, None, keep_full_model=False)
    except BaseException:
        leave_group()
        raise


def pipeline_for_serving(model_path: str, pp_size: int, device: str | None = None,
                         dtype: str | None = None) -> DistPipeline:
    """What `memra serve --pp-size N` needs: under torchrun (WORLD_SIZE set) join the launcher's group
    (ranks > 0 serve and exit inside this call); otherwise spawn pp_size - 1 local workers. -> the driver,
    which takes the model's place for the engine's prime / decode_step_batch / new_cache."""
    world = launcher_world_size()
    if world is not None:
        if pp_size not in (0, world):
            raise PipelineError(f"--pp-size {pp_size} but torchrun started {world} ranks; make them agree")
        return join_from_env(model_path, device, dtype)
    return launch_local(model_path, pp_size, device=device, dtype=dtype)
