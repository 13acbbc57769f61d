"""Per-sequence state: paged KV for attention layers, recurrent slots for Gated DeltaNet layers.

Memory lives in pools so that many sequences can share it later (the server); a `Cache` is one
sequence's handle into them: its position, its block table and its recurrent slot.

    KvPool          k/v[layer]: [n_blocks, BLOCK_SIZE, Hkv, D]   (one pool per device/dtype)
    RecurrentPool   conv[layer]: [n_slots, conv_dim, Kc-1] (model dtype, the last raw conv inputs)
                    ssm[layer]:  [n_slots, Hv, Dk, Dv]      (fp32: the delta-rule state)

A snapshot records the position and copies the recurrent state (the only state that cannot be
recovered by truncation: KV beyond the snapshot's position is simply overwritten later).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import numpy as np
import torch

from memra import counters
from memra.config import ModelConfig
from memra.errors import ContextOverflowError, MemraError
from memra.state_trail import StateTrail
from memra.upload import upload_values

BLOCK_SIZE = 16  # tokens per KV block
PRIME_CHUNK_MAX_TOKENS = 4096  # the largest prefill chunk a single forward may take


class KvPool:
    """KV blocks for a set of attention layers, with a free list. With `max_blocks` above `n_blocks`
    the pool grows on demand (doubling, up to max_blocks) instead of refusing an allocation."""

    def __init__(self, layers: tuple[int, ...], n_blocks: int, n_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, layer_devices: dict[int, torch.device] | None = None,
                 max_blocks: int | None = None, shapes: dict[int, tuple[int, int]] | None = None):
        # shapes: (KV heads, head dim) of the layers whose geometry differs from the model's (Gemma 4)
        shape = lambda i: (n_blocks, BLOCK_SIZE, *(shapes or {}).get(i, (n_kv_heads, head_dim)))  # noqa: E731
        self.layers = layers
        dev = lambda i: (layer_devices or {}).get(i, device)  # a pipeline stage owns its layers' KV
        self.k = {i: torch.zeros(shape(i), dtype=dtype, device=dev(i)) for i in layers}
        self.v = {i: torch.zeros(shape(i), dtype=dtype, device=dev(i)) for i in layers}
        self.n_blocks = n_blocks
        self.max_blocks = max(n_blocks, max_blocks or n_blocks)
        self.free: list[int] = list(range(n_blocks))
        self.version = 0  # bumped when the tensors are replaced (enlarge): captured graphs hold their addresses
        # the widest window where every layer of the pool slides one (Cache.drop_out_of_window), else None
        self.window: int | None = None
        # Blocks with more than one holder (the prefix cache and the sequences reading its pages,
        # memra.prefix) -> how many holders beyond the first; a block is free again when its last goes.
        self.extra_refs: dict[int, int] = {}
        self.reclaim = None  # (n) -> None: frees up to n blocks others hold only as a cache (memra.prefix)

    @property
    def block_bytes(self) -> int:
        """Bytes one block takes over every layer, K and V."""
        return sum(2 * t[0].numel() * t.element_size() for t in self.k.values())

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free) and self.n_blocks < self.max_blocks:
            self.enlarge(min(self.max_blocks, max(2 * self.n_blocks, self.n_blocks + n - len(self.free))))
        if n > len(self.free) and self.reclaim is not None:
            self.reclaim(n - len(self.free))
        if n > len(self.free):
            raise ContextOverflowError(
                f"KV pool exhausted: need {n} more blocks of {BLOCK_SIZE} tokens, {len(self.free)} free of "
                f"{self.n_blocks} (the memory budget's limit); free finished sequences or raise the KV budget")
        taken, self.free = self.free[:n], self.free[n:]
        return taken

    def release(self, blocks: list[int]) -> None:
        if not self.extra_refs:
            self.free.extend(b for b in blocks if b >= 0)  # (-1: a block already given back, out of the window)
            return
        for b in (b for b in blocks if b >= 0):
            extra = self.extra_refs.get(b)
            if extra is None:
                self.free.append(b)
            elif extra == 1:
                del self.extra_refs[b]
            else:
                self.extra_refs[b] = extra - 1

    def share(self, blocks) -> None:
        """One more holder of each block (read-only: a shared block is never written again)."""
        for b in blocks:
            self.extra_refs[b] = self.extra_refs.get(b, 0) + 1

    def holders(self, block: int) -> int:
        """How many hold this allocated block."""
        return 1 + self.extra_refs.get(block, 0)

    @torch.inference_mode(False)  # a pool grown inside a step must not become an inference tensor
    def enlarge(self, n_blocks: int) -> None:
        """Grow the pool to `n_blocks` blocks, keeping every existing block's contents and index."""
        extra = n_blocks - self.n_blocks
        if extra <= 0:
            return
        for table in (self.k, self.v):
            for i, t in table.items():
                table[i] = torch.cat((t, t.new_zeros((extra, *t.shape[1:]))))
        self.free.extend(range(self.n_blocks, n_blocks))
        self.n_blocks = n_blocks
        self.max_blocks = max(self.max_blocks, n_blocks)
        self.version += 1


def _by_kind(tensors: list[torch.Tensor]) -> list[list[int]]:
    """The tensors' indices, grouped by device and dtype: what torch's foreach fast path takes in one launch."""
    groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    return list(groups.values())


def copy_all(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """dst[i].copy_(src[i]) for every i, one multi-tensor launch per device and dtype on a GPU (torch's foreach
    kernels, the optimizers'): a loop launches one a layer and kind, 48 on Qwen3.5-9B, for every request started,
    prefix snapshot taken or verify rolled back."""
    for ix in _by_kind(dst):
        torch._foreach_copy_([dst[i] for i in ix], [src[i] for i in ix])


class RecurrentPool:
    """Per-sequence recurrent state slots for the GDN layers, growing on demand up to `max_slots`. A slot is zeroed
    when handed out (allocate), the lowest free one first: no path reads one it was not handed, so unused ones take
    no memory, and the resident ones are the most ever live at once (a warm-up's and a request's share one)."""

    def __init__(self, cfg: ModelConfig, n_slots: int, dtype: torch.dtype, device: torch.device | str,
                 layer_devices: dict[int, torch.device] | None = None, max_slots: int | None = None):
        g = cfg.gdn
        assert g is not None
        self.layers = cfg.gdn_layers
        dev = lambda i: (layer_devices or {}).get(i, device)
        self.conv = {i: torch.empty(n_slots, g.conv_dim, g.conv_kernel - 1, dtype=dtype, device=dev(i)) for i in self.layers}
        self.ssm = {i: torch.empty(n_slots, g.n_v_heads, g.k_head_dim, g.v_head_dim, dtype=g.state_torch_dtype,
                                   device=dev(i)) for i in self.layers}
        self.n_slots = n_slots
        self.max_slots = max(n_slots, max_slots or n_slots)
        self.free: list[int] = list(range(n_slots))
        self.version = 0  # bumped when the tensors are replaced (enlarge), as KvPool's

    @property
    def slot_bytes(self) -> int:
        return sum(t[0].numel() * t.element_size() for table in (self.conv, self.ssm) for t in table.values())

    def allocate(self, zeroed: bool = True) -> int:
        """A free slot, zeroed unless the caller overwrites it whole at once (zeroed=False: a copy's target)."""
        if not self.free and self.n_slots < self.max_slots:
            self.enlarge(min(self.max_slots, 2 * self.n_slots))
        if not self.free:
            raise MemraError(f"no free recurrent-state slot: {self.n_slots} sequences hold them all (the memory "
                             "budget's limit); free finished sequences or raise the KV budget")
        slot = self.free.pop(self.free.index(min(self.free)))  # the lowest (the class docstring says why)
        if zeroed:
            self.zero(slot)
        return slot

    @torch.inference_mode(False)
    def enlarge(self, n_slots: int) -> None:
        """Grow to `n_slots` slots, keeping every existing slot's state and index."""
        extra = n_slots - self.n_slots
        if extra <= 0:
            return
        for table in (self.conv, self.ssm):
            for i, t in table.items():
                table[i] = torch.cat((t, t.new_empty((extra, *t.shape[1:]))))  # zeroed when allocated
        self.free.extend(range(self.n_slots, n_slots))
        self.n_slots = n_slots
        self.version += 1

    def release(self, slot: int) -> None:
        self.free.append(slot)

    def states(self, slot: int) -> list[torch.Tensor]:
        """The slot's state in every layer: the conv states, then the delta-rule states."""
        return [t[slot] for table in (self.conv, self.ssm) for t in table.values()]

    def zero(self, slot: int) -> None:
        states = self.states(slot)
        for ix in _by_kind(states):
            torch._foreach_zero_([states[i] for i in ix])  # one launch a dtype on a GPU (copy_all says why)

    def copy_slot(self, src: int, dst: int) -> None:
        copy_all(self.states(dst), self.states(src))


@dataclass
class CacheSnapshot:
    pos: int
    n_blocks: int
    conv: dict[int, torch.Tensor]
    ssm: dict[int, torch.Tensor]


@dataclass
class Cache:
    """One sequence's handle: how far it has been run (`pos`) and where its state lives."""

    kv: KvPool
    rec: RecurrentPool | None
    max_ctx: int
    pos: int = 0
    blocks: list[int] = field(default_factory=list)
    slot: int | None = None
    shared: int = 0  # leading blocks shared read-only with the prefix cache (memra.prefix): never written
    last_logits_dev: torch.Tensor | None = None  # parked device logits (lean sampling; later issues)
    _tables: dict = field(default_factory=dict, repr=False)  # device -> (blocks it was made from, block table)
    _on_free: weakref.finalize | None = field(default=None, repr=False)  # a model pool's give-back (once)

    def read_rows(self, stop: int, device: torch.device) -> torch.Tensor:
        """Flat KV-pool rows of positions 0..stop-1 in order, on `device`. The block table is uploaded
        once per change of the block list, not once per step (a decode step otherwise pays one small
        host-to-device copy per sequence)."""
        key = str(device)
        cached = self._tables.get(key)
        if cached is None or cached[0] != self.blocks:
            cached = (list(self.blocks), upload_values(self.blocks, torch.long, device))
            self._tables[key] = cached
        pos = torch.arange(stop, device=device)
        return cached[1][pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE

    def host_block_rows(self, stop: int) -> np.ndarray:
        """read_rows' arithmetic on the host, for whole blocks: the flat pool rows of the blocks holding
        positions 0..stop-1, in position order (int64 [ceil(stop / BLOCK_SIZE) * BLOCK_SIZE]; the tail
        past stop is the rest of the last block)."""
        blocks = np.asarray(self.blocks[: -(-stop // BLOCK_SIZE)], dtype=np.int64)
        return (blocks[:, None] * BLOCK_SIZE + np.arange(BLOCK_SIZE, dtype=np.int64)).ravel()

    def drop_out_of_window(self) -> int:
        """Where every layer of the pool slides a window W, give back the blocks wholly before pos - W + 1
        (no later query reads them; a decode step calls this, and a rollback stops at its verify's start).
        Their places in `blocks` become -1. -> how many went back."""
        w = self.kv.window
        end = min(max(0, self.pos - w + 1) // BLOCK_SIZE, len(self.blocks)) if w else 0
        start = end  # the given-back blocks are a prefix of `blocks`: walk back only over the newly dead ones
        while start > 0 and self.blocks[start - 1] >= 0:
            start -= 1
        if dead := range(start, end):
            self.kv.release([self.blocks[i] for i in dead])
            for i in dead:
                self.blocks[i] = -1  # in place: the pool's give-back holds this very list
            counters.bump("kv_window_released_blocks", len(dead))
        return len(dead)

    def reserve(self, n_tokens: int) -> None:
        """Make room for n_tokens more positions, or refuse before anything is written."""
        need = self.pos + n_tokens
        if need > self.max_ctx:
            raise ContextOverflowError(
                f"sequence would reach {need} tokens but the cache holds {self.max_ctx}; "
                f"use a larger max_ctx (or a shorter prompt / fewer new tokens)"
            )
        missing = -(-need // BLOCK_SIZE) - len(self.blocks)
        if missing > 0:
            self.blocks += self.kv.allocate(missing)

    # --- recurrent state views (this sequence's slot) ---
    def conv_state(self, layer: int) -> torch.Tensor:
        return self.rec.conv[layer][self.slot]  # [C, Kc-1]

    def ssm_state(self, layer: int) -> torch.Tensor:
        return self.rec.ssm[layer][self.slot]  # [Hv, Dk, Dv] fp32

    # --- snapshots ---
    def snapshot(self) -> CacheSnapshot:
        conv = {i: self.conv_state(i).clone() for i in (self.rec.layers if self.rec else ())}
        ssm = {i: self.ssm_state(i).clone() for i in (self.rec.layers if self.rec else ())}
        return CacheSnapshot(self.pos, len(self.blocks), conv, ssm)

    def restore(self, snap: CacheSnapshot) -> None:
        """Return to a snapshot: truncate KV to its position, copy its recurrent state back."""
        if snap.pos > self.pos:
            raise MemraError(f"cannot restore a snapshot at position {snap.pos}: the cache has been rolled back to {self.pos} since")
        if self.kv.window and -1 in self.blocks[: max(0, snap.pos - self.kv.window + 1) // BLOCK_SIZE + 1]:
            raise MemraError(f"cannot restore a snapshot at position {snap.pos}: its window's blocks were given back")
        self.writable_from(snap.pos)
        self.pos = snap.pos
        keep = max(snap.n_blocks, -(-snap.pos // BLOCK_SIZE))
        if len(self.blocks) > keep:
            self.kv.release(self.blocks[keep:])
            del self.blocks[keep:]
        copy_all([*map(self.conv_state, snap.conv), *map(self.ssm_state, snap.ssm)], [*snap.conv.values(), *snap.ssm.values()])
        self.last_logits_dev = None

    def rollback(self, pos0: int, keep: int, trail: StateTrail) -> None:
        """After a verify of T tokens from pos0: keep its first `keep` tokens (1 <= keep <= T), drop the
        rest. KV past the new position is left to be overwritten; each GDN layer's state returns to
        what it was right after token keep-1 (recorded in `trail` by that verify)."""
        if not 1 <= keep <= self.pos - pos0:
            raise MemraError(f"rollback keeps {keep} of the {self.pos - pos0} tokens verified from position {pos0}")
        self.writable_from(pos0 + keep)
        if keep < self.pos - pos0 and self.rec:
            copy_all(self.rec.states(self.slot), [trail.conv[i][keep - 1] for i in self.rec.layers]
                     + [trail.ssm[i][keep - 1] for i in self.rec.layers])
        self.pos = pos0 + keep
        self.last_logits_dev = None

    def writable_from(self, pos: int) -> None:
        """Copy on write: positions from `pos` on are about to be written again, so the shared blocks that
        hold them become private copies first (the prefix cache's pages stay as they are)."""
        first = pos // BLOCK_SIZE
        if first >= self.shared:
            return
        old = self.blocks[first : self.shared]
        new = self.kv.allocate(len(old))
        src, dst = torch.tensor(old, dtype=torch.long), torch.tensor(new, dtype=torch.long)
        for table in (self.kv.k, self.kv.v):
            for t in table.values():
                t[dst.to(t.device)] = t[src.to(t.device)]
        self.kv.release(old)
        self.blocks[first : self.shared] = new
        self.shared = first

    def reset(self) -> None:
        """Back to an empty sequence (position 0, zero recurrent state), keeping the allocated blocks (but
        for shared ones, which others still read: those go back and are allocated afresh when needed)."""
        if self.shared:
            self.kv.release(self.blocks)
            self.blocks.clear()
            self.shared = 0
        self.pos = 0
        for i, b in zip([i for i, b in enumerate(self.blocks) if b < 0], self.kv.allocate(self.blocks.count(-1))):
            self.blocks[i] = b  # out-of-window blocks given back: taken again
        if self.rec is not None and self.slot is not None:
            self.rec.zero(self.slot)
        self.last_logits_dev = None

    def grow(self, new_max_ctx: int) -> None:
        """Let this sequence run longer; its state is untouched. A pool too small for the longer run is
        enlarged now (a growable pool would also grow when the blocks are taken)."""
        if new_max_ctx < self.max_ctx:
            raise MemraError(f"grow() cannot shrink a cache ({self.max_ctx} -> {new_max_ctx})")
        short = -(-new_max_ctx // BLOCK_SIZE) - len(self.blocks) - len(self.kv.free)
        if short > 0 and self.kv.n_blocks + short > self.kv.max_blocks:
            self.kv.enlarge(self.kv.n_blocks + short)
        self.max_ctx = new_max_ctx

    def free(self) -> None:
        """Give blocks and the recurrent slot back to their pools. A cache of the model's pools does this
        once, through the same give-back that runs if it is dropped without being freed."""
        if self._on_free is not None:
            self._on_free()  # a no-op the second time
            self.slot = None
            return
        self.kv.release(self.blocks)
        self.blocks.clear()  # in place: a finalizer may hold this very list
        if self.rec is not None and self.slot is not None:
            self.rec.release(self.slot)
            self.slot = None


def kv_pool(cfg: ModelConfig, n_blocks: int, dtype: torch.dtype, device: torch.device | str,
            layer_devices: dict[int, torch.device] | None = None, max_blocks: int | None = None) -> KvPool:
    """A KV pool for every attention layer of the model that keeps K/V of its own (not one that reads an
    earlier layer's: Gemma 4's shared KV), the MTP blocks' included."""
    own = tuple(i for i in cfg.attention_layers if cfg.attn_of(i).kv_from is None)
    layers = own + tuple(cfg.n_layers + j for j in range(cfg.n_mtp))
    shapes = {i: (cfg.attn_of(i).n_kv_heads, cfg.attn_of(i).head_dim) for i in own}
    pool = KvPool(layers, n_blocks, cfg.attn.n_kv_heads, cfg.attn.head_dim, dtype, device, layer_devices, max_blocks, shapes)
    windows = [cfg.window(i) for i in layers]
    if layers and None not in windows:  # every layer slides (no global layer, no MTP block)
        pool.window = max(windows)
    return pool


def new_cache(cfg: ModelConfig, max_ctx: int, dtype: torch.dtype, device: torch.device | str,
              layer_devices: dict[int, torch.device] | None = None) -> Cache:
    """A cache with private pools sized for one sequence of up to max_ctx tokens. `layer_devices`
    places chosen layers' state elsewhere (a pipeline stage's own device; memra.pp)."""
    if max_ctx <= 0:
        raise MemraError(f"max_ctx must be positive, got {max_ctx}")
    kv = kv_pool(cfg, -(-max_ctx // BLOCK_SIZE), dtype, device, layer_devices)
    rec = RecurrentPool(cfg, 1, dtype, device, layer_devices) if cfg.gdn_layers else None
    return Cache(kv=kv, rec=rec, max_ctx=max_ctx, slot=rec.allocate() if rec else None)
