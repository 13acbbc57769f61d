"""Sliding-window attention (a query at p sees p-W+1..p) on the paged cache, across the window's edge.

The fixture hf/mistral slides a 16-position window on every layer; its HF logits and greedy tokens
(prompts of 25 and 62 tokens, both past the edge) are held in tests/test_models.py, and it runs
through every exactness file that walks HF_ARCHS (E1, E4, E5, the gates, PP). Here: what the config
says, that the window is really applied (a negative control), the gates with prompts past the window
(the reference's window + 8), and the GPU kernels' windowed path in Triton's interpreter.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from conftest import gpu_kernel_table, hf_dir, reference
from memra import counters
from memra.config import from_hf_config
from memra.errors import ConfigError, MemraError
from memra.gate import run_battery
from memra.gate.pp_battery import run_pp_battery
from memra.model.hybrid import HybridModel

WINDOW = 16


def test_configs_name_their_windows():
    base = {"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
            "vocab_size": 100, "intermediate_size": 8}
    assert from_hf_config(base).windows == ()
    cfg = from_hf_config({**base, "use_sliding_window": True, "sliding_window": 32, "max_window_layers": 2})
    assert cfg.windows == (None, None, 32, 32) and "sliding window 32 positions on 2 of 4" in cfg.describe()
    typed = {**base, "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"] * 2}
    assert from_hf_config(typed).windows == (8, None, 8, None)
    mistral = {**base, "model_type": "mistral", "sliding_window": 4096}
    assert from_hf_config(mistral).windows == (4096,) * 4
    assert from_hf_config({**mistral, "sliding_window": None}).windows == ()
    with pytest.raises(ConfigError, match="sliding_window"):
        from_hf_config({**typed, "sliding_window": 0})
    with pytest.raises(ConfigError, match="layer_types"):
        from_hf_config({**typed, "layer_types": ["sliding_attention", "weird"] * 2})


def _global_twin(model) -> HybridModel:
    """The same weights with every layer global: what the model would compute without its window."""
    return HybridModel(dataclasses.replace(model.cfg, windows=()), model._weights, model.device, model.dtype)


def test_the_window_changes_exactly_the_positions_past_its_edge(load_model):
    """Negative control: inside the window the windowed and the global model give the same bits (the
    same keys, the same arithmetic); past it they differ, on prime and on decode."""
    model = load_model(hf_dir("mistral"))
    twin = _global_twin(model)
    ids = reference("mistral")["prompt2"]  # 62 tokens
    ca, cb = model.new_cache(96), twin.new_cache(96)
    a, b = model.prime(ids, ca, all_logits=True), twin.prime(ids, cb, all_logits=True)
    assert torch.equal(a[:WINDOW], b[:WINDOW])
    assert all(not torch.equal(a[t], b[t]) for t in range(WINDOW, len(ids)))
    assert not torch.equal(model.decode_step(5, ca), twin.decode_step(5, cb))


@pytest.mark.parametrize("mode", ["config", "strict"])
def test_gate_all_green_with_prompts_past_the_window(mode, load_model):
    """Rows start inside and beyond the window (plen = W + 8, then +5 per row) at B=1..3."""
    lines: list[str] = []
    model = load_model(hf_dir("mistral"))
    assert run_battery(model, steps=6, batch=3, mode=mode, plen=WINDOW + 8, out=lines.append), "\n".join(lines)
    assert lines[-1].startswith("ALL GREEN")


def test_gate_canary_fails_past_the_window(load_model):
    lines: list[str] = []
    model = load_model(hf_dir("mistral")).with_doors(MEMRA_GATE_CANARY="1")
    assert not run_battery(model, steps=6, batch=3, mode="config", plen=WINDOW + 8, out=lines.append)
    assert lines[-1].startswith("FAILED")


def test_pp_gate_all_green_past_the_window(load_model):
    """Three stages over two layers' model is refused, so PP-2 (every layer its own stage)."""
    lines: list[str] = []
    model = load_model(hf_dir("mistral"))
    ok = run_pp_battery(model, stages=2, batches=[1, 3], steps=4, reps=1, plen=WINDOW + 8, out=lines.append)
    assert ok, "\n".join(lines)


@pytest.mark.parametrize("arch, stages", [("mistral", 2), ("gemma4", 3), ("step3p5", 3)])
def test_ppspec_gate_all_green_past_the_window(arch, stages, load_model):
    """The spec verify through the stage split, prompt and verify columns past the window (E4 with PP)."""
    from memra.gate.ppspec_battery import run_ppspec_battery

    lines: list[str] = []
    model = load_model(hf_dir(arch))
    ok = run_ppspec_battery(model, stages=stages, ts=(2, 5), rounds=4, reps=1, plen=WINDOW + 8, out=lines.append)
    assert ok, "\n".join(lines)
    assert any(line.startswith("spec stream PASS") for line in lines)


def test_ppspec_gate_canary_fails_past_the_window(load_model):
    from memra.gate.ppspec_battery import run_ppspec_battery

    lines: list[str] = []
    model = load_model(hf_dir("gemma4")).with_doors(MEMRA_GATE_CANARY="1")
    assert not run_ppspec_battery(model, stages=2, ts=(3,), rounds=3, reps=1, plen=WINDOW + 8, out=lines.append)


@pytest.mark.parametrize("arch", ["mistral", "gemma4", "step3p5"])
def test_the_batched_prime_walks_the_split_on_a_sliding_window_model(arch, load_model):
    """The prime-batch arm's two liveness counters (the reference's step35 prime batches and splits)
    both advance on a sliding-window model, prompts past the window."""
    split = load_model(hf_dir(arch)).with_doors(MEMRA_EXACT="0", MEMRA_PP_STAGES="2")
    prompts = [[(3 * i + 7 * j + 1) % 1024 for j in range(n)] for i, n in enumerate([WINDOW + 8, 70, 1, 130])]
    before = counters.snapshot()
    logits = split.prime_batch(prompts, [split.new_cache(256) for _ in prompts])
    live = counters.delta(before)
    assert live["prime_batches"] == 1 and live["prime_batch_splits"] == 1
    unsplit = split.with_doors(MEMRA_PP_STAGES=None)
    ref = unsplit.prime_batch(prompts, [unsplit.new_cache(256) for _ in prompts])
    assert all(torch.equal(x, y) for x, y in zip(logits, ref))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the interpreter runs the kernels on CPU")
def test_the_gpu_kernels_window_agrees_with_the_torch_path(monkeypatch):
    """The exact GPU path's windowed kernels (prefill tiles starting inside the window, decode rows cut
    to it, a wave's pieces in one launch) in Triton's interpreter, against the torch path, past the edge."""
    pytest.importorskip("triton")
    from memra.kernels.table import KernelTable
    from memra.loading.checkpoint import load

    plain = load(hf_dir("mistral"), device="cpu", tokenizer=False)
    table = gpu_kernel_table()
    monkeypatch.setattr(KernelTable, "build", classmethod(lambda cls, device, settings: table))
    gpu = plain.with_doors(MEMRA_DECODE_PLAN="row")
    prompts = [[(5 * j + 3) % 1024 for j in range(WINDOW + 8)], [(7 * j + 1) % 1024 for j in range(70)]]
    caches = [[m.new_cache(96) for _ in prompts] for m in (plain, gpu)]
    for p, a, b in zip(prompts, *caches):
        x, y = plain.prime(p, a), gpu.prime(p, b)
        assert ((x - y).abs().max() / x.abs().max()).item() < 2e-5
    for t in (1, 2):
        x, y = (m.decode_step_batch([t, t + 1], c) for m, c in zip((plain, gpu), caches))
        assert ((x - y).abs().max() / x.abs().max()).item() < 2e-5
    solo = [gpu.prime(p, gpu.new_cache(96)) for p in prompts]
    together = gpu.prime_batch(prompts, [gpu.new_cache(96) for _ in prompts])
    assert all(((s - t).abs().max() / s.abs().max()).item() < 2e-5 for s, t in zip(solo, together))


def test_blocks_behind_every_layers_window_go_back_to_the_pool(load_model):
    """Every layer of hf/mistral slides a 16-position window: as decode moves on, the blocks wholly
    before the window return to the pool, and the logits are the bits of a cache that keeps them.
    A snapshot whose window reads a given-back block is refused; reset takes blocks again."""
    from memra.cache import BLOCK_SIZE, new_cache

    model = load_model(hf_dir("mistral"))
    assert model.cfg.window(0) == WINDOW and all(model.cfg.windows)
    prompt = reference("mistral")["prompt2"]  # 62 tokens
    kept, dropped = new_cache(model.cfg, 200, model.dtype, model.device), model.new_cache(200)
    kept.kv.window = None  # a pool of its own that never gives blocks back: the same arithmetic, every block held
    assert dropped.kv.window == WINDOW
    model.prime(prompt, kept)
    model.prime(prompt, dropped)
    snap = dropped.snapshot()
    before = counters.snapshot()
    for t in range(100):
        a, b = model.decode_step(5 + t, kept), model.decode_step(5 + t, dropped)
        assert torch.equal(a, b)
    held = [b for b in dropped.blocks if b >= 0]
    assert counters.delta(before)["kv_window_released_blocks"] == len(dropped.blocks) - len(held) > 0
    assert len(held) <= -(-WINDOW // BLOCK_SIZE) + 2 and not set(held) & set(dropped.kv.free)
    with pytest.raises(MemraError, match="given back"):
        dropped.restore(snap)
    dropped.reset()
    assert all(b >= 0 for b in dropped.blocks) and len(set(dropped.blocks)) == len(dropped.blocks)
    assert torch.equal(model.prime(prompt, dropped), model.prime(prompt, model.new_cache(200)))


def test_a_model_with_a_global_layer_keeps_every_block(load_model):
    """Gemma 4 mixes global layers in: no position ever leaves every layer's window."""
    model = load_model(hf_dir("gemma4"))
    c = model.new_cache(128)
    model.prime(reference("gemma4")["prompt2"], c)
    for t in range(30):
        model.decode_step(t + 3, c)
    assert c.kv.window is None and all(b >= 0 for b in c.blocks)
