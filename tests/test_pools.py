"""The model owns its cache pools (memra.cache.ModelPools): every `new_cache` draws from them, they grow
as sequences need them up to the KV budget, what a cache held comes back when it is freed or dropped,
and any caches of one model decode as one batch — on the GPU, as the CUDA-graphed step."""

from __future__ import annotations

import gc

import pytest
import torch

import memra
from conftest import DEVICE, hf_dir
from memra import counters
from memra.cache import BLOCK_SIZE
from memra.pools import KvBudget, ModelPools
from memra.errors import ContextOverflowError, MemraError


@pytest.fixture
def model():
    return memra.load(hf_dir("qwen3_5"), device=DEVICE, dtype="float32" if DEVICE == "cpu" else "bfloat16",
                      tokenizer=False)


def test_caches_share_the_models_pools_which_grow_on_demand(model):
    caches = [model.new_cache(512) for _ in range(6)]  # more slots than the pool starts with
    pools = model.pools()
    assert all(c.kv is pools.kv and c.rec is pools.rec for c in caches)
    assert len({c.slot for c in caches}) == 6 and pools.rec.n_slots >= 6
    for c in caches:
        model.prime(list(range(1, 500)), c)
    held = sum(len(c.blocks) for c in caches)
    assert held == 6 * -(-499 // BLOCK_SIZE)
    caches[0].free()
    caches[0].free()  # twice is harmless
    del caches[1]
    gc.collect()  # a dropped cache gives back what it held
    assert len(pools.kv.free) == pools.kv.n_blocks - 4 * -(-499 // BLOCK_SIZE) - _scratch(model, pools)
    assert len(pools.rec.free) == pools.rec.n_slots - 4 - (1 if model.graph_scratch else 0)


def _scratch(model, pools) -> int:
    return 1 if (id(pools.kv), id(pools.rec)) in model.graph_scratch else 0


def test_the_budget_bounds_the_pools():
    cfg = memra.load(hf_dir("llama"), tokenizer=False).cfg
    block = 2 * BLOCK_SIZE * cfg.attn.n_kv_heads * cfg.attn.head_dim * 4 * len(cfg.attention_layers)
    pools = ModelPools(cfg, torch.float32, torch.device("cpu"), budget_bytes=10 * block, first_tokens=BLOCK_SIZE)
    assert pools.kv.n_blocks == 1 and pools.kv.max_blocks == 10 and pools.capacity_bytes == 10 * block
    c = pools.new_cache(10_000)
    c.reserve(3 * BLOCK_SIZE)  # grows by doubling: 1 -> 3 (what was asked) -> ...
    assert pools.kv.n_blocks >= 3 and pools.kv.version >= 1
    c.reserve(10 * BLOCK_SIZE)
    assert pools.kv.n_blocks == 10
    c.pos = 10 * BLOCK_SIZE  # as if those tokens had run
    with pytest.raises(ContextOverflowError, match="KV pool exhausted"):
        c.reserve(1)
    with pytest.raises(MemraError, match="raise it"):
        ModelPools(cfg, torch.float32, torch.device("cpu"), budget_bytes=block - 1)
    with pytest.raises(MemraError, match="GiB"):
        KvBudget(gib=-1)
    assert KvBudget(gib=0.5).bytes_on(torch.device("cpu")) == 1 << 29


def test_on_a_gpu_the_pool_grows_when_a_cache_is_made_not_mid_decode():
    """grow_ahead (the GPU's rule, forced here on CPU): making a cache grows the KV pool to what every live
    cache may hold, so decoding up to max_ctx never enlarges it (which would re-capture the graphs);
    a freed cache's promise is returned. Without it (CPU) the pool grows only as blocks are taken."""
    cfg = memra.load(hf_dir("llama"), tokenizer=False).cfg
    block = 2 * BLOCK_SIZE * cfg.attn.n_kv_heads * cfg.attn.head_dim * 4 * len(cfg.attention_layers)
    ahead = ModelPools(cfg, torch.float32, torch.device("cpu"), budget_bytes=64 * block, first_tokens=BLOCK_SIZE,
                       grow_ahead=True)
    caches = [ahead.new_cache(5 * BLOCK_SIZE) for _ in range(3)]
    assert ahead.kv.n_blocks >= 15
    version = ahead.kv.version
    for c in caches:
        c.reserve(5 * BLOCK_SIZE)
    assert ahead.kv.version == version  # no growth while the caches fill up
    for c in caches:
        c.free()
    assert ahead._promised == [0]
    lazy = ModelPools(cfg, torch.float32, torch.device("cpu"), budget_bytes=64 * block, first_tokens=BLOCK_SIZE)
    assert not lazy.grow_ahead
    lazy.new_cache(5 * BLOCK_SIZE)
    assert lazy.kv.n_blocks == 1


def test_a_batch_of_new_cache_caches_equals_each_alone(model):
    """E1 over the model's pools: rows decoded together equal each sequence decoded alone."""
    prompts = [[3, 14, 15, 92, 65], [35, 89, 79], [43, 38, 32, 7, 7, 7, 1]]
    alone = []
    for p in prompts:
        c = model.new_cache(64)
        tok, rows = int(model.prime(p, c).argmax()), []
        for _ in range(6):
            rows.append(model.decode_step_batch([tok], [c])[0])
            tok = int(rows[-1].argmax())
        alone.append(torch.stack(rows))
    caches = [model.new_cache(64) for _ in prompts]
    toks = [int(model.prime(p, c).argmax()) for p, c in zip(prompts, caches)]
    before = counters.snapshot()
    rows = []
    for _ in range(6):
        out = model.decode_step_batch(toks, caches)
        rows.append(out)
        toks = out.argmax(-1).tolist()
    together = torch.stack(rows, 1)
    for i in range(len(prompts)):
        assert torch.equal(together[i], alone[i])
    if DEVICE == "cuda":  # the pooled caches took the graphed step
        assert counters.delta(before)["graph_replays"] > 0


def test_a_slot_is_zeroed_and_copied_in_one_op_for_every_layer(model):
    """RecurrentPool.zero and copy_slot move a slot's state in every GDN layer with one multi-tensor op a dtype (on
    a GPU one launch each, where a loop launched 2 a layer: 48 on Qwen3.5-9B for every request started and every
    prefix snapshot); allocate(zeroed=False), a copy's target, skips the zeroing. The bits: zeros, and the source's."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ not in ("select", "view"):
                self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    rec = model.pools().rec
    a, b = model.new_cache(64), model.new_cache(64)
    model.prime(list(range(1, 40)), a)
    assert len(rec.layers) > 1 and all(s.abs().max() > 0 for s in rec.states(a.slot))
    kinds = len({(t.device, t.dtype) for t in rec.states(a.slot)})  # bf16 conv and fp32 delta-rule states: two
    with Ops() as ops:
        rec.copy_slot(a.slot, b.slot)
    assert ops.names == ["_foreach_copy_"] * kinds
    assert all(torch.equal(x, y) for x, y in zip(rec.states(a.slot), rec.states(b.slot)))
    with Ops() as ops:
        rec.zero(a.slot)
    assert ops.names == ["_foreach_zero_"] * kinds and not any(s.any() for s in rec.states(a.slot))
    held = b.slot
    b.free()
    with Ops() as ops:
        slot = rec.allocate(zeroed=False)  # b's slot again (the lowest free), its state left as b had it
    assert not ops.names and slot == held and all(s.abs().max() > 0 for s in rec.states(slot))
    rec.release(slot)
    a.free()
