"""The prefix cache's storage: the tree's pages as shared KV blocks, and recurrent-state snapshots in
slots of the model's recurrent pool, both under the pools' budget.

    KV       a node's blocks are blocks of the KV pool with one more holder (KvPool.share); a sequence
             that resumes from the node holds them too, read-only. When the pool has no free block left
             (it has grown to its budget), `reclaim` evicts least recently used leaves whose blocks only
             the cache holds. The engine's scheduler counts every running sequence's blocks as if it
             held them alone, so whatever it hands out is always there: the blocks no sequence holds
             are free or held only by the cache, and those are all evictable (a sequence holding a
             node's blocks holds its ancestors' too: `adopt` keeps it so).
    GDN      a snapshot is a copy of a sequence's conv and delta-rule state, taken right after the prime
             forward that ends at a node's page (its chunk is cut there). At most `max_snapshots` of them,
             least recently used evicted first; their slots are counted in the pools' budget (the
             engine sizes the recurrent pool for them).
"""

from __future__ import annotations

from collections import OrderedDict

from memra import counters
from memra.cache import BLOCK_SIZE, Cache, KvPool, RecurrentPool
from memra.errors import MemraError
from memra.prefix.tree import PAGE, Node, PrefixTree

BLOCKS_PER_PAGE = PAGE // BLOCK_SIZE
assert PAGE % BLOCK_SIZE == 0, "a page must be whole KV blocks: a shared block is never partly written"


class PrefixStore:
    def __init__(self, kv: KvPool, rec: RecurrentPool | None, max_snapshots: int):
        self.kv, self.rec = kv, rec
        self.tree = PrefixTree()
        self.max_snapshots = max_snapshots if rec is not None else 0
        self._snaps: OrderedDict[Node, None] = OrderedDict()  # nodes holding a snapshot, oldest first
        kv.reclaim = self.reclaim

    @property
    def hybrid(self) -> bool:
        """Whether a resume point needs a recurrent snapshot (the model has GDN layers)."""
        return self.rec is not None

    @property
    def snapshots(self) -> int:
        return len(self._snaps)

    # --- KV pages ---
    def add_page(self, parent: Node, page: tuple[int, ...], blocks: list[int]) -> Node:
        """A sequence's freshly primed page becomes a node (the cache takes a hold on its blocks)."""
        self.kv.share(blocks)
        counters.bump("prefix_pages_added")
        return self.tree.insert(parent, page, tuple(blocks))

    def adopt(self, cache: Cache, node: Node) -> None:
        """The sequence primed a page the tree already has: it reads the node's blocks from now on (the same
        bits, E5/E8) and gives its own copy back, so a sequence holding a node holds the node's ancestors."""
        first = (node.depth - 1) * BLOCKS_PER_PAGE
        mine = cache.blocks[first : first + BLOCKS_PER_PAGE]
        self.kv.share(node.blocks)
        cache.blocks[first : first + BLOCKS_PER_PAGE] = node.blocks
        self.kv.release(mine)

    def fork(self, src: Cache, dst: Cache) -> None:
        """dst (new, empty) becomes a copy of src: src's full blocks shared read-only, its partly written last
        block copied (dst writes there next), its recurrent state copied."""
        full = src.pos // BLOCK_SIZE
        self.kv.share(src.blocks[:full])
        dst.blocks += src.blocks[:full]
        dst.shared = full
        if src.pos % BLOCK_SIZE:
            [b] = self.kv.allocate(1)
            for table in (self.kv.k, self.kv.v):
                for t in table.values():
                    t[b].copy_(t[src.blocks[full]])
            dst.blocks.append(b)
        dst.pos = src.pos
        if self.rec is not None:
            self._copy(src.slot, dst.slot)

    def reclaim(self, n: int) -> None:
        """Free up to n KV blocks by evicting least recently used pages no sequence reads."""
        def freeable(node: Node) -> int:
            return len(node.blocks) if all(self.kv.holders(b) == 1 for b in node.blocks) else 0

        got = self.tree.evict(n, freeable, self._drop)
        counters.bump("prefix_evicted_blocks", got)

    def _drop(self, node: Node) -> None:
        self.kv.release(list(node.blocks))
        node.blocks = ()
        self.drop_snapshot(node)

    # --- recurrent snapshots ---
    def take_snapshot(self, node: Node, cache: Cache) -> bool:
        """Copy the sequence's recurrent state (it stands at node.end) into a snapshot of the node."""
        if not self.hybrid or node.snap is not None or self.max_snapshots <= 0:
            return False
        assert cache.pos == node.end, f"a snapshot at {node.end} taken from a cache at {cache.pos}"
        if len(self._snaps) >= self.max_snapshots:
            self.drop_snapshot(next(iter(self._snaps)))
        try:
            slot = self.rec.allocate(zeroed=False)  # the copy below writes all of it
        except MemraError:  # the pools' budget is spent on running sequences: no snapshot this time
            return False
        self._copy(cache.slot, slot)
        node.snap = slot
        self._snaps[node] = None
        counters.bump("prefix_snapshots")
        return True

    def restore_snapshot(self, node: Node, cache: Cache) -> None:
        self._copy(node.snap, cache.slot)
        self._snaps.move_to_end(node)

    def drop_snapshot(self, node: Node) -> None:
        if node.snap is not None:
            self.rec.release(node.snap)
            node.snap = None
            del self._snaps[node]

    def _copy(self, src: int, dst: int) -> None:
        self.rec.copy_slot(src, dst)
