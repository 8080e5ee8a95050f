"""Paged KV block allocation: free pool, per-request block tables, ref counts, prefix cache.

A full block is identified by the hash of its tokens chained with its parent's hash
(block_hash.py: the same in every process), so equal prefixes map to the same blocks. Freed
blocks keep their hash and stay findable until the pool hands them out again; the pool is
ordered by release time, so the least recently used cached block is evicted first. Hashes that
become findable or stop being findable are recorded as numbered events (events_since: each
reader, e.g. one proxy each, with its own cursor; a bounded log) for the proxy's
cache-aware routing.

With KV tiers (engine/kv_tiers/: host memory, disk), an evicted hashed block is saved to the
host tier, and a prefix match continues there block by block: a block the device lacks but a
lower tier holds gets a fresh device block and a load op (run at the start of the step), and
counts as cached. Hashes entering or leaving the lower tiers are logged too (tier "lower").
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from pd_cluster.engine.block_hash import block_hash
from pd_cluster.engine.cache_events import (
    MAX_PENDING_EVENTS,
    CacheEventLog,
    CacheEvents,
)
from pd_cluster.engine.group_hits import (LOWER, accepted_length, cut_hits, first_entries,
                                          group_hits, table_lengths, tier_key)
from pd_cluster.engine.kv_groups import NULL_BLOCK, KVCacheGroup, has_sliding
from pd_cluster.engine.kv_tiers.manager import TierManager
from pd_cluster.engine.kv_tiers.ops import TierOps
from pd_cluster.request import Request


class BlockTableError(RuntimeError):
    """A block-table invariant broke (a request allocated twice, a block released more often
    than taken): a bug in the caller. Raised, not asserted, so ``python -O`` keeps the check."""


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] | None = None  # kept to rule out hash collisions on a hit
    group: int = 0  # the KV cache group whose hash it holds


@dataclass
class PrefixCacheStats:
    queried_blocks: int = 0
    hit_blocks: int = 0


def chain_hash(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    return block_hash(parent_hash, token_ids)


class BlockManager:
    """``groups`` (kv_groups.py): the layers' KV cache groups, each with its own block table
    per request over one pool (none given: one full-attention group, the layout without
    groups). With a sliding group, block ``NULL_BLOCK`` is reserved: its released entries."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 max_pending_events: int = MAX_PENDING_EVENTS, tiers: TierManager | None = None,
                 groups: Sequence[KVCacheGroup] | None = None):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.groups = tuple(groups) if groups else (KVCacheGroup(()),)
        self._reserved = 1 if has_sliding(self.groups) else 0
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict(
            (i, None) for i in range(self._reserved, num_blocks))
        # (group, chain hash) -> block; one group: group 0 only
        self.hash_to_block: dict[tuple[int, int], int] = {}
        self.tables: dict[str, list[list[int]]] = {}  # per request: one table per group
        # Per request: how many leading blocks are registered in the prefix cache (or skipped).
        self.hashed: dict[str, int] = {}
        self._released: dict[str, list[int]] = {}  # per request and group: entries nulled
        self.stats = PrefixCacheStats()
        # Each reader keeps its own cursor (one proxy's read hides nothing from another).
        self._events = CacheEventLog(max_pending_events)
        self._take_cursor = 0  # take_events()' own reader
        self.tiers = tiers if enable_prefix_caching else None
        if self.tiers is not None:  # each group's pages are their own entries (tier_key)
            self.tiers.on_event = lambda stored, h: self._events.record(stored, h, lower=True)

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_usable_blocks(self) -> int:
        """The pool less the reserved null block."""
        return self.num_blocks - self._reserved

    @property
    def num_used_blocks(self) -> int:
        return self.num_usable_blocks - len(self.free_queue)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_held_at_most(self, num_tokens: int, chunk: int) -> int:
        """Blocks a request of ``num_tokens`` holds at most over every group, computing at
        most ``chunk`` tokens a step (a sliding group: its window and the chunk)."""
        return sum(g.blocks_held(num_tokens, chunk, self.block_size) for g in self.groups)

    def new_blocks_needed(self, request: Request, total_tokens: int) -> int:
        """Fresh blocks the request's tables need to cover ``total_tokens``."""
        tables = self.tables.get(request.request_id) or [[] for _ in self.groups]
        need = self.blocks_needed(total_tokens)
        return sum(max(0, need - len(t)) for t in tables)

    def _prefix_hits(self, request: Request, needs_logits: bool = True) -> list[list[int | None]]:
        """Per group, the cached blocks matching the request's leading full blocks (the same
        number in every group): a device block id, or None where only a lower tier holds it;
        a sliding group's entries before its window are ``NULL_BLOCK``. With ``needs_logits``
        the last token is never served from cache: the model must run on at least one token
        to produce logits (without: a decode engine whose first token comes from a
        producer)."""
        if not self.enable_prefix_caching:
            return [[] for _ in self.groups]
        n = self._matchable(request, needs_logits) // self.block_size
        hashes = self._chain_hashes(request, n)
        found = []
        for k, group in enumerate(self.groups):
            f: list[int | None] = []
            for i in range(n):
                f.append(self._cached(k, hashes[i], request, i))
                if f[-1] is None and group.window is None:
                    break  # a full group's hit ends at its first miss
            found.append(f)
        m = accepted_length(self.groups, found, self.block_size)
        return [[None if b == LOWER else b for b in t]
                for t in group_hits(self.groups, found, m, self.block_size)]

    def _cached(self, group: int, h: int, request: Request, i: int) -> int | None:
        """Group ``group``'s block for block ``i``: a device block, ``LOWER`` (a lower tier
        holds it), or None."""
        tokens = self._block_tokens(request, i)
        block_id = self.hash_to_block.get((group, h))
        if block_id is not None and self.blocks[block_id].token_ids == tokens:
            return block_id
        if self.tiers is not None and self.tiers.has(tier_key(group, h), tokens):
            return LOWER
        return None

    def _block_tokens(self, request: Request, i: int) -> tuple[int, ...]:
        return tuple(request.token_ids_range(i * self.block_size, (i + 1) * self.block_size))

    def _chain_hashes(self, request: Request, n: int) -> list[int]:
        """The chain hashes of (at least) the request's first ``n`` full blocks, memoised on
        the request: admission asks several times, and prefix caching for every block."""
        hashes = request.block_hashes
        if len(hashes) < n:
            bs = self.block_size
            tokens = request.token_ids_range(len(hashes) * bs, n * bs)
            parent = hashes[-1] if hashes else None
            for start in range(0, len(tokens), bs):
                parent = chain_hash(parent, tuple(tokens[start:start + bs]))
                hashes.append(parent)
        return hashes

    def _matchable(self, request: Request, needs_logits: bool) -> int:
        """Tokens a prefix hit may cover: whole blocks, short of the last token if needed."""
        return (request.num_tokens - needs_logits) // self.block_size * self.block_size

    # ---- admission -----------------------------------------------------------------------
    def num_cached_tokens(self, request: Request, needs_logits: bool = True) -> int:
        """Leading tokens allocate() would serve from the prefix cache now (pure)."""
        return len(self._prefix_hits(request, needs_logits)[0]) * self.block_size

    def _table_lengths(self, request: Request, cached: int, max_new_tokens: int | None
                       ) -> list[int]:
        return table_lengths(self.groups, request.num_tokens, cached, max_new_tokens,
                             self.block_size)

    def can_allocate(self, request: Request, use_prefix_cache: bool = True,
                     needs_logits: bool = True, max_new_tokens: int | None = None) -> bool:
        """Whether allocate() finds the blocks; ``max_new_tokens``: what the request's first
        step computes at most (sizes a sliding group's table; None: every token)."""
        hits = self._prefix_hits(request, needs_logits) if use_prefix_cache \
            else [[] for _ in self.groups]
        lost = [h.index(None) for h in hits if None in h]
        if self.tiers is not None and lost and self.tiers.disk is not None:
            # A disk block can still be a miss in allocate() (a corrupt file, no host slot
            # free this step): the match ends there and the device hits after it need fresh
            # blocks too. Admit what fits that worst case (it needs the most free blocks).
            hits = [h[:min(lost) + 1] for h in hits]
        cached = len(hits[0]) * self.block_size
        needed, free_hits = 0, 0
        firsts = first_entries(self.groups, request.num_tokens, cached, needs_logits,
                               self.block_size)
        for k, length in enumerate(self._table_lengths(request, cached, max_new_tokens)):
            first = firsts[k]
            device = [b for b in hits[k][first:] if b is not None]  # a lower-tier hit needs
            free_hits += sum(1 for b in device if self.blocks[b].ref_count == 0)  # a block
            needed += length - first - len(device)
        return needed <= self.num_free_blocks - free_hits

    def allocate(self, request: Request, use_prefix_cache: bool = True,
                 needs_logits: bool = True, max_new_tokens: int | None = None) -> int:
        """Give the request blocks for all its current tokens (a sliding group: those of its
        first ``max_new_tokens``); returns prefix-cached tokens (lower-tier hits included:
        their blocks are loaded at the start of this step). The hit blocks are pinned (ref
        counted) until the request frees them, and the host slots of lower-tier hits until
        the step's ops are taken: no eviction can take them between this match and their
        use. A lower-tier block that cannot be had after all (a disk file found corrupt,
        every host slot in use) ends the match there."""
        rid = request.request_id
        if rid in self.tables:
            raise BlockTableError(f"{rid} already holds blocks "
                                  f"{self.tables[rid][0][:8]}: allocated twice")
        hits = self._prefix_hits(request, needs_logits) if use_prefix_cache \
            else [[] for _ in self.groups]
        hits, slots = self._claim_lower(request, hits)
        cached = len(hits[0]) * self.block_size
        firsts = first_entries(self.groups, request.num_tokens, cached, needs_logits,
                               self.block_size)
        device = [b for k, h in enumerate(hits) for b in h[firsts[k]:] if b is not None]
        if self.enable_prefix_caching and use_prefix_cache:
            self.stats.queried_blocks += self._matchable(request, needs_logits) // self.block_size
            self.stats.hit_blocks += sum(1 for b in hits[0] if b is not None)
        for block_id in device:  # all of them before any eviction below
            self._take(block_id)
        tables = []
        for k, length in enumerate(self._table_lengths(request, cached, max_new_tokens)):
            table = [NULL_BLOCK if i < firsts[k] else b if b is not None else self._pop_free()
                     for i, b in enumerate(hits[k] + [None] * (length - len(hits[k])))]
            tables.append(table)
        for (k, i), slot in slots.items():
            self.tiers.load(slot, tables[k][i])
        self.tables[rid] = tables
        self._released[rid] = firsts
        # Blocks from the first restored one on are registered once the step computed them.
        self.hashed[rid] = min((i for _, i in slots), default=len(hits[0]))
        request.block_ids, request.group_block_ids = tables[0], tables
        return cached

    def _claim_lower(self, request: Request, hits: list[list[int | None]]
                     ) -> tuple[list[list[int | None]], dict[tuple[int, int], int]]:
        """Pin the host slots of the lower-tier hits (None entries), block by block over every
        group; one that cannot be had ends the match there (cut_hits: the longest hit every
        group still serves). Returns the hits and (group, entry) -> host slot to load."""
        slots: dict[tuple[int, int], int] = {}
        if self.tiers is None:
            return hits, slots
        for i in range(len(hits[0])):
            for k, h in enumerate(hits):
                if h[i] is not None:
                    continue
                slot = self.tiers.claim(tier_key(k, request.block_hashes[i]),
                                        self._block_tokens(request, i))
                if slot is None:
                    m, hits = cut_hits(self.groups, hits, i, self.block_size)
                    return hits, {(g, j): s for (g, j), s in slots.items()
                                  if j < m and hits[g][j] is None}
                slots[(k, i)] = slot
        return hits, slots

    # ---- growth --------------------------------------------------------------------------
    def can_append(self, request: Request, num_new_tokens: int) -> bool:
        total = request.num_computed_tokens + num_new_tokens
        return self.new_blocks_needed(request, total) <= self.num_free_blocks

    def append_slots(self, request: Request, num_new_tokens: int) -> None:
        self._release_out_of_window(request)
        need = self.blocks_needed(request.num_computed_tokens + num_new_tokens)
        for table in self.tables[request.request_id]:
            while len(table) < need:
                table.append(self._pop_free())

    def trim(self, request: Request) -> None:
        """Speculation: give back the blocks past the request's computed tokens (lookahead
        slots of rejected drafts; never hashed: only computed tokens' blocks are). They go to
        the front of the pool: nothing cached in them is worth keeping."""
        keep = max(self.blocks_needed(request.num_computed_tokens), self.hashed[request.request_id])
        for table in self.tables[request.request_id]:
            while len(table) > keep:
                self._put(table.pop(), front=True)

    def skip_caching(self, request: Request, num_blocks: int) -> None:
        """Never register the request's first ``num_blocks`` blocks for prefix hits (some
        layer's KV is missing from them: a decode engine got only a sliding window's)."""
        rid = request.request_id
        self.hashed[rid] = max(self.hashed[rid], num_blocks)

    def cache_full_blocks(self, request: Request) -> None:
        """Register hashes of blocks whose KV is now fully computed, for later prefix hits;
        then a sliding group gives back the blocks its next query's window no longer reaches
        (registered first: they stay findable until the pool hands them out again)."""
        if self.enable_prefix_caching:
            self._register(request)
        self._release_out_of_window(request)

    def _register(self, request: Request) -> None:
        rid = request.request_id
        tables = self.tables[rid]
        done = self.hashed[rid]
        full = min([request.num_computed_tokens // self.block_size] + [len(t) for t in tables])
        if full <= done:
            return
        hashes = self._chain_hashes(request, full)
        tokens = request.token_ids_range(done * self.block_size, full * self.block_size)
        for i in range(done, full):
            chunk = tuple(tokens[(i - done) * self.block_size:(i - done + 1) * self.block_size])
            for k, table in enumerate(tables):
                if table[i] == NULL_BLOCK and self._reserved:
                    continue  # before a sliding window (a hit's leading entries)
                block = self.blocks[table[i]]
                # If the same content is already cached in another block, ours stays
                # unhashed; the chain still continues from the content hash.
                if block.block_hash is None and (k, hashes[i]) not in self.hash_to_block:
                    block.block_hash, block.token_ids, block.group = hashes[i], chunk, k
                    self.hash_to_block[(k, hashes[i])] = block.block_id
                    if k == 0:  # prefix routing follows group 0's hashes
                        self._events.record(True, hashes[i])
        self.hashed[rid] = full

    def _release_out_of_window(self, request: Request) -> None:
        """Sliding groups: entries wholly before the next query's window -> NULL_BLOCK."""
        if not self._reserved:
            return
        rid = request.request_id
        released = self._released[rid]
        for k, table in enumerate(self.tables[rid]):
            first = min(self.groups[k].first_live_block(request.num_computed_tokens,
                                                        self.block_size), len(table))
            for i in range(released[k], first):
                if table[i] != NULL_BLOCK:
                    self._put(table[i], front=self.blocks[table[i]].block_hash is None)
                    table[i] = NULL_BLOCK
            released[k] = max(released[k], first)

    # ---- release -------------------------------------------------------------------------
    def free(self, request: Request) -> None:
        tables = self.tables.pop(request.request_id, None)
        self.hashed.pop(request.request_id, None)
        self._released.pop(request.request_id, None)
        request.block_ids, request.group_block_ids = [], []
        if tables is None:
            return
        # Tail blocks are released first so they are evicted before the shared prefix.
        for table in tables:
            for block_id in reversed(table):
                if block_id == NULL_BLOCK and self._reserved:
                    continue
                block = self.blocks[block_id]
                if block.ref_count <= 0:
                    raise BlockTableError(f"block {block_id} of {request.request_id} released "
                                          f"more often than taken (ref count {block.ref_count})")
                self._put(block_id)

    def holds(self, request_id: str) -> bool:
        return request_id in self.tables

    def check_no_leaks(self) -> None:
        """Raise AssertionError unless every block is free and no request holds a table."""
        leaked = [b.block_id for b in self.blocks if b.ref_count != 0]
        if self.tables or leaked or len(self.free_queue) != self.num_usable_blocks:
            raise AssertionError(f"KV blocks leaked: requests holding tables="
                                 f"{sorted(self.tables)[:10]}, blocks with refs={leaked[:20]}, "
                                 f"free={len(self.free_queue)}/{self.num_usable_blocks}")
        if self.tiers is not None:
            self.tiers.check_no_leaks()

    # ---- KV tiers ------------------------------------------------------------------------
    def take_tier_ops(self) -> TierOps | None:
        """The step's tier ops (saves of evicted blocks, loads of lower-tier hits), once per
        step after scheduling; None without tiers or ops."""
        return self.tiers.take_ops() if self.tiers is not None else None

    # ---- cache events (for cache-aware routing) -------------------------------------------
    def events_since(self, cursor: int | None) -> tuple[CacheEvents, int]:
        """Hashes that became findable / stopped being findable after ``cursor`` (what a
        previous call returned; None: nothing seen yet), and the cursor to pass next. A cursor
        older than the kept log (or from another incarnation) gets a reset."""
        return self._events.since(cursor)

    def take_events(self) -> CacheEvents:
        """Changes since the previous take_events() (a single reader's shorthand)."""
        events, self._take_cursor = self.events_since(self._take_cursor)
        return events

    def cached_hashes(self) -> list[int]:
        """Every findable block hash now, group 0's (a full snapshot, e.g. after a reset)."""
        return [h for k, h in self.hash_to_block if k == 0]

    def lower_cached_hashes(self) -> list[int]:
        """Every hash findable in a lower tier (host or disk) now."""
        return self.tiers.lower_cached_hashes() if self.tiers is not None else []

    # ---- internals -----------------------------------------------------------------------
    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_queue[block_id]
        block.ref_count += 1

    def _put(self, block_id: int, front: bool = False) -> None:
        """Drop one reference; a block nobody holds goes back to the pool (its end: the
        least recently released is evicted first; ``front``: nothing in it worth keeping)."""
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_queue[block_id] = None
            if front:
                self.free_queue.move_to_end(block_id, last=False)

    def _pop_free(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict: the block is about to hold other tokens
            key = (block.group, block.block_hash)
            if self.hash_to_block.get(key) == block_id:
                del self.hash_to_block[key]
                if block.group == 0:
                    self._events.record(False, block.block_hash)
                if self.tiers is not None:  # saved at the step's start, before any overwrite
                    self.tiers.on_evict(block_id, tier_key(block.group, block.block_hash),
                                        block.token_ids)
            block.block_hash, block.token_ids = None, None
        block.ref_count = 1
        return block_id
