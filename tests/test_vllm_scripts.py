"""The drop-in promise (issue 46): scripts written as vLLM's offline-inference examples are, with only the
import (`from memra import LLM, SamplingParams`) and the model name ("demo") changed, run unchanged on the
bundled demo -- basic generation, chat, n samples, logprobs, prompt logprobs, structured outputs, prefix
caching and seeds. Each script checks its own outputs (vLLM's fields and types); this runs them all in one
process, as `python script.py` would, and fails on any exception or failed check."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

SCRIPTS = sorted((Path(__file__).parent / "vllm_scripts").glob("*.py"))


def test_every_topic_has_its_script():
    names = {p.stem for p in SCRIPTS}
    assert names >= {"basic", "chat", "n_samples", "logprobs", "prompt_logprobs", "structured_outputs",
                     "prefix_caching", "seeds"}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_vllm_script_runs_unchanged(script, capsys):
    text = script.read_text(encoding="utf-8")
    assert "from memra import LLM" in text and 'model="demo"' in text  # the only two changes from vLLM's
    runpy.run_path(str(script), run_name="__main__")
    assert capsys.readouterr().out.strip()  # it printed its outputs
