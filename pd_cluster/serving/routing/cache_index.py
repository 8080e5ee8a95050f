"""The proxy's view of which prompt blocks each engine holds, per tier: its device prefix cache,
and below it its lower KV tiers (host memory, disk: engine/kv_tiers/).

Engines report block hashes (pd_cluster.engine.block_hash: chained, equal in every process) as
events: blocks stored, blocks removed, for the device and for the lower tiers, or a reset (the
cache was cleared, or the report lost events: the engine then sends everything it holds). A
hash may be on the device and in a lower tier at once. The proxy also records what it just
routed (the prompt's blocks will be on the engines it chose) so the next turn of a
conversation finds them before the next report. Each engine's entry per tier is a bounded LRU
set: the oldest hashes go first, as in the engine's own eviction order. Everything here is a
hint: a stale entry costs a prefix-cache miss on the engine, never a wrong answer (the engine
matches tokens itself).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable


@dataclass(frozen=True)
class PrefixHit:
    """Leading blocks of a prompt an engine holds: ``device`` on the device, ``lower`` only in
    a lower tier (restored by a copy instead of recomputed). Engines match block by block,
    device first, so the two may interleave; the prefix ends at the first block in neither."""
    device: int = 0
    lower: int = 0

    @property
    def blocks(self) -> int:
        return self.device + self.lower

    def weighted_blocks(self, lower_weight: float) -> float:
        """Blocks' worth of prefill saved: a lower-tier block is worth ``lower_weight`` of a
        device block (proxy.lower_tier_hit_weight: its copy costs the rest)."""
        return self.device + lower_weight * self.lower


class CacheIndex:
    def __init__(self, max_blocks_per_engine: int = 65536):
        if max_blocks_per_engine < 1:
            raise ValueError(f"max_blocks_per_engine: must be >= 1, got {max_blocks_per_engine}")
        self.max_blocks = max_blocks_per_engine
        self._held: dict[str, OrderedDict[int, None]] = {}  # the device prefix cache
        self._lower: dict[str, OrderedDict[int, None]] = {}  # the lower tiers (host, disk)
        self.block_size: int | None = None  # from the engines' reports

    def apply(self, engine: str, stored: Iterable[int] = (), removed: Iterable[int] = (),
              reset: bool = False, stored_lower: Iterable[int] = (),
              removed_lower: Iterable[int] = ()) -> None:
        """One report from ``engine``: a reset clears both its tiers before what is stored is
        added."""
        if reset:
            self.forget(engine)
        for tier, gone, new in ((self._held, removed, stored),
                                (self._lower, removed_lower, stored_lower)):
            held = tier.setdefault(engine, OrderedDict())
            for h in gone:
                held.pop(h, None)
            self._add(held, new)

    def record(self, engine: str, hashes: Iterable[int]) -> None:
        """``engine`` was just given these blocks (a routed prompt, restored or computed on its
        device): most recently used."""
        self._add(self._held.setdefault(engine, OrderedDict()), hashes)

    def forget(self, engine: str) -> None:
        """``engine`` restarted or is gone: it holds nothing we know of."""
        self._held.pop(engine, None)
        self._lower.pop(engine, None)

    def size(self, engine: str) -> int:
        return len(self._held.get(engine, ()))

    def lower_size(self, engine: str) -> int:
        return len(self._lower.get(engine, ()))

    def prefix(self, engine: str, hashes: list[int]) -> PrefixHit:
        """How many leading blocks of ``hashes`` ``engine`` holds, per tier (a chained hash
        names its whole prefix, so the first block in no tier ends the match)."""
        held = self._held.get(engine) or {}
        lower = self._lower.get(engine) or {}
        device = below = 0
        for h in hashes:
            if h in held:
                device += 1
            elif h in lower:
                below += 1
            else:
                break
        return PrefixHit(device, below)

    def prefix_blocks(self, engine: str, hashes: list[int]) -> int:
        """Leading blocks of ``hashes`` ``engine`` holds in any tier."""
        return self.prefix(engine, hashes).blocks

    def _add(self, held: OrderedDict[int, None], hashes: Iterable[int]) -> None:
        for h in hashes:
            held[h] = None
            held.move_to_end(h)
        while len(held) > self.max_blocks:
            held.popitem(last=False)
