"""Prefix cache for hybrid models: which prefix a request reuses, where its chunks end, when it snapshots.

A reused prefix is two things: the full-attention KV pages of its tokens (shared by reference,
never copied: runtime/cache/radix_cache.py) and the state of every linear layer after its last token
(a snapshot, copied into the request's own slot: runtime/cache/snapshot_pool.py). Both exist only at
page boundaries, so a hit is always a whole number of pages, at any page boundary. The engine
calls, in its step:

1. Admission: `take(tokens, prompt_len)` finds the longest prefix that ends at a node with a
   snapshot, at most all tokens but the last (the last one must run to give the logits of the
   next), and holds a reference to its pages; `attach(hold, seq)` then gives the pages to the
   request, sets its cached-token count and copies the snapshot into its slot, or `drop(hold)`
   lets go if the request cannot be admitted this step.
2. Scheduling: `chunk(hold, start, n, total)` shortens a chunk so that it ends on a snapshot
   point (below) that the step does not write itself, and so that a chunk that does not finish
   the request's tokens ends on a page boundary. Where a step stops, a request's slot holds its
   state after its last token of the step, which the cache copies into a snapshot (3). A point
   inside a chunk the step writes itself when `in_step` (the engine sets it: every backend that
   runs a linear layer's state op writes in-step snapshots, `writes_step_snapshots` in
   runtime/backends/protocol.py): `before_step(entries)`, just before the forward, gives the
   first point inside a request's chunk a snapshot id (evicting the least recently used
   snapshot when none is free), and the step's linear ops write the state after that token
   into it, in the snapshot pool's layout (`SeqState.snapshot`, laid out as the step's
   ExecContext.snapshot_rows / snapshot_ids; the other ranks of a tensor-parallel run get them
   with the step). A chunk still ends at a second point inside it. Without `in_step` (the Triton
   and FLA kernels today: they give the state after a request's last token of the step alone) a
   chunk ends at every point inside it, and the request takes one more step there.
3. After the forward: `after_step(entries)` inserts the prefix of each in-step snapshot into the
   tree with it (or frees its id where the tree has one there already), snapshots each request
   that stopped on a page boundary it should snapshot at, inserts its prefix into the tree and
   makes the request use the tree's pages for it (a duplicate of pages the tree has is freed).
   Those copies are issued on the host side of the step, between the forward and the next step,
   never inside a captured graph. A request whose prompt is all in the cache now also inserts the
   prompt's whole pages, without a snapshot: a later request can then see where it parts from
   this one (its branch point). A request released with an in-step id its step has not put in
   the tree (`drop_step_snapshot`, from the scheduler's release) gives it back: no id leaks.
4. Memory: `reclaim(free_target)` evicts unused cached prefixes when the KV pool runs short; a
   full snapshot pool drops its least recently used snapshot.

Snapshot points of a request (positions, in tokens from its start, all page boundaries). Where
one is not the end of a chunk anyway and the step does not write it (2), the chunk is split there:
the request takes one more step, of the tokens after the point. A step costs much more than its
tokens on a GPU (an extend step has a floor of several milliseconds), so splits are kept to where
they pay:

- the branch point: where its tokens leave the tree's KV pages, when no snapshot is there yet.
  The second request of a family that shares a prefix (a system prompt, a chat so far) pays one
  split and every later one hits the whole shared part.
- the end of its prompt (`snapshot_prompt_end`): the prompt's end itself when that is a page
  boundary (a chunk ends there: no split), which a longer prompt continuing this one (the next
  turn of a chat) hits; otherwise, on a miss, the last page boundary before the end (a split),
  which an identical prompt hits. A request that hit the cache takes that split only when at
  least `hit_snapshot_tokens` tokens lie between its hit and the boundary: a short suffix after a
  hit (the one step after it is the time to first token the cache is for) takes none, while the
  next turn of a chat, whose prompt is the last turn's prompt, output and new words, does, so the
  turn after it hits nearly all of its prompt instead of the first turn's snapshot again. So an
  identical repeat of a page-aligned prompt, or of a prompt that hit, finds its snapshot from the
  third request on (the second snapshots the branch point).
- chunk ends, at least `snapshot_interval` tokens after its previous snapshot: long prompts
  then leave snapshots along the way that partial matches can use (with the default budget of
  512 tokens a step, the end of every fourth chunk).
- the end of its output (`snapshot_output_end`): the last page boundary its decode steps reach
  if it runs to max_new_tokens (its last sampled token is never fed), at that decode step (no
  split). The next turn of a chat is this prompt, this output and new words: it hits all but the
  output's last partial page, so a turn prefills its new words alone, not the last turn's output
  too. A request that stops early never reaches the point and takes nothing there.
- with `snapshot_output`, the same cadence over its generated tokens, at decode steps that end on
  a page boundary (no split).

Chunks that do not finish a request's tokens end at page boundaries while caching, so at most
page_size - 1 tokens of a step's budget per prefilling request go unused.

Speculative decoding (not built yet) must keep one rule: a snapshot is only ever taken of state
after verified tokens. `after_step` snapshots the state at `seq.num_cached`, which counts only
tokens that are part of the request; a verify step must call it after acceptance has written the
accepted state into the slot and set num_cached to the accepted length, never before.

It does not schedule requests (the engine does) nor size the pools (the memory planner does).
"""

from __future__ import annotations

import dataclasses

from runtime.cache.batch import SeqState
from runtime.cache.kv_pool import KVPool
from runtime.cache.radix_cache import PrefixMatch, RadixCache
from runtime.cache.snapshot_pool import SnapshotPool
from runtime.cache.state_pool import StatePool

__all__ = ["PrefixCache", "PrefixCacheConfig", "CacheHold", "DEFAULT_SNAPSHOT_INTERVAL"]

# A snapshot costs about as much memory as this many tokens of KV (Qwen3-Next-80B: 77 MB of linear
# state against 24 KB of KV per token, ~3,100 tokens), so a prefix keeps its snapshots' share of
# its memory near its KV's.
DEFAULT_SNAPSHOT_INTERVAL = 2048


@dataclasses.dataclass(frozen=True)
class PrefixCacheConfig:
    snapshot_interval: int = DEFAULT_SNAPSHOT_INTERVAL  # tokens between chunk-end snapshots of one request
    snapshot_prompt_end: bool = True
    # A hit snapshots its prompt's last page boundary too (a split: one more step, of fewer than a
    # page of tokens) when that many tokens or more lie between the hit and it; 0: never. A chat's
    # turn (the last turn's output and the new words: hundreds of tokens) takes it, a short
    # suffix after a shared prefix does not.
    hit_snapshot_tokens: int = 128
    snapshot_output_end: bool = True  # the last page boundary a request's output reaches (a chat's next turn)
    snapshot_output: bool = False

    def __post_init__(self):
        if self.snapshot_interval < 1:
            raise ValueError(f"--snapshot-interval must be at least 1 (got {self.snapshot_interval})")
        if self.hit_snapshot_tokens < 0:
            raise ValueError(f"hit_snapshot_tokens must be at least 0 (got {self.hit_snapshot_tokens})")


@dataclasses.dataclass
class CacheHold:
    """One request's dealings with the cache, from its admission to its end (or preemption)."""

    match: PrefixMatch
    points: tuple[int, ...]  # snapshot points ahead of it where a chunk must end, ascending
    snapshot_at: int  # its last snapshot (or the hit it started from)
    prompt_inserted: bool = False  # the prompt's whole pages are in the tree
    node: object = None  # the tree node of that snapshot (None: no snapshot yet)

    @property
    def tokens(self) -> int:
        return self.match.tokens


class PrefixCache:
    def __init__(self, kv_pool: KVPool, state_pool: StatePool, snapshots: SnapshotPool,
                 config: PrefixCacheConfig = PrefixCacheConfig()):
        self.kv_pool = kv_pool
        self.state_pool = state_pool
        self.snapshots = snapshots
        self.config = config
        self.page_size = kv_pool.page_size
        self.tree = RadixCache(kv_pool, snapshots)
        # Whether steps write the snapshots at points inside their chunks (`before_step`); the engine
        # sets it from its backends' answer (`writes_step_snapshots`). False: a chunk ends at each point.
        self.in_step = False
        self.lookups = self.hits = self.lookup_tokens = self.hit_tokens = self.snapshots_taken = 0

    # -- admission ------------------------------------------------------------------------------

    def take(self, tokens: list[int], prompt_len: int, max_new_tokens: int = 0) -> CacheHold:
        """The longest reusable prefix of `tokens` and the snapshot points after it; holds its pages.
        max_new_tokens: the most the request generates (0: no point in its output)."""
        ps = self.page_size
        match = self.tree.match(tokens, len(tokens) - 1)  # the last token always runs
        points = {match.kv_tokens}  # the branch point (the hit itself when no KV lies beyond it)
        end = prompt_len // ps * ps
        if self.config.snapshot_prompt_end and (prompt_len % ps == 0 or match.tokens == 0 or (
                self.config.hit_snapshot_tokens and end - match.tokens >= self.config.hit_snapshot_tokens)):
            points.add(end)
        output_end = (prompt_len + max_new_tokens - 1) // ps * ps  # tokens fed once the last one is sampled
        if self.config.snapshot_output_end and output_end > prompt_len:
            points.add(output_end)
        self.kv_pool.share(match.pages)  # so that no eviction takes them before attach
        return CacheHold(match, tuple(sorted(p for p in points if p > match.tokens)), match.tokens,
                         node=match.node if match.snapshot is not None else None)

    def drop(self, hold: CacheHold) -> None:
        self.kv_pool.free(hold.match.pages)

    def attach(self, hold: CacheHold, seq: SeqState, num_tokens: int) -> None:
        """A fresh request state (of `num_tokens` tokens) takes the held prefix: its pages (the
        references `take` made) and its snapshot, copied into the request's slot."""
        assert not seq.pages and seq.num_cached == 0, "attach: the request must be fresh"
        match = hold.match
        seq.pages = list(match.pages)
        seq.num_cached = match.tokens
        if match.snapshot is not None:
            self.snapshots.restore(self.state_pool, [match.snapshot], [seq.slot])
            self.tree.use(match)
            self.hits += 1
        self.lookups += 1
        self.lookup_tokens += num_tokens
        self.hit_tokens += match.tokens

    # -- scheduling -----------------------------------------------------------------------------

    def chunk(self, hold: CacheHold, start: int, n: int, total: int) -> int:
        """n, or fewer tokens so that the chunk from `start` ends on the next snapshot point (with
        `in_step`, on the one after: the step writes the first itself) or, when it does not finish
        the request's `total` tokens, on a page boundary."""
        end = start + n
        inside = [point for point in hold.points if start < point < end]
        written = 1 if self.in_step else 0  # points the step snapshots inside its chunk
        if len(inside) > written:
            return inside[written] - start
        if end < total:
            aligned = end - end % self.page_size
            if aligned > start:
                return aligned - start
        return n

    # -- the step -------------------------------------------------------------------------------

    def before_step(self, entries) -> None:
        """With `in_step`, before the forward; entries: (hold, seq, n) of each request the step feeds
        n > 1 tokens. A snapshot point inside its chunk (at most one: `chunk`) gets a snapshot id
        now, which the step writes the state at that point into (`SeqState.snapshot`, laid out as
        ExecContext.snapshot_rows / snapshot_ids); `after_step` puts it in the tree."""
        if self.snapshots.num_snapshots == 0:
            return
        for hold, seq, n in entries:
            start = seq.num_cached
            point = next((p for p in hold.points if start < p < start + n), None)
            if point is None:
                continue
            if hold.node is not None:  # first, so that a full pool gives its room to this one
                self.tree.supersede(hold.node)
            snapshot = self._free_snapshot({})
            if snapshot is not None:
                seq.snapshot = (point, snapshot)

    def drop_step_snapshot(self, seq: SeqState) -> None:
        """A request leaves with an in-step snapshot its step has not put in the tree: the id goes back."""
        if seq.snapshot is not None:
            self.snapshots.free(seq.snapshot[1])
            seq.snapshot = None

    # -- after the forward ----------------------------------------------------------------------

    def _due(self, hold: CacheHold, pos: int, prompt_len: int) -> bool:
        if pos % self.page_size or pos <= hold.snapshot_at:
            return False
        if pos in hold.points:
            return True
        if pos > prompt_len and not self.config.snapshot_output:
            return False
        return pos - hold.snapshot_at >= self.config.snapshot_interval

    def reads_output(self, hold: CacheHold, seq: SeqState, prompt_len: int) -> bool:
        """Whether `after_step` would read the request's generated tokens now: a snapshot, or its
        prompt's insertion, past its prompt (the engine then reads them from the device first)."""
        pos = seq.num_cached
        if self.snapshots.num_snapshots == 0 or pos <= prompt_len:
            return False
        inserts_past_prompt = not hold.prompt_inserted and pos - pos % self.page_size > prompt_len
        return self._due(hold, pos, prompt_len) or inserts_past_prompt

    def after_step(self, entries) -> None:
        """entries: (hold, seq, prompt, output) of each request the step ran, after its commit.

        The state in a request's slot is now the state after its first seq.num_cached tokens, and
        the state at its in-step snapshot's point (`before_step`) is in that snapshot.
        """
        if self.snapshots.num_snapshots == 0:
            return  # pages alone give no hit: nothing to cache
        pending: dict[int, int] = {}  # snapshot id -> slot, saved together below
        page_size = self.page_size
        for hold, seq, prompt, output in entries:
            if seq.snapshot is not None:  # written by the step
                (at, snapshot), seq.snapshot = seq.snapshot, None
                hold.snapshot_at = at
                self._place(hold, seq, (prompt + output)[:at], snapshot)
            pos = seq.num_cached
            # `_due`'s first test inline: off a page boundary (most requests of a step) nothing is due
            if pos % page_size == 0 and self._due(hold, pos, len(prompt)):
                hold.snapshot_at = pos  # taken, or found already there, or no room: not tried again
                self._snapshot(hold, seq, (prompt + output)[:pos], pending)
            if not hold.prompt_inserted and pos >= len(prompt):
                hold.prompt_inserted = True
                whole = pos - pos % self.page_size
                _, tree_pages = self.tree.insert((prompt + output)[:whole], seq.pages)
                self._use_tree_pages(seq, tree_pages)
        self.snapshots.save(self.state_pool, list(pending.values()), list(pending))

    def _snapshot(self, hold: CacheHold, seq: SeqState, tokens: list[int], pending: dict[int, int]) -> None:
        """Insert tokens (the request's first seq.num_cached) with a snapshot of the request's slot;
        the request's snapshot before it (or the one it hit) is superseded (RadixCache.supersede)."""
        if hold.node is not None:  # first, so that a full pool gives its room to this one
            self.tree.supersede(hold.node)
        snapshot = self._free_snapshot(pending)
        if snapshot is not None and self._place(hold, seq, tokens, snapshot):
            pending[snapshot] = seq.slot

    def _place(self, hold: CacheHold, seq: SeqState, tokens: list[int], snapshot: int) -> bool:
        """Insert tokens (a prefix the request has run) with `snapshot`, the state after them: False
        (and the id freed) when the tree's node there has one already."""
        node, tree_pages = self.tree.insert(tokens, seq.pages)
        self._use_tree_pages(seq, tree_pages)
        hold.node = node
        if node.snapshot is not None:  # another request stopped here first
            self.snapshots.free(snapshot)
            return False
        self.tree.set_snapshot(node, snapshot)
        self.snapshots_taken += 1
        return True

    def _free_snapshot(self, pending: dict[int, int]) -> int | None:
        """A snapshot id, evicting the least recently used snapshot when none is free."""
        if self.snapshots.num_free == 0:
            freed = self.tree.evict_snapshot()
            if freed is None:
                return None  # a pool of no snapshots: caching is off in effect
            pending.pop(freed, None)  # taken earlier in this step: its save must not happen
        return self.snapshots.alloc()

    def _use_tree_pages(self, seq: SeqState, tree_pages: list[int]) -> None:
        """The request reads the tree's pages for its prefix from now on; its duplicates are freed.

        Both hold the same tokens' keys and values. Sharing them keeps the path of every running
        request made of pages it holds itself, so nothing the tree holds alone is stuck in it."""
        for i, page in enumerate(tree_pages):
            if seq.pages[i] != page:
                self.kv_pool.share([page])
                self.kv_pool.free([seq.pages[i]])
                seq.pages[i] = page

    # -- memory ---------------------------------------------------------------------------------

    def reclaim(self, free_target: int) -> None:
        """Evict cached prefixes nobody uses until the KV pool has `free_target` free pages (or none are left)."""
        if self.kv_pool.num_free < free_target:
            self.tree.evict_pages(free_target)

    def clear(self) -> None:
        self.tree.clear()

    def stats(self) -> dict:
        return {
            "prefix_cache_lookups": self.lookups,
            "prefix_cache_hits": self.hits,
            "prefix_cache_lookup_tokens": self.lookup_tokens,
            "prefix_cache_hit_tokens": self.hit_tokens,
            "prefix_cache_pages": self.tree.num_pages,
            "prefix_cache_snapshots": self.tree.num_snapshots,
            "prefix_cache_snapshot_slots": self.snapshots.num_snapshots,
            "prefix_cache_snapshot_slots_free": self.snapshots.num_free,
            "prefix_cache_snapshot_bytes": self.snapshots.nbytes(),
            "prefix_cache_snapshots_taken": self.snapshots_taken,
        }
