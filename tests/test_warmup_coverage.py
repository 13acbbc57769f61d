"""The warm-up's promise on a GPU: after `memra.LLM(...)` (or `memra serve`) has warmed up, no request
makes Triton compile. A compile after the warm-up stalls every row of the step that meets it (a Qwen
serve run once paid 522 ms in its first step, a 64-prompt prefill). Bursts of several widths (more
prompts than a captured mixed step takes, a lone prompt, widths that change the tables' alignment)
and every sampling kind, in a fresh process so that no earlier test has compiled anything for it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import hf_dir
from cuda_marks import cuda_only

SCRIPT = """
import sys
import memra
from memra import counters
from memra.sampling import SamplingParams

llm = memra.LLM(sys.argv[1], device="cuda", max_batch=16, max_ctx=256)
before = counters.snapshot()
vocab = llm.model.cfg.vocab_size
params = [SamplingParams(max_tokens=6), SamplingParams(max_tokens=9, temperature=0.8, seed=1),
          SamplingParams(max_tokens=7, temperature=0.7, top_k=20, top_p=0.9, seed=2)]
for n, seed in ((16, 1), (5, 2), (1, 3), (12, 4), (3, 5), (8, 6)):
    prompts = [[(seed * 131 + 7 * i + 3 * j) % vocab for j in range(3 + (5 * i + seed) % 40)] for i in range(n)]
    llm.generate(prompts, [params[i % 3] for i in range(n)])
print("compiles", counters.delta(before)["kernel_compiles"])
"""


@cuda_only
@pytest.mark.parametrize("arch", ["llama", "qwen3_5"])
def test_no_request_compiles_a_kernel_after_the_warm_up(arch):
    run = subprocess.run([sys.executable, "-c", SCRIPT, str(hf_dir(arch))], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    line = [x for x in run.stdout.splitlines() if x.startswith("compiles")][-1]
    assert line == "compiles 0", line
