"""The KV tiers without a model: the TierManager alone (LRU, pinning, op order, events), and a
BlockManager + HostTierStore over fake device caches whose blocks hold a value derived from
their hash, so every restore can be checked byte for byte, races included: a block saved in
the step it is evicted and reused, a block restored while its hash is saved again, a host slot
wanted for a save while pinned for a restore in the same step."""
from __future__ import annotations

import itertools

import pytest
import torch

from pd_cluster.engine.block_manager import BlockManager
from pd_cluster.engine.kv_tiers.host_store import HostTierStore
from pd_cluster.engine.kv_tiers.manager import TierManager
from pd_cluster.request import Request
from pd_cluster.sampling_params import SamplingParams

BS = 4
_ids = itertools.count()


def tok(h: int) -> tuple[int, ...]:
    return (h,) * BS


def manager(slots: int) -> tuple[TierManager, list[tuple[bool, int]]]:
    events: list[tuple[bool, int]] = []
    m = TierManager(slots, block_bytes=100)
    m.on_event = lambda stored, h: events.append((stored, h))
    return m, events


# ---------------------------------------------------------------------------- manager alone

def test_saves_fill_free_slots_then_evict_the_least_recently_used() -> None:
    m, events = manager(2)
    m.on_evict(5, 1001, tok(1))
    m.on_evict(6, 1002, tok(2))
    ops = m.take_ops()
    assert ops.saves == [(5, 0), (6, 1)] and not ops.loads
    assert events == [(True, 1001), (True, 1002)]
    m.on_evict(7, 1001, tok(1))  # already held: only touched (1002 is now the oldest)
    assert m.take_ops() is None
    m.on_evict(8, 1003, tok(3))
    assert m.take_ops().saves == [(8, 1)]  # 1002's slot
    assert events[2:] == [(False, 1002), (True, 1003)]
    assert sorted(m.lower_cached_hashes()) == [1001, 1003]
    assert m.stats()["kv_offload_evicted_blocks_host"] == 1
    assert m.stats()["kv_offload_bytes_saved_host"] == 300
    m.check_no_leaks()


def test_a_slot_claimed_for_a_load_is_never_given_to_a_save_in_the_same_step() -> None:
    m, events = manager(2)
    m.on_evict(0, 1001, tok(1)), m.on_evict(1, 1002, tok(2))
    m.take_ops()
    assert m.has(1001, tok(1)) and not m.has(1001, tok(9))  # the tokens rule out collisions
    slot = m.claim(1001, tok(1))
    m.load(slot, 9)
    m.on_evict(3, 1003, tok(3))  # takes 1002's slot, not the claimed one
    m.on_evict(4, 1004, tok(4))  # every slot is in use by this step: not saved
    with pytest.raises(AssertionError, match="pinned"):
        m.check_no_leaks()
    ops = m.take_ops()
    assert ops.saves == [(3, 1)] and ops.loads == [(0, 9)]
    assert not m.has(1004, tok(4)) and (True, 1004) not in events
    m.check_no_leaks()
    # Next step the slot may go: the claim touched 1001 before 1003 came, so it is the oldest.
    m.on_evict(5, 1005, tok(5))
    assert m.take_ops().saves == [(5, 0)]


def test_restored_while_its_hash_is_saved_again() -> None:
    """A device copy of a hash being restored this step is evicted: no second slot, no op."""
    m, _ = manager(2)
    m.on_evict(0, 1001, tok(1))
    m.take_ops()
    slot = m.claim(1001, tok(1))
    m.load(slot, 5)
    m.on_evict(2, 1001, tok(1))
    ops = m.take_ops()
    assert ops.saves == [] and ops.loads == [(slot, 5)]
    assert m.stats()["kv_offload_host_blocks_used"] == 1


# ------------------------------------------------------- block manager + host store, with data

class FakeEngine:
    """A BlockManager, a host store over a fake one-layer cache, and a fake forward that
    writes each computed block's value (its hash) into the device cache."""

    def __init__(self, num_blocks: int, host_slots: int) -> None:
        self.cache = [torch.full((2, num_blocks, BS, 1, 1), -1.0, dtype=torch.float64)]
        self.store = HostTierStore(self.cache, host_slots)
        self.tiers = TierManager(host_slots, self.store.block_bytes)
        self.bm = BlockManager(num_blocks, BS, tiers=self.tiers)

    def value(self, block_id: int) -> float:
        return float(self.cache[0][0, block_id, 0, 0, 0])

    def step(self, admit: list[Request] = (), release: list[Request] = ()) -> list[int]:
        """Free ``release``, admit ``admit`` (all their tokens computed this step); returns
        each admitted request's cached tokens. Checks every full block's bytes after."""
        for r in release:
            self.bm.free(r)
        cached = []
        for r in admit:
            assert self.bm.can_allocate(r)
            cached.append(self.bm.allocate(r))
            r.num_computed_tokens = cached[-1]
        self.store.execute(self.bm.take_tier_ops())  # the start of the step
        for r in admit:  # the forward: only the blocks not served from a cache
            for i in range(r.num_computed_tokens // BS, r.num_tokens // BS):
                self.cache[0][:, r.block_ids[i]] = float(r.block_hashes[i] % 2**50)
            r.num_computed_tokens = r.num_tokens
            self.bm.cache_full_blocks(r)
        for r in admit:
            assert [self.value(b) for b in r.block_ids[:r.num_tokens // BS]] == \
                [float(h % 2**50) for h in r.block_hashes[:r.num_tokens // BS]]
        return cached


def request(first: int, blocks: int) -> Request:
    """``blocks`` full blocks + one token (so every full block may be a hit)."""
    tokens = [first + i for i in range(blocks * BS + 1)]
    return Request(f"r{next(_ids)}", tokens, SamplingParams(max_tokens=4))


def test_a_block_saved_in_the_step_that_evicts_and_reuses_it() -> None:
    e = FakeEngine(num_blocks=4, host_slots=8)
    a = request(100, 3)
    assert e.step([a]) == [0]
    b = request(500, 3)  # takes 4 blocks: 3 of a's cached ones are evicted and overwritten
    assert e.step([b], release=[a]) == [0]
    assert e.tiers.counters.saved_blocks_host == 3
    a2 = request(100, 3)  # a's blocks come back from the host tier, bytes intact
    assert e.step([a2], release=[b]) == [3 * BS]
    assert e.tiers.counters.hit_blocks_host == 3
    # a block evicted this step (b's) can be restored in the same step by the next request
    b2 = request(500, 3)
    assert e.step([b2], release=[a2]) == [3 * BS]
    e.bm.free(b2)
    e.bm.check_no_leaks()


def test_same_step_save_then_restore_of_one_hash() -> None:
    """Request x's allocation evicts a block (saved to host this step) that request y, later
    in the same step, finds in the host tier: the save runs before the load."""
    e = FakeEngine(num_blocks=4, host_slots=8)
    a = request(100, 1)  # 2 blocks (1 full, hashed)
    e.step([a])
    e.step([], release=[a])
    x = request(900, 2)  # 3 blocks: evicts a's hashed block (and the free ones)
    y = request(100, 1)  # a's prefix: only in the host tier now, saved in this very step
    e.bm.allocate(x)
    assert e.bm.num_free_blocks == 1 and not e.bm.can_allocate(y)
    e.bm.free(x)  # (y must fit: give x's blocks back before y is admitted)
    assert e.step([y]) == [BS]
    e.bm.free(y)
    e.bm.check_no_leaks()


def test_host_slot_pinned_for_a_restore_is_not_taken_by_a_save() -> None:
    """One host slot: it holds a's block, claimed for a restore; the same allocation evicts
    a device block that wants a slot: the save is skipped, the restore is exact."""
    e = FakeEngine(num_blocks=4, host_slots=1)
    a = request(100, 1)
    e.step([a])
    b = request(500, 3)  # 4 blocks: evicts a's one hashed block (a was freed)
    e.step([b], release=[a])
    assert e.tiers.counters.saved_blocks_host == 1
    a2 = request(100, 1)  # its fresh block evicts one of b's hashed blocks: no slot to spare
    assert e.step([a2], release=[b]) == [BS]
    assert e.tiers.counters.saved_blocks_host == 1 and e.tiers.counters.hit_blocks_host == 1
    e.bm.free(a2)
    e.bm.check_no_leaks()


def test_lower_events_and_snapshot() -> None:
    """Two host slots: a step saves at most two blocks (a slot written this step is not
    reused in it); the next step's saves displace them (removed from the lower tiers)."""
    e = FakeEngine(num_blocks=4, host_slots=2)
    a = request(100, 3)
    e.step([a])
    _, cursor = e.bm.events_since(None)
    b = request(500, 3)
    e.step([b], release=[a])
    ev, cursor = e.bm.events_since(cursor)
    assert len(ev.removed) == 3 and len(ev.stored_lower) == 2 and not ev.removed_lower
    e.step([request(900, 3)], release=[b])
    ev, cursor = e.bm.events_since(cursor)
    assert sorted(e.bm.lower_cached_hashes()) == sorted(ev.stored_lower)
    assert len(ev.removed_lower) == 2 and set(ev.removed_lower) <= set(a.block_hashes)
