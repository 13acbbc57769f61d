"""max_batch sized from the KV memory (`--max-batch auto`): the largest decode-graph bucket whose sequences'
KV blocks and recurrent state fit the pools' budget.

A sequence holds ceil(tokens / BLOCK_SIZE) KV blocks for the tokens it has written (blocks are taken as
positions are written and given back when it ends) and, on a hybrid model, one recurrent slot. The budget
is the model's (memra.pools.KvBudget: a fraction of the free device memory once the weights are placed),
what the engine's pools will be sized from. `tokens` is the length a running sequence is sized for: a
workload's mean prompt + output (`memra bench throughput`), so the running set holds on average what the
pool can; a step that runs short of blocks swaps a sequence out to the host and back, byte for byte
(memra.engine.scheduler), which costs time, never bits.

Only graph buckets (memra.graphs.BUCKETS) are picked: a max_batch between two buckets pads its widest
steps to the next one anyway, and the warm-up captures every bucket up to max_batch's. The pick stops at
AUTO_CAP rows, where the memory would allow more: past it the host's work between steps (about 10 us a live
row) outgrows the GPU's step and the GPU waits. Qwen3.5-9B with its GDN state in bf16 has room for 1,024 rows
on an H100; there its offline throughput was 7,036 output tok/s with the GPU idle 12% of the time between
steps, against 8,359 at 768 and 8,626 at 512 (docs/PERFORMANCE.md).
"""

from __future__ import annotations

from memra.cache import BLOCK_SIZE, RecurrentPool, kv_pool
from memra.graphs import BUCKETS

AUTO_CAP = 768  # the largest max_batch auto picks (the module's notes)


def sequence_bytes(model, tokens: int) -> int:
    """Bytes one sequence of `tokens` tokens holds in the pools: its KV blocks and its recurrent slot."""
    cfg = model.cfg
    block = kv_pool(cfg, 1, model.dtype, "meta").block_bytes
    slot = RecurrentPool(cfg, 1, model.dtype, "meta").slot_bytes if cfg.gdn_layers else 0
    return -(-tokens // BLOCK_SIZE) * block + slot


def largest_bucket(budget_bytes: int, per_sequence: int) -> int:
    """The largest bucket b with b sequences of `per_sequence` bytes within the budget (1 if none fits)."""
    return max((b for b in BUCKETS if b * per_sequence <= budget_bytes), default=1)


def auto_max_batch(model, tokens: int, budget_bytes: int | None = None) -> tuple[int, str]:
    """-> (max_batch, one line saying how it was chosen) for sequences of `tokens` tokens on `model`'s device;
    budget_bytes: the pools' budget (default: the model's KvBudget, measured now)."""
    budget = model.kv_budget.bytes_on(model.device) if budget_bytes is None else budget_bytes
    per = sequence_bytes(model, tokens)
    fits = largest_bucket(budget, per)
    batch = min(fits, AUTO_CAP)
    why = "the largest graph bucket within it" if batch == fits else f"{fits} would fit; auto stops at {AUTO_CAP}"
    return batch, (f"max_batch auto: {batch} (KV budget {budget / (1 << 30):.1f} GiB holds {budget // per} sequences "
                   f"of {tokens} tokens at {per / (1 << 20):.1f} MiB; {why})")
