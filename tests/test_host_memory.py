"""What a CPU model holds in host memory beyond its weights (issue 48: `memra bench model --gguf` reports the
peak RSS as a multiple of the file). Each test pins one cause of a past overshoot by its mechanism, not by a
timed or RSS figure:
- recurrent slots are handed out lowest first, so a released slot is reused before an untouched one is made
  resident (a warm-up's sequence and the first request once touched two 18 MiB slots of Qwen3.5-0.8B);
- a CPU engine takes no scratch slot for the CUDA graphs' inert rows (it zeroed one that nothing read);
- loading a GGUF with its tokenizer does not import jinja2 (only rendering a chat template does).
"""

from __future__ import annotations

import subprocess
import sys

import torch

import memra
from conftest import gguf_file, hf_dir
from memra.cache import RecurrentPool
from memra.engine.engine import Engine, EngineConfig
from memra.sampling import SamplingParams


def test_a_released_slot_is_handed_out_again_before_an_untouched_one():
    cfg = memra.load(hf_dir("qwen3_5"), tokenizer=False).cfg
    pool = RecurrentPool(cfg, 4, torch.float32, "cpu", max_slots=8)
    a, b, c = pool.allocate(), pool.allocate(), pool.allocate()
    assert (a, b, c) == (0, 1, 2)
    pool.release(b)
    pool.release(a)
    assert pool.allocate() == 0 and pool.allocate() == 1  # the oldest-free order would have given slot 3 next
    assert sorted(pool.free) == [3]


def test_a_cpu_engine_zeroes_one_slot_for_its_warm_up_and_its_request_and_none_for_scratch():
    model = memra.load(hf_dir("qwen3_5"), device="cpu", dtype="float32", tokenizer=False)
    engine = Engine(model, EngineConfig(max_batch=1, max_ctx=48))
    rec = engine.backend.rec
    handed: list[int] = []
    allocate = rec.allocate

    def recording() -> int:
        handed.append(allocate())
        return handed[-1]

    rec.allocate = recording
    engine.warm_up()
    done = []
    engine.submit([3, 1, 4, 1, 5], SamplingParams(max_tokens=4, temperature=0.0), done.append)
    engine.run_until_idle()
    assert any(ev.token_id is not None for ev in done)  # the request ran
    assert not model.graph_scratch  # no scratch row taken: graphs (their only user) are CUDA's
    assert len(handed) >= 2 and set(handed) == {0}  # the warm-up's slot, reused by the request
    engine.shutdown(drain_timeout=0.0)


def test_loading_a_gguf_imports_no_jinja2_until_a_chat_template_is_rendered():
    code = ("import sys, memra\n"
            f"m = memra.load({str(gguf_file('qwen3-f32'))!r}, device='cpu')\n"
            "assert m.tokenizer is not None and 'jinja2' not in sys.modules, 'jinja2 imported by the load'\n"
            "if m.tokenizer.chat_template is not None:\n"
            "    m.tokenizer.apply_chat_template([{'role': 'user', 'content': 'hi'}])\n"
            "    assert 'jinja2' in sys.modules\n"
            "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
