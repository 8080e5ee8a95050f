"""The proxy's view of which prompt blocks each engine holds in its prefix cache.

Engines report block hashes (pd_cluster.engine.block_hash: chained, equal in every process) as
events: blocks stored, blocks removed, or a reset (the cache was cleared, or the report lost
events: the engine then sends everything it holds). The proxy also records what it just routed
(the prompt's blocks will be on the engines it chose) so the next turn of a conversation finds
them before the next report. Each engine's entry is a bounded LRU set: the oldest hashes go
first, as in the engine's own eviction order. Everything here is a hint: a stale entry costs a
prefix-cache miss on the engine, never a wrong answer (the engine matches tokens itself).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterable


class CacheIndex:
    def __init__(self, max_blocks_per_engine: int = 65536):
        if max_blocks_per_engine < 1:
            raise ValueError(f"max_blocks_per_engine: must be >= 1, got {max_blocks_per_engine}")
        self.max_blocks = max_blocks_per_engine
        self._held: dict[str, OrderedDict[int, None]] = {}
        self.block_size: int | None = None  # from the engines' reports

    def apply(self, engine: str, stored: Iterable[int] = (), removed: Iterable[int] = (),
              reset: bool = False) -> None:
        """One report from ``engine``: a reset clears its entry before ``stored`` is added."""
        if reset:
            self._held.pop(engine, None)
        held = self._held.setdefault(engine, OrderedDict())
        for h in removed:
            held.pop(h, None)
        self._add(held, stored)

    def record(self, engine: str, hashes: Iterable[int]) -> None:
        """``engine`` was just given these blocks (a routed prompt): most recently used."""
        self._add(self._held.setdefault(engine, OrderedDict()), hashes)

    def forget(self, engine: str) -> None:
        """``engine`` restarted or is gone: it holds nothing we know of."""
        self._held.pop(engine, None)

    def size(self, engine: str) -> int:
        return len(self._held.get(engine, ()))

    def prefix_blocks(self, engine: str, hashes: list[int]) -> int:
        """How many leading blocks of ``hashes`` ``engine`` holds (a chained hash names its
        whole prefix, so the first miss ends the match)."""
        held = self._held.get(engine)
        if not held:
            return 0
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n

    def _add(self, held: OrderedDict[int, None], hashes: Iterable[int]) -> None:
        for h in hashes:
            held[h] = None
            held.move_to_end(h)
        while len(held) > self.max_blocks:
            held.popitem(last=False)
