"""The KV blocks of one engine: their reference counts, the free pool and the prefix-cache
index (block_manager.py hands them to requests).

A full block is identified by the hash of its tokens chained with its parent's hash
(block_hash.py: the same in every process), so equal prefixes map to the same blocks. Freed
blocks keep their hash and stay findable until the pool hands them out again; the pool is
ordered by release time, so the least recently used cached block is evicted first. Hashes that
become findable or stop being findable are recorded as numbered events (events_since: each
reader, e.g. one proxy each, with its own cursor; a bounded log) for the proxy's
cache-aware routing. With KV tiers, an evicted hashed block is handed to the tiers to save.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from pd_cluster.engine.cache_events import CacheEventLog, CacheEvents
from pd_cluster.engine.group_hits import tier_key
from pd_cluster.engine.kv_tiers.manager import TierManager


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] | None = None  # kept to rule out hash collisions on a hit
    group: int = 0  # the KV cache group whose hash it holds


class BlockPool:
    """``reserved`` leading blocks are never handed out (the null block of sliding groups)."""

    def __init__(self, num_blocks: int, reserved: int, max_pending_events: int,
                 tiers: TierManager | None) -> None:
        self.num_usable = num_blocks - reserved
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict(
            (i, None) for i in range(reserved, num_blocks))
        # (group, chain hash) -> block; one group: group 0 only
        self.hash_to_block: dict[tuple[int, int], int] = {}
        # Each reader keeps its own cursor (one proxy's read hides nothing from another).
        self._events = CacheEventLog(max_pending_events)
        self._take_cursor = 0  # take_events()' own reader
        self.tiers = tiers
        if tiers is not None:  # each group's pages are their own entries (tier_key)
            tiers.on_event = lambda stored, h: self._events.record(stored, h, lower=True)

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    def lookup(self, group: int, h: int, tokens: tuple[int, ...]) -> int | None:
        """The device block holding group ``group``'s block of hash ``h`` and ``tokens``."""
        block_id = self.hash_to_block.get((group, h))
        if block_id is not None and self.blocks[block_id].token_ids == tokens:
            return block_id
        return None

    def cache(self, block_id: int, group: int, h: int, tokens: tuple[int, ...]) -> None:
        """Make ``block_id`` findable as group ``group``'s block of hash ``h``, unless the
        same content is cached already (in another block: ours then stays unhashed)."""
        block = self.blocks[block_id]
        if block.block_hash is None and (group, h) not in self.hash_to_block:
            block.block_hash, block.token_ids, block.group = h, tokens, group
            self.hash_to_block[(group, h)] = block_id
            if group == 0:  # prefix routing follows group 0's hashes
                self._events.record(True, h)

    def take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_queue[block_id]
        block.ref_count += 1

    def put(self, block_id: int, front: bool = False) -> None:
        """Drop one reference; a block nobody holds goes back to the pool (its end: the
        least recently released is evicted first; ``front``: nothing in it worth keeping)."""
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_queue[block_id] = None
            if front:
                self.free_queue.move_to_end(block_id, last=False)

    def pop_free(self) -> int:
        """A free block, taken once (evicting the cached content it held, if any)."""
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

    def pop_free_run(self, n: int) -> list[int]:
        """``n`` free blocks, the same ones as ``n`` pop_free calls (eviction order unchanged),
        in ascending id order: blocks released together (a finished request's, released tail
        first) come back as ascending runs, so a request's table holds long runs of
        consecutive blocks, which a KV transfer moves as one piece (one NIXL descriptor, one
        sequential copy) instead of block by block in descending order."""
        return sorted(self.pop_free() for _ in range(n))

    def leaked(self) -> list[int]:
        """Blocks still referenced."""
        return [b.block_id for b in self.blocks if b.ref_count != 0]

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
