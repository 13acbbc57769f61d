"""A model's cache pools and the memory budget they grow within.

Every cache of a model draws from one KV pool and one recurrent-state pool (per placement), so any of
them can decode as one batch and take the CUDA-graphed step (memra.graphs needs one pool). The pools
start small and double as caches ask for more, up to what the budget affords: nothing is reserved up
front except by a caller who asks (a server on a GPU, whose captured graphs must keep their addresses).
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass

import torch

from memra.cache import BLOCK_SIZE, Cache, KvPool, RecurrentPool, kv_pool
from memra.config import ModelConfig
from memra.errors import MemraError


@dataclass(frozen=True)
class KvBudget:
    """How much memory a model's cache pools may take (KV blocks and recurrent slots together): `gib`
    GiB, or else `fraction` of the device's free memory when the pools are made (on CPU: of available
    RAM). The pools start small and grow on demand up to it; nothing is reserved up front unless
    asked for (ModelPools.reserve: a server sizing its scheduler)."""

    gib: float | None = None
    fraction: float = 0.9
    # vLLM's --gpu-memory-utilization: `fraction` is then of the GPU's whole memory for everything this
    # process holds (weights included), so the caches get what is left of it once the weights are placed
    of_total: bool = False

    def __post_init__(self) -> None:
        if self.gib is not None and not 0 < self.gib < 1 << 20:
            raise MemraError(f"the KV memory budget must be a positive number of GiB, got {self.gib}")
        if not 0 < self.fraction <= 1:
            raise MemraError(f"the KV memory fraction must be in (0, 1], got {self.fraction}")

    def bytes_on(self, device: torch.device) -> int:
        if self.gib is not None:
            return int(self.gib * (1 << 30))
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            if self.of_total:
                room = free - (1 - self.fraction) * total
                if room <= 0:
                    raise MemraError(f"--gpu-memory-utilization {self.fraction:g} leaves the KV cache no room: "
                                     f"{(total - free) / (1 << 30):.1f} of {total / (1 << 30):.1f} GiB are already "
                                     "in use; raise it")
                return int(room)
        else:
            free = _available_ram()  # on CPU, --gpu-memory-utilization is a share of the available RAM
        return int(self.fraction * free)


def _available_ram() -> int:
    """MemAvailable of /proc/meminfo where there is one, else the physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class ModelPools:
    """One model's KV pool and recurrent-state pool, shared by every cache it hands out: so any caches of
    one model can decode as one batch, and take the CUDA-graphed step (memra.graphs needs them in one
    pool). Both start small (`first_tokens` worth of blocks, a few slots) and double as caches ask for
    more, up to limits that keep KV + recurrent bytes within `budget_bytes`: at most `max_slots`
    sequences (default: as many as an eighth of the budget holds, up to 1024) and the blocks the rest
    holds (at most `max_blocks`)."""

    @torch.inference_mode(False)  # pools made during a step are still updated in place outside one
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, budget_bytes: int,
                 layer_devices: dict[int, torch.device] | None = None, *, max_slots: int | None = None,
                 max_blocks: int | None = None, first_tokens: int = 4096, grow_ahead: bool | None = None):
        self.budget_bytes = budget_bytes
        # On a GPU the KV pool grows when a cache is made, to what every live cache may come to hold (its
        # max_ctx), not between two decode steps: growing replaces the tensors the captured graphs read,
        # so they would be captured again (and the pool copied) in the middle of a stream. On CPU (no
        # graphs) the pool grows only as blocks are taken, so RAM tracks what sequences really hold.
        self.grow_ahead = device.type == "cuda" if grow_ahead is None else grow_ahead
        self._promised = [0]  # blocks the live caches may come to hold (a list: their give-backs share it)
        probe_kv = kv_pool(cfg, 1, dtype, "meta")
        probe_rec = RecurrentPool(cfg, 1, dtype, "meta") if cfg.gdn_layers else None
        block, slot = probe_kv.block_bytes, (probe_rec.slot_bytes if probe_rec is not None else 0)
        if probe_rec is None:
            slots = 0
        else:
            slots = max_slots if max_slots is not None else max(1, min(1024, budget_bytes // (8 * slot)))
        blocks = (budget_bytes - slots * slot) // max(block, 1)
        if max_blocks is not None:
            blocks = min(blocks, max_blocks)
        if blocks < 1:
            raise MemraError(f"a KV budget of {budget_bytes / (1 << 30):.3g} GiB holds no {BLOCK_SIZE}-token block "
                             f"beside {slots} recurrent slots of {slot / (1 << 20):.1f} MiB; raise it (--kv-memory)")
        self.kv = kv_pool(cfg, min(blocks, -(-first_tokens // BLOCK_SIZE)), dtype, device, layer_devices,
                          max_blocks=blocks)
        self.rec = (RecurrentPool(cfg, min(4, slots), dtype, device, layer_devices, max_slots=slots)
                    if probe_rec is not None else None)

    @property
    def capacity_bytes(self) -> int:
        """What the pools may grow to."""
        return self.kv.max_blocks * self.kv.block_bytes + (self.rec.max_slots * self.rec.slot_bytes if self.rec else 0)

    @property
    def reserved_bytes(self) -> int:
        """What the pools hold now."""
        return self.kv.n_blocks * self.kv.block_bytes + (self.rec.n_slots * self.rec.slot_bytes if self.rec else 0)

    def reserve_all(self) -> None:
        """Grow both pools to their limits now (a server on a GPU: its captured graphs keep their addresses)."""
        self.kv.enlarge(self.kv.max_blocks)
        if self.rec is not None:
            self.rec.enlarge(self.rec.max_slots)

    def new_cache(self, max_ctx: int) -> Cache:
        """A cache drawing from these pools; its blocks and slot come back when it is freed or dropped."""
        slot = self.rec.allocate() if self.rec is not None else None
        cache = Cache(kv=self.kv, rec=self.rec, max_ctx=max_ctx, slot=slot)
        need = -(-max_ctx // BLOCK_SIZE)
        if self.grow_ahead and self._promised[0] + need > self.kv.n_blocks:
            self.kv.enlarge(min(self.kv.max_blocks, max(self._promised[0] + need, 2 * self.kv.n_blocks)))
        self._promised[0] += need
        # `cache.blocks` is only ever changed in place, so the give-back sees the blocks held at the time
        cache._on_free = weakref.finalize(cache, _give_back, self.kv, cache.blocks, self.rec, slot,
                                          self._promised, need)
        cache._on_free.atexit = False  # the process is ending: nothing to give back to
        return cache


def _give_back(kv: KvPool, blocks: list[int], rec: RecurrentPool | None, slot: int | None, promised: list[int],
               need: int) -> None:
    """What a cache held, back to its pools: when it is freed, or dropped unfreed (weakref.finalize runs
    this at most once)."""
    promised[0] -= need
    kv.release(list(blocks))
    blocks.clear()
    if rec is not None and slot is not None:
        rec.release(slot)
