"""The proxy's index of engines' cached block hashes (prefix match, bounded, reset) and the
routing policies that read it (cache_aware against least_loaded), alone: no pool, no Ray."""
from __future__ import annotations

import pytest

from pd_cluster.engine.block_hash import hash_blocks
from pd_cluster.serving.routing.cache_index import CacheIndex
from pd_cluster.serving.routing.router import create_router

BS = 4


def test_index_prefix_stops_at_the_first_missing_block() -> None:
    idx = CacheIndex()
    h = hash_blocks(list(range(40)), BS)
    idx.apply("d0", stored=h[:6])
    assert idx.prefix_blocks("d0", h) == 6
    idx.apply("d0", removed=[h[2]])  # a middle block evicted: the prefix ends before it
    assert idx.prefix_blocks("d0", h) == 2
    assert idx.prefix_blocks("d1", h) == 0  # an engine never reported


def test_index_is_bounded_per_engine_and_evicts_the_oldest() -> None:
    idx = CacheIndex(max_blocks_per_engine=8)
    old, new = hash_blocks(list(range(32)), BS), hash_blocks(list(range(100, 132)), BS)
    idx.record("d0", old)
    idx.record("d0", new)
    assert idx.size("d0") == 8
    assert idx.prefix_blocks("d0", new) == 8 and idx.prefix_blocks("d0", old) == 0


def test_index_reset_and_forget_clear_an_engine() -> None:
    idx = CacheIndex()
    a, b = hash_blocks(list(range(16)), BS), hash_blocks(list(range(50, 66)), BS)
    idx.apply("d0", stored=a)
    idx.apply("d0", stored=b, reset=True)  # a reset report: only what it lists
    assert idx.prefix_blocks("d0", a) == 0 and idx.prefix_blocks("d0", b) == 4
    idx.forget("d0")
    assert idx.size("d0") == 0
    with pytest.raises(ValueError, match="max_blocks_per_engine"):
        CacheIndex(0)


class _E:
    def __init__(self, name: str, work: int = 0, queued: int = 0, inflight: int = 0):
        self.name, self.outstanding_work, self.inflight = name, work, inflight
        self.queued_prefill = queued


def test_cache_aware_router_weighs_cached_tokens_against_load() -> None:
    r = create_router("cache_aware")
    a, b = _E("a", work=100, queued=100), _E("b", work=0)
    assert r.pick([a, b], {"a": 160}).name == "a"  # 160 cached tokens outweigh 100 queued
    assert r.pick([a, b], {"a": 64}).name == "b"  # a short hit does not
    assert r.pick([a, b], None).name == "b"  # nothing known: least loaded
    seen = {r.pick([_E("x"), _E("y")], {}).name for _ in range(4)}
    assert seen == {"x", "y"}  # equally idle: both used


def test_cache_aware_router_does_not_count_queued_decode_tokens_against_a_history() -> None:
    r = create_router("cache_aware")
    # a decode engine running 4 conversations (4 x 128 tokens still to decode, no prefill
    # queued) holds this one's 370-token history; the idle one holds nothing
    busy, idle = _E("busy", work=512, inflight=4), _E("idle")
    assert r.pick([busy, idle], {"busy": 368}).name == "busy"
    assert r.pick([busy, idle], None).name == "idle"  # no history anywhere: least loaded


def test_cache_aware_router_falls_back_to_load_when_imbalanced() -> None:
    r = create_router("cache_aware")
    hot, cold = _E("hot", work=900, inflight=12), _E("cold", work=80, inflight=2)
    # one hot prefix would take everything: past the imbalance bound, least loaded wins
    assert r.pick([hot, cold], {"hot": 4000}).name == "cold"
    hot.inflight = 6  # within the bound (6 - 2 <= 8): the cache wins again
    assert r.pick([hot, cold], {"hot": 4000}).name == "hot"
