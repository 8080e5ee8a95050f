"""The scheduler side of the KV tiers: which block hashes the host tier (and the disk tier
below it) holds, in which host slot, in LRU order; and the step's ops (ops.py) that make it so.

Pure metadata, no tensors: the BlockManager calls it when a hashed block leaves the device pool
(``on_evict``: save it unless the host tier has it), when a prefix hit lies in a lower tier
(``claim`` then ``load``), and the scheduler takes the step's ops once per step
(``take_ops``). A host slot touched by an op this step is pinned until the ops are taken: it
is never evicted (reused) in the step that reads or writes it, so the ops' fixed order is
enough. Every hash entering or leaving the lower tiers (host or disk: findable below the
device) is reported through ``on_event`` for cache-aware routing.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pd_cluster.engine.kv_tiers.ops import Spill, TierOps


@dataclass
class TierCounters:
    hit_blocks_host: int = 0
    hit_blocks_disk: int = 0
    saved_blocks_host: int = 0
    evicted_blocks_host: int = 0
    loaded_blocks: int = 0  # host -> device (host hits and disk hits alike)


class TierManager:
    def __init__(self, num_host_slots: int, block_bytes: int, disk: Any = None) -> None:
        """``block_bytes``: one block's bytes over every rank (what a save or load moves);
        ``disk``: a DiskTier written behind the host tier, or None."""
        if num_host_slots < 1:
            raise ValueError("kv_offloading_size: the host tier must hold at least one block")
        self.num_host_slots = num_host_slots
        self.block_bytes = block_bytes
        self.disk = disk
        # on_event(stored, hash): a hash entered (True) or left the lower tiers (the
        # BlockManager logs it beside the device's events).
        self.on_event: Callable[[bool, int], None] = lambda stored, h: None
        self._lru: OrderedDict[int, int] = OrderedDict()  # hash -> slot, oldest first
        self._tokens: list[tuple[int, ...] | None] = [None] * num_host_slots
        self._free = list(range(num_host_slots - 1, -1, -1))  # pop() gives slot 0 first
        self._pinned: set[int] = set()  # slots an op of this step touches
        self._spilling: set[int] = set()  # hashes whose disk write is decided this step
        self._ops = TierOps([], [], [], [])
        self.counters = TierCounters()
        if disk is not None:
            disk.on_drop = self._disk_dropped

    # ---- lookups (pure) ------------------------------------------------------------------
    def has(self, block_hash: int, token_ids: tuple[int, ...]) -> bool:
        """The block is findable in a lower tier (the tokens rule out a hash collision)."""
        slot = self._lru.get(block_hash)
        if slot is not None:
            return self._tokens[slot] == token_ids
        return (self.disk is not None and block_hash not in self._spilling
                and self.disk.has(block_hash, token_ids))

    def lower_cached_hashes(self) -> list[int]:
        disk = self.disk.hashes() if self.disk is not None else []
        return list(self._lru) + [h for h in disk if h not in self._lru]

    # ---- admission -----------------------------------------------------------------------
    def claim(self, block_hash: int, token_ids: tuple[int, ...]) -> int | None:
        """Pin the host slot that holds (or, from disk, will hold this step) the block, for a
        load; None when it cannot be had now (the prefix match ends there)."""
        slot = self._lru.get(block_hash)
        if slot is not None:
            if self._tokens[slot] != token_ids:
                return None
            self._lru.move_to_end(block_hash)
            self._pinned.add(slot)
            self.counters.hit_blocks_host += 1
            return slot
        if self.disk is None or block_hash in self._spilling:
            return None
        slot = self._alloc_slot()
        if slot is None:
            return None
        payload = self.disk.read(block_hash, token_ids)
        if payload is None:  # corrupt, truncated, foreign or gone: a miss (counted by disk)
            self._free.append(slot)
            self._pinned.discard(slot)
            self.on_event(False, block_hash)
            return None
        self._fill(slot, block_hash, token_ids)
        self._ops.fills.append((slot, payload))
        self.counters.hit_blocks_disk += 1
        return slot

    def load(self, slot: int, block_id: int) -> None:
        """The claimed ``slot`` goes into device block ``block_id`` this step."""
        self._ops.loads.append((slot, block_id))
        self.counters.loaded_blocks += 1

    # ---- the device pool evicts ------------------------------------------------------------
    def on_evict(self, block_id: int, block_hash: int, token_ids: tuple[int, ...]) -> None:
        """A hashed device block is being reused: save it unless the host tier has it."""
        slot = self._lru.get(block_hash)
        if slot is not None:
            self._lru.move_to_end(block_hash)
            return
        slot = self._alloc_slot()
        if slot is None:  # every slot is in use by this step's ops: the block is lost
            return
        in_disk = self.disk is not None and self.disk.has(block_hash, token_ids)
        self._fill(slot, block_hash, token_ids)
        self._ops.saves.append((block_id, slot))
        self.counters.saved_blocks_host += 1
        if not in_disk:
            self.on_event(True, block_hash)

    # ---- the step ------------------------------------------------------------------------
    def take_ops(self) -> TierOps | None:
        """This step's ops (None: nothing to do); unpins every slot."""
        ops, self._ops = self._ops, TierOps([], [], [], [])
        self._pinned.clear()
        self._spilling.clear()
        return None if ops.empty else ops

    def check_no_leaks(self) -> None:
        if self._pinned or not self._ops.empty:
            raise AssertionError(f"KV tiers: host slots still pinned {sorted(self._pinned)[:10]}"
                                 f" or ops pending ({self._ops})")
        if len(self._lru) + len(self._free) != self.num_host_slots:
            raise AssertionError(f"KV tiers: {len(self._lru)} used + {len(self._free)} free host "
                                 f"slots != {self.num_host_slots}")

    def stats(self) -> dict[str, Any]:
        c = self.counters
        out = {"kv_offload_host_blocks_total": self.num_host_slots,
               "kv_offload_host_blocks_used": len(self._lru),
               "kv_offload_hit_blocks_host": c.hit_blocks_host,
               "kv_offload_hit_blocks_disk": c.hit_blocks_disk,
               "kv_offload_saved_blocks_host": c.saved_blocks_host,
               "kv_offload_evicted_blocks_host": c.evicted_blocks_host,
               "kv_offload_bytes_saved_host": c.saved_blocks_host * self.block_bytes,
               "kv_offload_bytes_restored_host": c.loaded_blocks * self.block_bytes}
        if self.disk is not None:
            out.update(self.disk.stats())
        return out

    # ---- internals -----------------------------------------------------------------------
    def _disk_dropped(self, block_hash: int) -> None:
        """A block's disk write failed: findable below the device no more, unless on host."""
        if block_hash not in self._lru:
            self.on_event(False, block_hash)

    def _fill(self, slot: int, block_hash: int, token_ids: tuple[int, ...]) -> None:
        self._lru[block_hash] = slot
        self._tokens[slot] = token_ids
        self._pinned.add(slot)

    def _alloc_slot(self) -> int | None:
        """A free slot, else the least recently used one no op of this step touches (its
        block goes to disk first, when there is a disk that lacks it)."""
        if self._free:
            slot = self._free.pop()
            self._pinned.add(slot)
            return slot
        victim = next((h for h, s in self._lru.items() if s not in self._pinned), None)
        if victim is None:
            return None
        slot = self._lru.pop(victim)
        tokens = self._tokens[slot]
        self._tokens[slot] = None
        self._pinned.add(slot)
        self.counters.evicted_blocks_host += 1
        if self.disk is None:
            self.on_event(False, victim)
        elif not self.disk.has(victim, tokens):
            gone = self.disk.admit(victim, tokens)  # the LRU files it displaces (or itself)
            for h in gone:
                if h not in self._lru:
                    self.on_event(False, h)
            if victim not in gone:
                self._spilling.add(victim)
                self._ops.spills.append(Spill(slot, victim, list(tokens)))
        else:
            self.disk.touch(victim)
        return slot
