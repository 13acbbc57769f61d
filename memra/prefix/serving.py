"""The engine's prefix cache (promise E8): how much of a prompt is cached, resuming from it, and what a
prime adds to it. The engine calls three hooks: `offer` before it schedules, `attach` when it makes a
sequence's cache, `record` after a step's prefill chunks ran.

What is cached: only what a cold prime of a later prompt writes bit for bit.
- Pages of 64 prompt tokens at absolute multiples of 64, primed by the prefill arithmetic: their KV
  rows are the same bits whichever prime wrote them (E5: forwards cut on the same 64-grid; on CUDA a
  row's bits do not depend on its forward). A prompt's last partial page is not cached (on CPU the
  forward that wrote it had fewer rows than the one a longer prompt runs), nor is anything a decode
  step wrote (GDN's recurrent form is another algorithm; CPU linear rows depend on M). A chat's next
  turn therefore re-primes the previous answer, as prompt text.
- For GDN layers, snapshots of the conv and delta-rule state at page ends, taken right after the
  chunk that ends there (the scheduler cuts chunks at those `stops`): always the prompt's last aligned
  cut, the cut where it leaves the cached tree (the branch: the next prompt sharing that much resumes
  there), and one every `spacing` tokens.
A hit resumes at a 64-aligned cut below the prompt's end (at least one token is primed: its logits
choose the first token), restoring the snapshot there on hybrids, and primes the rest on the same grid.

Sharing a prime: a waiting request whose prefix a running (or earlier queued) request is about to
prime, beyond what the tree holds, waits for it (`held`), then resumes from it: n > 1 choices and
prompts that share a prefix (GRPO-style rollouts) prime the shared part once. A hybrid's running prime
is asked to stop (and snapshot) where the waiting one branches off.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from memra import counters
from memra.cache import Cache
from memra.prefix.store import BLOCKS_PER_PAGE, PrefixStore
from memra.prefix.tree import PAGE, Node, pages_of


@dataclass
class PrefixState:
    """One sequence's view of the prefix cache."""

    pages: list[tuple[int, ...]]
    version: int = -1  # the tree's version at the last lookup
    cut: int = 0  # where it resumes (tokens served from the cache)
    path: list[Node] = field(default_factory=list)  # the nodes up to `cut`
    stops: frozenset[int] = frozenset()  # snapshot cuts of its prime
    node: Node | None = None  # the deepest node of its own prime so far (None: it adds nothing more)
    held: bool = False
    twins: dict = field(default_factory=dict)  # rid -> a waiting sequence with this very prompt, forked once primed
    fork_of: object | None = None  # the sequence whose primed prompt this one's cache copies (set at the fork)


def snapshot_stops(length: int, cut: int, branch: int, spacing: int) -> set[int]:
    """The snapshot policy: a prompt of `length` tokens resumed at `cut`, leaving the tree at `branch`."""
    last = length // PAGE * PAGE
    stops = {m for m in range(spacing, last, spacing)} | {last, branch}
    return {s for s in stops if cut < s <= last}


class NoPrefixCache:
    """The engine's hooks where prefix caching is off (or a process pipeline: its ranks keep their caches)."""

    def offer(self, scheduler, seqs) -> None:
        pass

    def attach(self, s, cache: Cache, metrics=None) -> Cache:
        return cache

    def record(self, s, start: int, n: int) -> int:
        return n

    def forks(self, s, scheduler, new_cache) -> list:
        return [s]

    def clear(self) -> None:
        pass


class PrefixCache:
    def __init__(self, store: PrefixStore, spacing: int, whole_prime=lambda s: False):
        """whole_prime(seq): whether a sequence must prime its whole prompt itself (an MTP drafter needs every
        prompt position's hidden state): it is neither served from the cache nor adds to it."""
        self.store, self.spacing, self.whole_prime = store, spacing, whole_prime
        self.queried = 0  # prompt tokens of the sequences started with the cache on
        self.served = 0  # ... of which came from it

    @property
    def tree(self):
        return self.store.tree

    def clear(self) -> None:
        """Drop every cached page and snapshot (the weights changed: memra.engine.weight_swap). Called with no
        sequence running, so the tree holds the only hold on every page's blocks."""
        self.store.reclaim(1 << 62)
        assert not len(self.tree), "a cached page outlived a prefix-cache clear (a sequence still holds it)"

    # --- before scheduling ---
    def offer(self, scheduler, seqs: dict) -> None:
        """Tell the scheduler how much of each request that could start now is cached, where its chunks stop,
        and whether it waits for a prime in flight."""
        # The primes in flight or queued ahead, by first page: only one that shares a request's first page
        # (or, under a page, its whole prompt) can hold it, so a lookup walks its own group, not every prime:
        # with hundreds waiting and primes in flight, every step's lookups were O(waiting x primes).
        earlier: dict[tuple, list] = {}
        for s in seqs.values():
            if s.cache is not None and s.prefix is not None and s.prefix.node is not None and s.cache.pos < len(s.prompt):
                earlier.setdefault(_group(s), []).append(s)
        blocked = False  # admission stops at the first held request: the ones behind it start no prime now
        for rid in scheduler.waiting_head():
            s = seqs[rid]
            st = s.prefix = s.prefix or PrefixState(pages_of(s.prompt))
            if st.version != self.tree.version or st.held or blocked:
                self._look_up(s, st, earlier.get(_group(s), ()), scheduler)
                scheduler.set_cached(rid, st.cut, tuple(sorted(st.stops)), st.held)
            blocked = blocked or st.held
            if not blocked and not self.whole_prime(s):  # one that adds no page serves nobody: nobody waits for it
                earlier.setdefault(_group(s), []).append(s)

    def _look_up(self, s, st: PrefixState, earlier, scheduler) -> None:
        """`earlier`: the primes ahead of `s` in its group (_group), oldest first."""
        if self.whole_prime(s):
            st.version, st.held, st.stops = self.tree.version, False, frozenset()
            return
        limit = (len(s.prompt) - 1) // PAGE  # pages a hit may cover: at least one token is primed
        matched = self.tree.match(st.pages)
        usable = [i for i, n in enumerate(matched[:limit]) if not self.store.hybrid or n.snap is not None]
        depth = usable[-1] + 1 if usable else 0
        st.version, st.path, st.cut = self.tree.version, matched[:depth], depth * PAGE
        branch = len(matched) * PAGE
        st.held = False
        for e in earlier:  # a prime in flight of more of this prompt than the tree holds: wait for it
            shared = _common_pages(st.pages[:limit], e.prefix.pages) * PAGE
            at = e.cache.pos if e.cache is not None else e.prefix.cut  # a queued one starts at its cut
            if len(e.prompt) == len(s.prompt) and e.prompt == s.prompt and not self.whole_prime(e):
                st.held = True  # the very prompt: forked from it once primed (forks)
                e.prefix.twins[s.rid] = s
            elif shared > max(branch, st.cut) and at < shared:
                st.held = True
                if self.store.hybrid:
                    scheduler.add_stop(e.rid, shared)
                    e.prefix.stops = e.prefix.stops | {shared}
        st.stops = frozenset(snapshot_stops(len(s.prompt), st.cut, branch, self.spacing)) if self.store.hybrid \
            else frozenset()

    # --- a sequence's cache is made ---
    def attach(self, s, cache: Cache, metrics=None) -> Cache:
        """Start the new cache at the sequence's cached cut: the path's blocks shared, the snapshot restored.
        `metrics`: the server's (memra.server.metrics), which counts the lookup."""
        st = s.prefix
        if st is None:
            return cache
        if st.fork_of is not None:
            return self._fork(s, st, cache, metrics)
        st.node = None if self.whole_prime(s) else self.tree.root
        if st.cut:
            assert len(st.path) * PAGE == st.cut and all(n.alive for n in st.path), "a hit evicted before its start"
            blocks = [b for n in st.path for b in n.blocks]
            self.store.kv.share(blocks)
            cache.blocks += blocks
            cache.shared = len(blocks)
            cache.pos = st.cut
            if self.store.hybrid:
                self.store.restore_snapshot(st.path[-1], cache)
            st.node = st.path[-1]
            self.tree.touch(st.node)
        s.cached = st.cut
        self.queried += len(s.prompt)
        self.served += st.cut
        counters.bump("prefix_queried_tokens", len(s.prompt))
        counters.bump("prefix_cached_tokens", st.cut)
        if metrics is not None:
            metrics.prefix_lookup(len(s.prompt), st.cut)
        return cache

    def forks(self, s, scheduler, new_cache) -> list:
        """`s` has just primed its whole prompt: it, and the waiting twins of its prompt that start now as
        copies of it (KV blocks shared, the partial last block and the recurrent state copied). Each samples
        its first token from the same last-position logits, with its own seed: what its own prime would give."""
        st = s.prefix
        if st is None or not st.twins:
            return [s]
        out, twins, st.twins = [s], st.twins, {}
        for t in twins.values():
            if t.done or t.cache is not None or t.prefix is None or t.prefix.held is False:
                continue
            if not scheduler.fork(t.rid):
                break  # no place or blocks now: it starts later from the cached pages
            t.prefix.fork_of, t.prefix.held = s, False
            t.cache = new_cache(t)
            out.append(t)
        return out

    def _fork(self, s, st: PrefixState, cache: Cache, metrics) -> Cache:
        self.store.fork(st.fork_of.cache, cache)
        st.fork_of, st.node, s.cached = None, None, len(s.prompt)
        self.queried += len(s.prompt)
        self.served += len(s.prompt)
        counters.bump("prefix_queried_tokens", len(s.prompt))
        counters.bump("prefix_cached_tokens", len(s.prompt))
        counters.bump("prefix_forks")
        if metrics is not None:
            metrics.prefix_lookup(len(s.prompt), len(s.prompt))
        return cache

    # --- after a step's prefill chunks ---
    def record(self, s, start: int, n: int) -> int:
        """Add the pages this prefill chunk completed to the tree, and a snapshot where it ended at a stop.
        -> n (the prompt tokens the chunk primed, which the engine reports)."""
        st, cache = s.prefix, s.cache
        if st is not None and st.node is not None:
            self._record(st, cache, start + n)
        return n

    def _record(self, st: PrefixState, cache: Cache, end: int) -> None:
        node = st.node
        if not node.alive or cache.shared != node.depth * BLOCKS_PER_PAGE:  # evicted, or swapped out and back
            st.node = None
            return
        while node.end + PAGE <= end:
            page = st.pages[node.depth]
            child = node.children.get(page)
            first = node.depth * BLOCKS_PER_PAGE
            if child is None:
                child = self.store.add_page(node, page, cache.blocks[first : first + BLOCKS_PER_PAGE])
            elif list(child.blocks) != cache.blocks[first : first + BLOCKS_PER_PAGE]:
                self.store.adopt(cache, child)
            else:
                self.tree.touch(child)
            cache.shared = child.depth * BLOCKS_PER_PAGE
            node = child
        st.node = node
        if end in st.stops and node.end == end:
            self.store.take_snapshot(node, cache)

    def hit_rate(self) -> float:
        return self.served / self.queried if self.queried else 0.0


def _group(s) -> tuple:
    """What a prime must share with a request to hold it: its first page (a shared prefix of a page or more),
    or, for a prompt under a page, the prompt itself (only its very twin holds it)."""
    return s.prefix.pages[0] if s.prefix.pages else tuple(s.prompt)


def _common_pages(a: list, b: list) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
