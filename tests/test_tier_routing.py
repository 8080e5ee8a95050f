"""Tier-aware cache routing (issue 32): the proxy's index holds each engine's device and lower-tier
(host, disk) block hashes from its reports; a lower-tier hit weighs proxy.lower_tier_hit_weight
of a device hit in the router's score and in the P-or-D estimate, and the KV D holds in any
tier is not shipped. Fake reports and a fake pool: no Ray, no model."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from pd_cluster.engine.block_hash import hash_blocks
from pd_cluster.sampling_params import SamplingParams
from pd_cluster.serving.cluster.cluster_config import ProxyConfig
from pd_cluster.serving.routing.cache_feed import CacheFeed
from pd_cluster.serving.routing.cache_index import CacheIndex, PrefixHit
from pd_cluster.serving.routing.engine_load import LinkStats
from pd_cluster.serving.routing.engine_pool import EnginePool
from pd_cluster.serving.routing.legs import LegKind
from pd_cluster.serving.routing.planner import Planner
from tests.routing_helpers import fake_pool, greedy_job

BS = 4


# ---- the index ---------------------------------------------------------------------------------
def test_index_matches_device_then_lower_block_by_block() -> None:
    idx = CacheIndex()
    h = hash_blocks(list(range(40)), BS)  # 10 blocks
    idx.apply("d0", stored=h[:3], stored_lower=h[2:7])  # block 2 in both: a device hit
    assert idx.prefix("d0", h) == PrefixHit(device=3, lower=4)
    assert idx.prefix_blocks("d0", h) == 7
    idx.apply("d0", removed=h[1:2])  # evicted from the device, but not saved below: a gap
    assert idx.prefix("d0", h) == PrefixHit(device=1, lower=0)
    idx.apply("d0", stored_lower=h[1:2])  # now it is (the tier saves what the device evicts)
    assert idx.prefix("d0", h) == PrefixHit(device=2, lower=5)  # interleaved: D L D L L L L
    idx.apply("d0", removed_lower=h[5:6])  # evicted from the host tier: the prefix ends there
    assert idx.prefix("d0", h) == PrefixHit(device=2, lower=3)
    assert idx.prefix("d1", h) == PrefixHit()  # never reported
    assert PrefixHit(2, 3).weighted_blocks(0.5) == 3.5


def test_index_reset_and_forget_clear_both_tiers_and_each_tier_is_bounded() -> None:
    idx = CacheIndex(max_blocks_per_engine=4)
    a, b = hash_blocks(list(range(32)), BS), hash_blocks(list(range(100, 132)), BS)
    idx.apply("d0", stored=a[:2], stored_lower=a)
    assert idx.size("d0") == 2 and idx.lower_size("d0") == 4  # the oldest 4 of 8 gone
    idx.apply("d0", stored=b[:1], stored_lower=b[1:3], reset=True)  # a full report
    assert idx.prefix("d0", a) == PrefixHit() and idx.prefix("d0", b) == PrefixHit(1, 2)
    idx.forget("d0")
    assert idx.size("d0") == 0 and idx.lower_size("d0") == 0


# ---- the router, through the pool ------------------------------------------------------------
def _legs(planner: Planner, prompt: list[int]) -> dict[LegKind, str]:
    return {lg.kind: lg.engine.name for lg in planner.plan(greedy_job(prompt), set(), "r")}


@pytest.mark.parametrize("weight, expected", [(0.8, "decode-0"), (0.4, "decode-1")])
def test_a_longer_prefix_in_a_host_tier_against_a_shorter_one_on_a_device(
        weight: float, expected: str) -> None:
    """decode-0 holds the 16-block history in its host tier, decode-1 its first 8 blocks on the
    device: 16 x 0.8 = 12.8 blocks' worth beats 8; at 0.4 (6.4) the device prefix wins."""
    pool, planner = fake_pool(BS, lower_tier_hit_weight=weight, disaggregation="always")
    prompt = list(range(64))
    h = hash_blocks(prompt, BS)
    pool.cache.apply("decode-0", stored_lower=h)
    pool.cache.apply("decode-1", stored=h[:8])
    assert pool.cached_tokens(h, pool.engines)["decode-0"] == round(16 * weight * BS)
    for _ in range(3):  # every time, not by rotation
        assert _legs(planner, prompt + [7])[LegKind.DECODE] == expected


def test_equal_prefixes_a_device_hit_beats_a_host_hit_and_a_host_hit_beats_a_miss() -> None:
    pool, planner = fake_pool(BS, disaggregation="always")
    prompt = list(range(64))
    h = hash_blocks(prompt, BS)
    pool.cache.apply("prefill-0", stored_lower=h)
    pool.cache.apply("prefill-1", stored=h)
    assert _legs(planner, prompt + [7])[LegKind.PREFILL] == "prefill-1"
    pool.cache.apply("prefill-1", removed=h)  # now only the host tier holds it anywhere
    assert _legs(planner, prompt + [7])[LegKind.PREFILL] == "prefill-0"
    # routed there, the prompt is restored onto prefill-0's device: its next turn finds it there
    assert pool.cache.prefix("prefill-0", h) == PrefixHit(16, 0)
    metrics = planner.metrics.render().decode()
    assert 'pd_route_lower_tier_prompt_tokens_total{role="prefill"} 64.0' in metrics
    assert 'pd_route_cached_prompt_tokens_total{role="prefill"} 128.0' in metrics


def test_weight_zero_treats_a_lower_tier_hit_as_a_miss() -> None:
    pool, _ = fake_pool(BS, lower_tier_hit_weight=0.0)
    h = hash_blocks(list(range(64)), BS)
    pool.cache.apply("decode-0", stored_lower=h)
    assert pool.cached_tokens(h, pool.engines)["decode-0"] == 0
    assert pool.held(h, pool.engines)["decode-0"] == PrefixHit(0, 16)


# ---- the P-or-D estimate -----------------------------------------------------------------------
def test_a_history_in_ds_host_tier_is_restored_there_not_prefilled_on_p() -> None:
    """D restoring a 400-token history from its host tier (80 tokens' worth of prefill at
    0.8) is sooner than P computing all 401 by more than the 20 ms margin (at the default
    4000 tokens/s): D alone. Counted as a miss (weight 0), D is no sooner: through P."""
    prompt = list(range(400))
    h = hash_blocks(prompt, BS)
    for weight, kinds in ((0.8, {LegKind.WHOLE}), (0.0, {LegKind.DECODE, LegKind.PREFILL})):
        pool, planner = fake_pool(BS, lower_tier_hit_weight=weight, local_prefill_margin_ms=20.0)
        pool.cache.apply("decode-0", stored_lower=h)
        legs = planner.plan(greedy_job(prompt + [7]), set(), "r")
        assert {lg.kind for lg in legs} == kinds, weight
        assert any(lg.engine.name == "decode-0" for lg in legs)


def test_p_does_not_wait_for_or_ship_what_d_holds_in_a_lower_tier() -> None:
    """P streams at once only the blocks past what D is expected to hold in any tier (D restores
    the rest from its own tiers); P's prefill estimate counts its own host hits weighed."""
    pool, planner = fake_pool(BS, disaggregation="always")
    prompt = list(range(64))
    h = hash_blocks(prompt, BS)
    pool.cache.apply("decode-0", stored=h[:4], stored_lower=h[4:10])
    pool.cache.apply("decode-1", removed=[])
    pool.cache.apply("prefill-0", stored_lower=h)
    legs = {lg.kind: lg for lg in planner.plan(greedy_job(prompt + [7]), set(), "r")}
    assert legs[LegKind.DECODE].engine.name == "decode-0"
    p_leg = legs[LegKind.PREFILL]
    assert p_leg.engine.name == "prefill-0"
    assert p_leg.request.kv_transfer_params.expect_held == 40  # 10 blocks, in either tier
    # P computes what it lacks: 65 tokens less 16 blocks at 0.8 (51.2 tokens' worth)
    assert p_leg.engine.load.backlog() == 65 - round(16 * 0.8 * BS)


# ---- the feed -------------------------------------------------------------------------------
class _Reporting:
    """An engine handle answering cache_events like EngineActor, with lower-tier events."""

    def __init__(self) -> None:
        self.incarnation, self.fail = "i0", False
        self.device: list[int] = []
        self.lower: list[int] = []
        self.pending: dict[str, list[int]] = {}
        self.calls: list[bool] = []
        self.cache_events = SimpleNamespace(remote=self._events)

    async def _events(self, full: bool, cursor: int | None = None) -> dict[str, Any]:
        self.calls.append(full)
        if self.fail:
            raise RuntimeError("actor busy")
        if full:
            body = {"stored": list(self.device), "removed": [], "stored_lower": list(self.lower),
                    "removed_lower": []}
        else:
            body = {k: self.pending.get(k, []) for k in
                    ("stored", "removed", "stored_lower", "removed_lower")}
        self.pending = {}
        return {**body, "reset": full, "cursor": 0, "incarnation": self.incarnation,
                "block_size": BS, "kv_bytes_per_token": 64.0}


def test_feed_carries_lower_tier_events_and_resyncs_both_tiers() -> None:
    h = _Reporting()
    pool = EnginePool([("decode-0", "decode", h)], ProxyConfig())
    e = pool.engines[0]
    e.healthy, e.incarnation = True, "i0"
    feed = CacheFeed(pool.cache, LinkStats(), 0.01, 1.0)
    a = hash_blocks(list(range(48)), BS)  # 12 blocks

    async def go() -> None:
        h.device, h.lower = a[:4], a[4:8]
        await feed.poll(pool.engines)  # first contact: the full report of both tiers
        assert h.calls == [True] and pool.cache.prefix("decode-0", a) == PrefixHit(4, 4)
        # the device evicts blocks 2-3, the host tier saves them and drops 7; 8-11 saved too
        h.pending = {"removed": a[2:4], "stored_lower": a[2:4] + a[8:12],
                     "removed_lower": a[7:8]}
        await feed.poll(pool.engines)
        assert h.calls[-1] is False and pool.cache.prefix("decode-0", a) == PrefixHit(2, 5)
        h.fail = True  # a lost report: the engine is forgotten in both tiers
        await feed.poll(pool.engines)
        assert pool.cache.size("decode-0") == 0 and pool.cache.lower_size("decode-0") == 0
        h.fail, h.device, h.lower = False, a[:2], a[2:7] + a[8:12]
        await feed.poll(pool.engines)  # then resynchronised with a full report
        assert h.calls[-1] is True and pool.cache.prefix("decode-0", a) == PrefixHit(2, 5)
        assert pool.cache.lower_size("decode-0") == 9
    asyncio.run(go())


def test_a_report_without_lower_tier_fields_is_a_device_only_engine() -> None:
    idx = CacheIndex()
    feed = CacheFeed(idx, LinkStats(), 0.01, 1.0)
    a = hash_blocks(list(range(16)), BS)

    async def events(full: bool, cursor: int | None = None) -> dict[str, Any]:
        return {"reset": True, "stored": a, "removed": [], "cursor": 3, "incarnation": "i0",
                "block_size": BS, "kv_bytes_per_token": 8.0}
    e = SimpleNamespace(name="c0", healthy=True, incarnation="i0",
                        handle=SimpleNamespace(cache_events=SimpleNamespace(remote=events)))
    asyncio.run(feed.poll([e]))
    assert idx.prefix("c0", a) == PrefixHit(4, 0) and idx.lower_size("c0") == 0


# ---- the engine's side of the report -----------------------------------------------------------
def test_engine_report_carries_lower_tier_events_and_a_snapshot_after_a_reset() -> None:
    """EngineActor.cache_events' body from a real BlockManager with a host tier: blocks the
    device evicts are removed from it and stored below; a reader without a cursor (or behind)
    gets both snapshots; the report is plain msgpack (as every message here)."""
    import msgpack

    from pd_cluster.engine.block_manager import BlockManager
    from pd_cluster.engine.kv_tiers.manager import TierManager
    from pd_cluster.request import Request
    from pd_cluster.serving.engine.engine_actor import cache_report

    bm = BlockManager(num_blocks=4, block_size=BS, tiers=TierManager(8, block_bytes=64))

    def run(rid: str, tokens: list[int]) -> None:
        r = Request(rid, tokens, SamplingParams(max_tokens=1))
        r.num_computed_tokens = bm.allocate(r)
        r.num_computed_tokens = r.num_tokens
        bm.cache_full_blocks(r)
        bm.free(r)
    first = cache_report(bm, None)
    assert first["reset"] and first["stored"] == first["stored_lower"] == []
    a, b = list(range(16)), list(range(100, 116))
    run("a", a)  # 4 blocks on the device
    report = cache_report(bm, first["cursor"])
    assert report["stored"] == hash_blocks(a, BS) and report["stored_lower"] == []
    run("b", b)  # evicts a's blocks: saved to the host tier
    report = msgpack.unpackb(msgpack.packb(cache_report(bm, report["cursor"])))
    assert sorted(report["removed"]) == sorted(report["stored_lower"]) == sorted(hash_blocks(a, BS))
    assert report["stored"] == hash_blocks(b, BS) and not report["reset"]
    idx = CacheIndex()
    idx.apply("e", report["stored"], report["removed"], report["reset"],
              report["stored_lower"], report["removed_lower"])
    snapshot = cache_report(bm, None)  # a new reader: everything, per tier
    assert snapshot["reset"] and sorted(snapshot["stored"]) == sorted(hash_blocks(b, BS))
    assert sorted(snapshot["stored_lower"]) == sorted(hash_blocks(a, BS))
    fresh = CacheIndex()
    fresh.apply("e", snapshot["stored"], (), True, snapshot["stored_lower"])
    assert fresh.prefix("e", hash_blocks(a, BS)) == idx.prefix("e", hash_blocks(a, BS)) \
        == PrefixHit(0, 4)
    bm.take_tier_ops()  # the step would run the saves
    bm.check_no_leaks()
