"""Radix tree of cached prefixes: token ids -> full-attention KV pages and linear-state snapshots.

Each edge holds a run of tokens that is a whole number of KV pages, and the ids of those pages;
every node therefore ends on a page boundary. A node may also hold a snapshot (an id in the
snapshot pool, runtime/cache/snapshot_pool.py): the state of every linear layer after the node's last
token. A prefix can be reused only up to a node with a snapshot: the KV pages alone do not give a
hybrid model the linear layers' state.

1. `match(tokens, limit)` walks the tree from the root a page at a time, never past `limit`
   tokens, and returns the deepest node with a snapshot on the way (`PrefixMatch`: its length,
   its pages, its snapshot) and how far the KV pages alone matched (`kv_tokens`).
2. `insert(tokens, pages)` adds a page-aligned prefix whose KV a request has computed. Where the
   tree already holds pages for a part of it, it keeps its own and returns them, so the request
   can use those instead of its duplicates; for the rest it adopts the request's pages (one more
   reference each in the KV pool). An edge that the new prefix leaves in the middle is split.
3. `set_snapshot(node, id)` attaches a snapshot; `evict_snapshot()` drops the least recently used
   one (made or hit longest ago) when the snapshot pool is full, from a heap of uses kept beside
   the tree (a full pool evicts one in most steps: a walk of every node each time grew with the tree).
   A snapshot a request continued from and then passed with a deeper one (`supersede`) goes
   before all the others.
4. `evict_pages(free_target)` removes least recently used leaves until the KV pool has that many
   free pages. A leaf is removed only if no request holds its pages (the tree's is the only
   reference): the pages a running request uses are never evicted. Leaves without a snapshot go
   first: pages alone give no hit, they only show a later request where it parts from them.
5. `clear()` drops every node, reference and snapshot.

References, not locks: the KV pool counts the holders of each page, the tree holds one reference
to each of its pages, and a request that reuses a prefix holds one more (runtime/cache/prefix_cache.py).
A request that inserts a prefix then takes the tree's pages for it, so the path of any running
request is made of pages it holds, and everything else in the tree can be evicted, leaf by leaf.

It does not copy state (the snapshot pool does), choose when to snapshot, or schedule anything.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools

from runtime.cache.kv_pool import KVPool
from runtime.cache.snapshot_pool import SnapshotPool

__all__ = ["RadixCache", "PrefixMatch"]


class _Node:
    __slots__ = ("key", "pages", "parent", "children", "snapshot", "end", "last_use", "snapshot_use")

    def __init__(self, key: tuple[int, ...], pages: list[int], parent: "_Node | None", end: int):
        self.key = key  # the edge's tokens: len(pages) whole pages
        self.pages = pages
        self.parent = parent
        self.children: dict[tuple[int, ...], _Node] = {}  # by the first page of their key
        self.snapshot: int | None = None  # state after token end - 1
        self.end = end  # tokens from the root to the end of this edge
        self.last_use = 0  # clock of the last match or insert through this node (page eviction)
        self.snapshot_use = 0  # clock of the last hit on, or the making of, its snapshot


@dataclasses.dataclass(frozen=True)
class PrefixMatch:
    tokens: int  # the reusable prefix: tokens up to the deepest node with a snapshot (0: none)
    pages: list[int]  # the KV pages of those tokens
    snapshot: int | None  # the snapshot id at that node
    kv_tokens: int  # how far the KV pages alone match (>= tokens): where the request leaves the tree
    node: _Node


class RadixCache:
    def __init__(self, kv_pool: KVPool, snapshots: SnapshotPool):
        self.kv_pool = kv_pool
        self.snapshots = snapshots
        self.page_size = kv_pool.page_size
        self.root = _Node((), [], None, 0)
        self._clock = itertools.count(1)
        self.num_pages = 0  # pages the tree holds a reference to
        self.num_snapshots = 0
        # (snapshot_use, end, tie, node) for every snapshot made or hit, oldest use first: the
        # eviction order without walking the tree. An entry whose node has since lost its snapshot
        # or been used again is stale and skipped (`evict_snapshot`).
        self._snapshot_uses: list = []
        self._tie = itertools.count()
        self.evicted_pages = 0  # given back to the KV pool under pressure, over the tree's life

    # -- lookup -----------------------------------------------------------------------------------

    def _common_pages(self, node: _Node, tokens: tuple[int, ...], pos: int, limit: int) -> int:
        """Whole pages of node's edge equal to tokens[pos:], not reaching past `limit` tokens."""
        ps, key = self.page_size, node.key
        n = min(len(key), (limit - pos) // ps * ps)
        if key[:n] == tokens[pos:pos + n]:  # the usual case, compared in one go
            return n // ps
        i = 0
        while i < n and key[i] == tokens[pos + i]:
            i += 1
        return i // ps

    def match(self, tokens, limit: int) -> PrefixMatch:
        """The deepest node with a snapshot on the path of tokens[:limit] (whole pages only)."""
        tokens = tuple(tokens)
        ps = self.page_size
        node, pos, pages = self.root, 0, []
        best, best_end = self.root, 0
        while pos + ps <= limit:
            child = node.children.get(tokens[pos:pos + ps])
            if child is None:
                break
            k = self._common_pages(child, tokens, pos, limit)
            pages.extend(child.pages[:k])
            if k < len(child.pages):
                pos += k * ps
                break
            node, pos = child, child.end
            if child.snapshot is not None:
                best, best_end = child, child.end
        return PrefixMatch(best_end, pages[: best_end // ps], best.snapshot, pos, best)

    def use(self, match: PrefixMatch) -> None:
        """A request took `match`: it and the path to it are the most recently used."""
        self._touch(match.node)
        match.node.snapshot_use = match.node.last_use
        self._note_snapshot_use(match.node)

    def supersede(self, node: _Node) -> None:
        """A request that continued from node's snapshot has taken a deeper one on the same path:
        node's goes first when the pool needs room (a chat's turn needs the state its last turn
        ended with, not the one before), until a hit makes it recent again (`use`)."""
        if node.snapshot is None:
            return
        node.snapshot_use = -next(self._clock)  # below every use: the most recently superseded first
        self._note_snapshot_use(node)

    def _touch(self, node: _Node) -> None:
        stamp = next(self._clock)
        while node is not None:
            node.last_use = stamp
            node = node.parent

    # -- insertion --------------------------------------------------------------------------------

    def insert(self, tokens, pages: list[int]) -> tuple[_Node, list[int]]:
        """Add tokens (whole pages) with the request's `pages` for them; returns the node ending at
        len(tokens) and the tree's pages for the whole prefix (the request's where it had none)."""
        tokens = tuple(tokens)
        ps, end = self.page_size, len(tokens)
        assert end % ps == 0 and len(pages) >= end // ps, "insert: a whole number of pages, and their ids"
        node, pos, held = self.root, 0, []
        while pos < end:
            child = node.children.get(tokens[pos:pos + ps])
            if child is None:
                child = _Node(tokens[pos:end], list(pages[pos // ps: end // ps]), node, end)
                self.kv_pool.share(child.pages)  # the tree's own reference
                self.num_pages += len(child.pages)
                node.children[tokens[pos:pos + ps]] = child
            else:
                k = self._common_pages(child, tokens, pos, end)
                if k < len(child.pages):
                    child = self._split(child, k)
            held.extend(child.pages)
            node, pos = child, child.end
        self._touch(node)
        return node, held

    def _split(self, node: _Node, k: int) -> _Node:
        """Cut node's edge after k pages; returns the new upper node (the lower keeps its snapshot)."""
        ps = self.page_size
        upper = _Node(node.key[: k * ps], node.pages[:k], node.parent, node.end - len(node.key) + k * ps)
        upper.last_use = node.last_use
        upper.parent.children[upper.key[:ps]] = upper
        node.key, node.pages, node.parent = node.key[k * ps:], node.pages[k:], upper
        upper.children[node.key[:ps]] = node
        return upper

    def set_snapshot(self, node: _Node, snapshot: int) -> None:
        assert node.snapshot is None and node is not self.root, "set_snapshot: the node has one, or is the root"
        node.snapshot = snapshot
        node.snapshot_use = next(self._clock)
        self.num_snapshots += 1
        self._note_snapshot_use(node)

    def _note_snapshot_use(self, node: _Node) -> None:
        if node.snapshot is None:
            return
        heapq.heappush(self._snapshot_uses, (node.snapshot_use, node.end, next(self._tie), node))
        if len(self._snapshot_uses) > 2 * self.num_snapshots + 64:  # drop the stale entries now and then
            self._snapshot_uses = [e for e in self._snapshot_uses if self._current(e)]
            heapq.heapify(self._snapshot_uses)

    @staticmethod
    def _current(entry) -> bool:
        """Whether a snapshot-use entry still stands: its node holds a snapshot, last used then."""
        return entry[3].snapshot is not None and entry[3].snapshot_use == entry[0]

    # -- eviction ---------------------------------------------------------------------------------

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            yield node

    def _evictable(self, node: _Node) -> bool:
        """A leaf whose pages nobody but the tree holds."""
        return (node is not self.root and not node.children
                and all(self.kv_pool.holders(p) == 1 for p in node.pages))

    def _remove(self, node: _Node) -> None:
        self.kv_pool.free(node.pages)
        self.num_pages -= len(node.pages)
        self.evicted_pages += len(node.pages)
        if node.snapshot is not None:
            self.snapshots.free(node.snapshot)
            self.num_snapshots -= 1
            node.snapshot = None  # its entries in the eviction order are stale now
        del node.parent.children[node.key[: self.page_size]]

    def evict_pages(self, free_target: int) -> None:
        """Remove unused leaves, snapshot-less first, then least recently used, until the KV pool
        has `free_target` free pages or nothing more can go."""
        tie = itertools.count()  # heap order among equal keys, without comparing nodes
        heap = [(n.snapshot is not None, n.last_use, next(tie), n) for n in self._nodes() if self._evictable(n)]
        heapq.heapify(heap)
        while self.kv_pool.num_free < free_target and heap:
            node = heapq.heappop(heap)[-1]
            self._remove(node)
            parent = node.parent
            if self._evictable(parent):
                heapq.heappush(heap, (parent.snapshot is not None, parent.last_use, next(tie), parent))

    def evict_snapshot(self) -> int | None:
        """Drop the least recently used snapshot (and its node, if that leaves a leaf nobody else
        holds); returns the freed id, None if the tree holds none."""
        while self._snapshot_uses and not self._current(self._snapshot_uses[0]):
            heapq.heappop(self._snapshot_uses)
        if not self._snapshot_uses:
            return None
        node = heapq.heappop(self._snapshot_uses)[3]  # the lowest (snapshot_use, end)
        freed, node.snapshot = node.snapshot, None
        self.snapshots.free(freed)
        self.num_snapshots -= 1
        while node.snapshot is None and self._evictable(node):  # pages alone give no hit
            self._remove(node)
            node = node.parent
        return freed

    def held_pages(self) -> list[int]:
        """Every page the tree holds a reference to."""
        return [p for node in self._nodes() for p in node.pages]

    def reclaimable_pages(self) -> int:
        """Pages held by the tree alone: the KV pool gets them back by eviction when it needs them."""
        return sum(self.kv_pool.holders(p) == 1 for node in self._nodes() for p in node.pages)

    def clear(self) -> None:
        """Drop every node: the tree's page references and its snapshots."""
        for node in list(self._nodes()):
            self.kv_pool.free(node.pages)
            if node.snapshot is not None:
                self.snapshots.free(node.snapshot)
        self.root.children.clear()
        self._snapshot_uses = []
        self.num_pages = self.num_snapshots = 0
