"""What a CPU model holds in host memory beyond its weights (issue 48: `memra bench model --gguf` reports the
peak RSS as a multiple of the file). Each test pins one cause of a past overshoot by its mechanism, not by a
timed or RSS figure:
- recurrent slots are handed out lowest first, so a released slot is reused before an untouched one is made
  resident (a warm-up's sequence and the first request once touched two 18 MiB slots of Qwen3.5-0.8B);
- a CPU engine takes no scratch slot for the CUDA graphs' inert rows (it zeroed one that nothing read);
- loading a GGUF with its tokenizer does not import jinja2 (only rendering a chat template does);
- the CPU plan check's few rows (each holds a KV block) still fail a row that depends on the others.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import memra
from conftest import gguf_file, hf_dir
from memra.cache import RecurrentPool
from memra.engine.engine import Engine, EngineConfig
from memra.kernels import cpu_qdot
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


def _packed_dense_model():
    """A 2-layer packed (Q8_0) Llama with the C decode door open: the stacked plan's CPU case."""
    import dataclasses

    import memra.random_model as rm
    from memra.model.hybrid import HybridModel
    from memra.settings import Settings

    cfg = rm._llama(2, 256, 4, 2, 512, 512)
    cfg = dataclasses.replace(cfg, attn=dataclasses.replace(cfg.attn, qk_norm=True))
    w = rm.random_weights(cfg, "cpu", torch.float32, quant="q8_0")
    return HybridModel(cfg, w, torch.device("cpu"), torch.float32, settings=Settings(cpu_decode=True))


@pytest.mark.skipif(cpu_qdot.library() is None, reason="no C++ compiler to build the kernels")
@pytest.mark.parametrize("canary", [None, "batch", "place", "wide"])
def test_the_cpu_plan_check_on_its_few_rows_fails_a_row_that_depends_on_the_others(monkeypatch, canary):
    """memra.decode_plan.verify_plan runs CPU_CHECK_ROWS sequences on CPU (4: each holds a KV block, and at 8
    the check was a small model's peak RSS). Canaries: a row whose bits move with the batch's size, with its
    place in the batch, or only in a batch wider than 2 rows, each fails it; unchanged, it passes (liveness:
    every arrangement's stacked forward ran)."""
    import memra.decode_plan as dp

    model = _packed_dense_model()
    assert dp.cpu_rows_invariant(model)
    honest = dp.decode_stacked
    nudge = {None: lambda rows: 0.0,
             "batch": lambda rows: 1e-3 * torch.full((len(rows), 1), float(len(rows))),
             "place": lambda rows: 1e-3 * torch.arange(len(rows), dtype=torch.float32)[:, None],
             "wide": lambda rows: 1e-3 * float(len(rows) > 2)}[canary]

    widths: list[int] = []

    def stacked(m, ids, caches):
        widths.append(len(caches))
        out = honest(m, ids, caches)
        return out + nudge(out)

    monkeypatch.setattr(dp, "decode_stacked", stacked)
    assert dp.verify_plan(model, "stacked") is (canary is None)
    assert widths[0] == dp.CPU_CHECK_ROWS  # the stacked forward ran, on the check's rows
    if canary is None:
        assert sorted(set(widths)) == [1, dp.CPU_CHECK_ROWS // 2, dp.CPU_CHECK_ROWS]  # every arrangement ran


@pytest.mark.parametrize("slots", [3, 5])
def test_the_plan_check_holds_no_more_sequences_than_the_recurrent_pool_can_hand_out(monkeypatch, slots):
    """A hybrid whose memory budget leaves few recurrent slots (a 35B MoE on an 80 GB card: 18-31) must still
    load: memra.decode_plan.verify_plan holds at most the slots its pool can hand out, not BUCKET sequences
    (a CUDA load raised 'no free recurrent-state slot' from the check). Liveness: the stacked forward ran at
    that width."""
    import memra.decode_plan as dp

    model = memra.load(hf_dir("qwen3_5"), device="cpu", dtype="float32", tokenizer=False)
    rec = model.pools().rec
    rec.max_slots = slots  # what a tight budget leaves
    widths: list[int] = []
    honest = dp.decode_stacked

    def stacked(m, ids, caches):
        widths.append(len(caches))
        return honest(m, ids, caches)

    monkeypatch.setattr(dp, "decode_stacked", stacked)
    for rows in ("CPU_CHECK_ROWS", "FLIN_CHECK_ROWS"):  # ask for as many rows as a GPU's check does
        monkeypatch.setattr(dp, rows, dp.BUCKET)
    dp.verify_plan(model, "stacked")  # its verdict on CPU's torch ops is beside the point here
    assert widths[0] == slots and max(widths) == slots
    assert len(rec.free) == rec.n_slots  # every slot the check took came back
