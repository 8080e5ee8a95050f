"""Paged KV block allocation: per-request block tables over the block pool (block_pool.py:
ref counts, the free pool, the prefix-cache index and its events), prefix hits per KV cache
group.

With KV tiers (engine/kv_tiers/: host memory, disk), an evicted hashed block is saved to the
host tier, and a prefix match continues there block by block: a block the device lacks but a
lower tier holds gets a fresh device block and a load op (run at the start of the step), and
counts as cached. Hashes entering or leaving the lower tiers are logged too (tier "lower").
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pd_cluster.engine.block_pool import BlockPool
from pd_cluster.engine.cache_events import MAX_PENDING_EVENTS, CacheEvents
from pd_cluster.engine.group_hits import (
    cut_hits,
    first_entries,
    table_lengths,
    tier_key,
)
from pd_cluster.engine.kv_groups import NULL_BLOCK, KVCacheGroup, has_sliding
from pd_cluster.engine.kv_tiers.manager import TierManager
from pd_cluster.engine.kv_tiers.ops import TierOps
from pd_cluster.engine.prefix_match import PrefixMatcher
from pd_cluster.request import Request


class BlockTableError(RuntimeError):
    """A block-table invariant broke (a request allocated twice, a block released more often
    than taken): a bug in the caller. Raised, not asserted, so ``python -O`` keeps the check."""


@dataclass
class PrefixCacheStats:
    queried_blocks: int = 0
    hit_blocks: int = 0


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
        self.tiers = tiers if enable_prefix_caching else None
        self.pool = BlockPool(num_blocks, self._reserved, max_pending_events, self.tiers)
        self.blocks, self.free_queue = self.pool.blocks, self.pool.free_queue
        self.hash_to_block = self.pool.hash_to_block
        self.matcher = PrefixMatcher(self.pool, self.groups, block_size, self.tiers)
        self.tables: dict[str, list[list[int]]] = {}  # per request: one table per group
        # Per request: how many leading blocks are registered in the prefix cache (or skipped).
        self.hashed: dict[str, int] = {}
        self._released: dict[str, list[int]] = {}  # per request and group: entries nulled
        # Tables of ended receives a producer may still write into in place: out of use, not
        # free, until the connector says no write can land (fence / lift_fence).
        self.fenced: dict[str, list[list[list[int]]]] = {}
        self.stats = PrefixCacheStats()

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
        if not self.enable_prefix_caching:
            return [[] for _ in self.groups]
        return self.matcher.hits(request, needs_logits)

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
            self.stats.queried_blocks += self.matcher.matchable(request, needs_logits) // self.block_size
            self.stats.hit_blocks += sum(1 for b in hits[0] if b is not None)
        for block_id in device:  # all of them before any eviction below
            self.pool.take(block_id)
        tables = []
        for k, length in enumerate(self._table_lengths(request, cached, max_new_tokens)):
            entries = hits[k] + [None] * (length - len(hits[k]))
            fresh = iter(self.pool.pop_free_run(sum(
                1 for i, b in enumerate(entries) if b is None and i >= firsts[k])))
            tables.append([NULL_BLOCK if i < firsts[k] else b if b is not None else next(fresh)
                           for i, b in enumerate(entries)])
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
                                        self.matcher.block_tokens(request, i))
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
            table += self.pool.pop_free_run(max(0, need - len(table)))

    def trim(self, request: Request) -> None:
        """Speculation: give back the blocks past the request's computed tokens (lookahead
        slots of rejected drafts; never hashed: only computed tokens' blocks are). They go to
        the front of the pool: nothing cached in them is worth keeping."""
        keep = max(self.blocks_needed(request.num_computed_tokens), self.hashed[request.request_id])
        for table in self.tables[request.request_id]:
            while len(table) > keep:
                self.pool.put(table.pop(), front=True)

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
        hashes = self.matcher.chain_hashes(request, full)
        tokens = request.token_ids_range(done * self.block_size, full * self.block_size)
        for i in range(done, full):
            chunk = tuple(tokens[(i - done) * self.block_size:(i - done + 1) * self.block_size])
            for k, table in enumerate(tables):
                if table[i] == NULL_BLOCK and self._reserved:
                    continue  # before a sliding window (a hit's leading entries)
                # The chain continues from the content hash even where another block holds
                # the same content (ours then stays unhashed).
                self.pool.cache(table[i], k, hashes[i], chunk)
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
                    self.pool.put(table[i], front=self.blocks[table[i]].block_hash is None)
                    table[i] = NULL_BLOCK
            released[k] = max(released[k], first)

    # ---- release -------------------------------------------------------------------------
    def free(self, request: Request) -> None:
        tables = self._take(request)
        if tables is not None:
            self._put_back(request.request_id, tables)

    def fence(self, request: Request) -> None:
        """Take the request's blocks out of its hands without freeing them: a producer may
        still write into them (an in-place write that lands late). The request can be given
        new blocks meanwhile; ``lift_fence`` frees these."""
        tables = self._take(request)
        if tables is not None:
            self.fenced.setdefault(request.request_id, []).append(tables)

    def _take(self, request: Request) -> list[list[int]] | None:
        self.hashed.pop(request.request_id, None)
        self._released.pop(request.request_id, None)
        request.block_ids, request.group_block_ids = [], []
        return self.tables.pop(request.request_id, None)

    def lift_fence(self, request_id: str) -> None:
        for tables in self.fenced.pop(request_id, []):
            self._put_back(request_id, tables)

    @property
    def num_fenced_blocks(self) -> int:
        return sum(len(t) for fenced in self.fenced.values() for tables in fenced for t in tables)

    def _put_back(self, request_id: str, tables: list[list[int]]) -> None:
        # Tail blocks are released first so they are evicted before the shared prefix.
        for table in tables:
            for block_id in reversed(table):
                if block_id == NULL_BLOCK and self._reserved:
                    continue
                block = self.blocks[block_id]
                if block.ref_count <= 0:
                    raise BlockTableError(f"block {block_id} of {request_id} released "
                                          f"more often than taken (ref count {block.ref_count})")
                self.pool.put(block_id)

    def holds(self, request_id: str) -> bool:
        return request_id in self.tables

    def check_no_leaks(self) -> None:
        """Raise AssertionError unless every block is free and no request holds a table."""
        leaked = self.pool.leaked()
        if self.tables or self.fenced or leaked or len(self.free_queue) != self.num_usable_blocks:
            raise AssertionError(f"KV blocks leaked: requests holding tables="
                                 f"{sorted(self.tables)[:10]}, fenced={sorted(self.fenced)[:10]}, "
                                 f"blocks with refs={leaked[:20]}, "
                                 f"free={len(self.free_queue)}/{self.num_usable_blocks}")
        if self.tiers is not None:
            self.tiers.check_no_leaks()

    # ---- KV tiers ------------------------------------------------------------------------
    def take_tier_ops(self) -> TierOps | None:
        """The step's tier ops (saves of evicted blocks, loads of lower-tier hits), once per
        step after scheduling; None without tiers or ops."""
        return self.tiers.take_ops() if self.tiers is not None else None

    # ---- cache events (for cache-aware routing: block_pool.py) ----------------------------
    def events_since(self, cursor: int | None) -> tuple[CacheEvents, int]:
        return self.pool.events_since(cursor)

    def take_events(self) -> CacheEvents:
        return self.pool.take_events()

    def cached_hashes(self) -> list[int]:
        return self.pool.cached_hashes()

    def lower_cached_hashes(self) -> list[int]:
        """Every hash findable in a lower tier (host or disk) now."""
        return self.tiers.lower_cached_hashes() if self.tiers is not None else []
