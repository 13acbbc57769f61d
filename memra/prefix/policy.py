"""How much the prefix cache may keep, decided once when the engine is built.

Snapshots (hybrid models). A snapshot is one recurrent slot: every GDN layer's conv and delta-rule state
(the demo: 420 KiB; a Qwen3.5-9B-shaped model: about 50 MB, against 2 MiB of KV for a 64-token page).
- How many: `prefix_snapshots`, by default two per running place (each conversation of a full batch
  keeps its last cut and one branch or spacing point), and never more than a quarter of the pools'
  budget. The recurrent pool is sized for them beside the running sequences' slots, inside the budget.
- Spacing: one every `spacing` tokens along a prompt, the least multiple of 64 whose KV takes at least
  a snapshot's bytes: the snapshots of a prompt then take at most as much memory as its KV pages. A
  prompt that shares a prefix up to a point with no snapshot re-primes less than `spacing` tokens
  (the branch snapshot that prime takes serves every later one). The demo's spacing is 192 tokens.
  Time is not the constraint: on the 2-core CPU a demo snapshot copy took 0.17 ms against 81 ms to
  prime the 64 tokens of one page (measured while other work shared the cores); memory is.
"""

from __future__ import annotations

from memra.cache import BLOCK_SIZE, RecurrentPool, kv_pool
from memra.prefix.serving import NoPrefixCache, PrefixCache
from memra.prefix.store import PrefixStore
from memra.prefix.tree import PAGE


def snapshot_slots(model, cfg, budget_bytes: int) -> int:
    """Recurrent slots to set aside for snapshots (0 where there is no GDN layer or caching is off)."""
    if not cfg.prefix_caching or not model.cfg.gdn_layers:
        return 0
    slot = RecurrentPool(model.cfg, 1, model.dtype, "meta").slot_bytes
    want = cfg.prefix_snapshots if cfg.prefix_snapshots is not None else 2 * cfg.max_batch
    return max(0, min(want, budget_bytes // (4 * max(slot, 1))))


def spacing(model) -> int:
    """Tokens between spaced snapshots (module docstring)."""
    if not model.cfg.gdn_layers:
        return 0
    slot = RecurrentPool(model.cfg, 1, model.dtype, "meta").slot_bytes
    page = kv_pool(model.cfg, 1, model.dtype, "meta").block_bytes * (PAGE // BLOCK_SIZE)
    return PAGE * max(1, -(-slot // max(page, 1)))


def prefix_cache(model, kv, rec, cfg, snapshots: int):
    """The engine's prefix cache over its pools (memra.prefix.serving), or the no-op where it is off."""
    if not cfg.prefix_caching:
        return NoPrefixCache()
    mtp = cfg.speculative is not None and cfg.speculative.method == "mtp"
    return PrefixCache(PrefixStore(kv, rec, snapshots), spacing(model),
                       whole_prime=(lambda s: s.spec is not None) if mtp else (lambda s: False))
