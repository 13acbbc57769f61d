"""Pipeline stages in separate processes on ONE GPU (what tools/gpu_pp_dist_report.py used to print, now
pass/fail): both ranks on the same device, over gloo (NCCL needs a GPU per rank: that run is
tests/test_cuda_multi.py).

- `memra gate demo --mode pp --transport dist --stages 2` in bf16: ALL GREEN, every rank on the GPU;
- B=1 greedy decode of a random-weight Qwen3.5-9B-shaped model (bf16, 4 layers) gives the same tokens
  in one process with CUDA graphs on, eager (MEMRA_CUDA_GRAPHS=0), and split over two ranks.

Refusals, timeouts, killed workers and 3-rank pipelines run on CPU in tests/test_pp_dist.py. The per-token
cost of the process boundary: tools/gpu_profile_pp.py --section dist.
"""

from __future__ import annotations

import os
import re

import torch

from conftest import greedy, process_doors
from cuda_marks import needs_cuda
from memra.pp.dist import launch_local
from memra.random_model import random_model

pytestmark = needs_cuda

RANK_LINE = re.compile(r"rank (\d+): stage \d+, layers \[\d+, \d+\), (cuda(?::\d+)?|cpu)")


def one_gpu() -> dict[str, str]:
    """Workers see only the GPU this process calls cuda:0, so every rank lands on it (gloo wraps
    cuda:LOCAL_RANK round-robin over the visible devices), and nothing else is started on other GPUs."""
    first = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0].strip()
    return {"CUDA_VISIBLE_DEVICES": first, "MEMRA_PP_DIST_BACKEND": "gloo", "MEMRA_PP_DIST_SHARE_GPUS": "0",
            "MEMRA_PP_DIST_START_TIMEOUT_S": "180"}


def test_dist_gate_two_ranks_on_one_gpu(capsys):
    from memra.cli import main

    with process_doors(**one_gpu()):
        code = main(["gate", "demo", "--device", "cuda:0", "--dtype", "bfloat16", "--mode", "pp", "--transport", "dist",
                     "--stages", "2"])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "ALL GREEN: PP-2 across processes" in text and "workers exited {1: 0}" in text
    ranks = dict(RANK_LINE.findall(text))
    assert set(ranks) == {"0", "1"} and all(d.startswith("cuda") for d in ranks.values()), ranks


@torch.inference_mode()
def test_two_ranks_give_the_single_process_tokens():
    model = random_model("qwen3.5-9b", "cuda:0", torch.bfloat16, n_layers=4)
    prompt = [(7 + 31 * j) % model.cfg.vocab_size for j in range(16)]
    graphed = greedy(model, prompt, n=24)
    eager = greedy(model.with_doors(MEMRA_CUDA_GRAPHS="0"), prompt, n=24)
    with process_doors(**one_gpu()):
        pipe = launch_local(model, 2)  # rank 0 drops stage 1's layers here: the single-process arms are done
    try:
        split = greedy(pipe, prompt, n=24)
    finally:
        codes = pipe.shutdown()
        del model
        torch.cuda.empty_cache()
    assert graphed == eager, "CUDA graphs changed the greedy tokens"
    assert split == graphed, "two ranks changed the greedy tokens"
    assert codes == {1: 0}
