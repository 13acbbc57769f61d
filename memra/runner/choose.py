"""The executor of a loaded model, chosen once, at load: the in-process pipeline where the model's
PP doors open it (placement, sharding and the boundary probes happen here, memra.pp.executor), else
every layer unsplit. A process-per-stage pipeline is started by memra.pp.dist, which loads the model
with the in-process fence shut and drives its stages itself (memra.pp.dist_driver.DistPipeline)."""

from __future__ import annotations

from memra.pp.executor import build_pipeline
from memra.runner.executor import Executor, UnsplitExecutor


def choose_executor(model) -> Executor:
    pipeline = build_pipeline(model)
    return pipeline if pipeline is not None else UnsplitExecutor(model)
