"""What a CPU model holds in host memory beyond its weights (issue 48: `memra bench model --gguf` reports the
peak RSS as a multiple of the file). Each test pins one cause of a past overshoot by its mechanism, not by a
timed or RSS figure:
- recurrent slots are handed out lowest first, so a released slot is reused before an untouched one is made
  resident (a warm-up's sequence and the first request once touched two 18 MiB slots of Qwen3.5-0.8B);
- a CPU engine takes no scratch slot for the CUDA graphs' inert rows (it zeroed one that nothing read);
"""

from __future__ import annotations

import torch

import memra
from conftest import hf_dir
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

