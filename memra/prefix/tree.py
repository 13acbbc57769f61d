"""The prefix tree: which 64-token pages of prompts are cached, and in what order they were last used.

Pure Python (no torch), so it is tested without a model. A node is one page: the 64 tokens at
positions [64 d, 64 d + 64) of every prompt whose first 64 (d + 1) tokens are the path from the root to
it. A child is keyed by its page's token tuple under its parent, so the key of a node is its whole token
prefix, compared exactly (a dict's hash, then equality: no hash collision can serve another prompt's
bits). A node holds what a cold prime of that prefix writes for the page: its KV blocks (handles of
the KV pool, refcounted there) and, for hybrid models, optionally a snapshot of the recurrent state at
the page's end (a slot handle); the tree only stores the handles.

Recency: `touch(node)` marks the node and its ancestors used, leaf first, so a node is never older than
a descendant; the least recently used node is then always a leaf, and eviction walks from the oldest.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Iterator

PAGE = 64  # tokens per node: the E5 grid, so every node's end is a cut a prime may resume at


@dataclass(eq=False)
class Node:
    page: tuple[int, ...]
    parent: "Node | None"
    depth: int  # pages from the root to this node, itself included: it ends at position PAGE * depth
    blocks: tuple[int, ...] = ()
    snap: int | None = None  # recurrent-state slot holding the state after this page, or None
    children: dict = field(default_factory=dict)
    alive: bool = True

    @property
    def end(self) -> int:
        return PAGE * self.depth


def pages_of(prompt: list[int]) -> list[tuple[int, ...]]:
    """The prompt's whole pages, in order."""
    return [tuple(prompt[i : i + PAGE]) for i in range(0, len(prompt) - PAGE + 1, PAGE)]


class PrefixTree:
    def __init__(self) -> None:
        self.root = Node((), None, 0)
        self._lru: OrderedDict[Node, None] = OrderedDict()  # oldest first; every node but the root
        self.version = 0  # bumped on every insert or removal: a lookup made before is stale

    def __len__(self) -> int:
        return len(self._lru)

    def match(self, pages: list[tuple[int, ...]]) -> list[Node]:
        """The longest path of cached nodes equal to the leading pages."""
        path, node = [], self.root
        for page in pages:
            node = node.children.get(page)
            if node is None:
                break
            path.append(node)
        return path

    def insert(self, parent: Node, page: tuple[int, ...], blocks: tuple[int, ...]) -> Node:
        """A new child of `parent` (which must be alive and lack this page)."""
        assert parent.alive and page not in parent.children, "insert over a live node"
        node = Node(page, parent, parent.depth + 1, blocks)
        parent.children[page] = node
        self._lru[node] = None
        self.touch(node)
        self.version += 1
        return node

    def touch(self, node: Node) -> None:
        while node is not self.root and node is not None:
            self._lru.move_to_end(node)
            node = node.parent

    def oldest(self) -> Iterator[Node]:
        """Nodes from the least recently used (a snapshot of the order: callers remove while iterating)."""
        return iter(list(self._lru))

    def remove_leaf(self, node: Node) -> None:
        assert node.alive and not node.children, "only a live leaf is removed"
        del node.parent.children[node.page]
        del self._lru[node]
        node.alive = False
        self.version += 1

    def evict(self, want: int, freeable: Callable[[Node], int], drop: Callable[[Node], None]) -> int:
        """Remove least recently used leaves whose removal frees something (`freeable(node)` > 0 of
        what is wanted), calling `drop` on each, until `want` is met or none is left. -> what was freed.
        Removing a leaf can make its parent a leaf, which the same walk then meets (it is newer)."""
        got = 0
        while got < want:
            victim = next((n for n in self._lru if not n.children and freeable(n) > 0), None)
            if victim is None:
                break
            got += freeable(victim)
            drop(victim)
            self.remove_leaf(victim)
        return got
