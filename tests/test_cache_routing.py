"""Cache-aware routing: the proxy's index fed by the engines' reports (reset on a restart) and
the planner picking the engine that holds a prompt's prefix, falling back to load when none
does (fake engines: no Ray, no model); then conversations on a launched cluster. The index and
the routing policies alone: tests/test_cache_index_router.py."""
from __future__ import annotations

import asyncio
from typing import Any

import pytest

from pd_cluster.engine.block_hash import hash_blocks
from pd_cluster.sampling_params import SamplingParams
from pd_cluster.serving.cluster.cluster_config import ProxyConfig
from pd_cluster.serving.routing.cache_feed import CacheFeed
from pd_cluster.serving.routing.engine_load import LinkStats
from pd_cluster.serving.routing.engine_pool import EnginePool
from pd_cluster.serving.routing.legs import LegKind
from tests.launch_helpers import launched_cluster
from tests.routing_helpers import fake_pool, greedy_job

BS = 4


# ---- the planner on a fake pool ------------------------------------------------------------
def test_planner_routes_to_the_engines_that_hold_the_prefix() -> None:
    pool, planner = fake_pool(BS)
    prompt = list(range(64))
    h = hash_blocks(prompt, BS)
    pool.cache.apply("decode-1", stored=h)
    pool.cache.apply("prefill-1", stored=h[:10])
    for _ in range(3):  # every time, not by rotation
        legs = planner.plan(greedy_job(prompt + [7, 8]), set(), "r")
        assert {lg.kind: lg.engine.name for lg in legs} == {
            LegKind.DECODE: "decode-1", LegKind.PREFILL: "prefill-1"}


def test_planner_falls_back_to_load_when_no_engine_holds_the_prefix() -> None:
    pool, planner = fake_pool(BS)
    pool.cache.apply("decode-0", stored=hash_blocks(list(range(500, 564)), BS))  # other prompt
    by_name = {e.name: e for e in pool.engines}
    by_name["decode-0"].outstanding_work = 50
    by_name["prefill-0"].outstanding_work = 50
    legs = planner.plan(greedy_job(list(range(64))), set(), "r")
    assert {lg.engine.name for lg in legs} == {"decode-1", "prefill-1"}


def test_planner_records_what_it_routed_for_the_next_turn() -> None:
    pool, planner = fake_pool(BS)
    turn1 = list(range(40))
    legs = planner.plan(greedy_job(turn1), set(), "r")
    p, d = (next(lg.engine.name for lg in legs if lg.kind is k)
            for k in (LegKind.PREFILL, LegKind.DECODE))
    for lg in legs:  # turn 1 answered: its prefill no longer queues
        lg.engine.load.first_output(id(lg), len(turn1), 0)
    for e in pool.engines:  # the pair now carries more load than the others: still the pair
        if e.name not in (p, d):
            e.outstanding_work = 0
        else:
            e.outstanding_work = 20
    legs2 = planner.plan(greedy_job(turn1 + list(range(900, 940))), set(), "r2")
    assert {lg.engine.name for lg in legs2} == {p, d}


def test_two_readers_of_one_engine_each_see_every_event() -> None:
    """Each proxy reads with its own cursor: one's read hides nothing from the other; a reader
    behind the bounded log gets a reset (then a snapshot), not a silent gap."""
    from pd_cluster.engine.block_manager import BlockManager
    from pd_cluster.request import Request
    bm = BlockManager(num_blocks=8, block_size=BS, max_pending_events=10)

    def run(rid: str, tokens: list[int]) -> Request:
        r = Request(rid, tokens, SamplingParams(max_tokens=1))
        r.num_computed_tokens = bm.allocate(r)
        r.num_computed_tokens = r.num_tokens
        bm.cache_full_blocks(r)
        return r
    first, a = bm.events_since(None)  # first contact: a reset, then follow from ``a``
    assert first.reset and a == 0
    r1 = run("a", list(range(8)))  # 2 blocks stored
    ev_a, a = bm.events_since(a)
    ev_b, b = bm.events_since(0)  # the second reader, started at the same point
    assert ev_a.stored == ev_b.stored == hash_blocks(list(range(8)), BS) and a == b == 2
    b = 0  # b's report was lost: it asks from 0 again
    bm.free(r1)
    r2 = run("b", list(range(100, 132)))  # 8 blocks: 2 evicted (removed) + 8 stored
    ev_a, a = bm.events_since(a)
    assert sorted(ev_a.removed) == sorted(hash_blocks(list(range(8)), BS))
    assert ev_a.stored == hash_blocks(list(range(100, 132)), BS) and a == 12
    behind, b2 = bm.events_since(b)  # 12 events since b; only 10 kept
    assert behind.reset and behind.stored == [] and b2 == 12
    assert sorted(bm.cached_hashes()) == sorted(ev_a.stored)
    assert not bm.events_since(a)[0].stored and bm.events_since(99)[0].reset  # another life
    bm.free(r2)
    bm.check_no_leaks()


# ---- the engines' reports --------------------------------------------------------------------
class _Reporting:
    """A fake engine handle answering cache_events like EngineActor."""

    def __init__(self, incarnation: str = "i0"):
        self.incarnation, self.held, self.pending = incarnation, [], []
        self.calls: list[bool] = []
        outer = self

        class _M:
            def remote(self, full: bool, cursor: int | None = None) -> Any:
                outer.calls.append(full)
                stored = list(outer.held) if full else outer.pending
                outer.pending = []
                return _done({"reset": full, "stored": stored, "removed": [], "cursor": 0,
                              "incarnation": outer.incarnation, "block_size": BS,
                              "kv_bytes_per_token": 128.0})
        self.cache_events = _M()


def _done(value: Any) -> asyncio.Future:
    fut = asyncio.get_running_loop().create_future()
    fut.set_result(value)
    return fut


def test_feed_syncs_fully_then_follows_events_and_resyncs_after_a_restart() -> None:
    pool = EnginePool([("decode-0", "decode", _Reporting())], ProxyConfig())
    e = pool.engines[0]
    e.healthy, e.incarnation = True, "i0"
    feed = CacheFeed(pool.cache, LinkStats(), 0.01, 1.0)
    a, b = hash_blocks(list(range(32)), BS), hash_blocks(list(range(32, 64)), BS)

    async def go() -> None:
        e.handle.held = list(a)
        await feed.poll(pool.engines)  # first contact: a full report
        assert e.handle.calls == [True] and pool.cache.prefix_blocks("decode-0", a) == 8
        assert pool.cache.block_size == BS and feed.link.bytes_per_token == 128.0
        e.handle.pending = list(b)
        await feed.poll(pool.engines)  # then only what changed
        assert e.handle.calls == [True, False] and pool.cache.size("decode-0") == 16
        # A restart: the health check sees a new incarnation; the index forgets the engine
        # and the next report is full (the restarted engine holds nothing yet).
        e.handle.incarnation, e.handle.held = "i1", []
        e.incarnation = "i1"
        feed.forget(e)
        assert pool.cache.size("decode-0") == 0
        await feed.poll(pool.engines)
        assert e.handle.calls[-1] is True and pool.cache.size("decode-0") == 0
    asyncio.run(go())


def test_a_failed_report_forgets_the_engine_until_a_full_one() -> None:
    class _Failing(_Reporting):
        fail = False

    h = _Failing()
    pool = EnginePool([("prefill-0", "prefill", h)], ProxyConfig())
    e = pool.engines[0]
    e.healthy, e.incarnation = True, "i0"
    feed = CacheFeed(pool.cache, LinkStats(), 0.01, 1.0)
    orig = h.cache_events.remote

    def remote(full: bool, cursor: int | None = None) -> Any:
        if h.fail:
            raise RuntimeError("actor busy")
        return orig(full, cursor)
    h.cache_events.remote = remote  # type: ignore[method-assign]

    async def go() -> None:
        h.held = hash_blocks(list(range(16)), BS)
        await feed.poll(pool.engines)
        assert pool.cache.size("prefill-0") == 4
        h.fail = True
        await feed.poll(pool.engines)  # events may be lost: stale knowledge dropped
        assert pool.cache.size("prefill-0") == 0
        h.fail = False
        await feed.poll(pool.engines)
        assert h.calls[-1] is True and pool.cache.size("prefill-0") == 4
    asyncio.run(go())


def _decode_handle() -> type:
    """A decode-0 handle class whose health answers with ``health.incarnation``."""
    from pd_cluster.driver.messages import EngineInfo

    class _Health:
        incarnation = "i0"

        def remote(self) -> Any:
            return _done(EngineInfo(name="decode-0", role="decode", incarnation=self.incarnation,
                                    pid=1, node_ip="x", kv_endpoint=None,
                                    max_model_len=64).to_dict())

    class _Handle:
        health = _Health()
    return _Handle


def test_health_check_that_sees_a_restart_forgets_the_engines_cache() -> None:
    _Handle = _decode_handle()

    pool = EnginePool([("decode-0", "decode", _Handle())], ProxyConfig())
    e = pool.engines[0]
    h = hash_blocks(list(range(32)), BS)

    async def go() -> None:
        await pool.check(e)
        pool.cache.record("decode-0", h)
        await pool.check(e)  # the same incarnation: kept
        assert pool.cache.size("decode-0") == 8
        e.handle.health.incarnation = "i1"
        await pool.check(e)  # restarted: its prefix cache is empty now
        assert e.restarts == 1 and pool.cache.size("decode-0") == 0
    asyncio.run(go())


def test_a_restart_seen_by_two_checks_at_once_counts_once() -> None:
    """The health loop and /cluster/status check concurrently; both see the new incarnation
    while its token path is being opened (an await): one restart, not two."""
    _Handle = _decode_handle()

    class _Channel:
        linked_to: str | None = None

        def linked(self, e: Any, incarnation: str) -> bool:
            return self.linked_to == incarnation

        async def attach(self, e: Any, incarnation: str) -> None:
            await asyncio.sleep(0.01)
            self.linked_to = incarnation

    pool = EnginePool([("decode-0", "decode", _Handle())], ProxyConfig())
    pool.token_channel = _Channel()
    e = pool.engines[0]

    async def go() -> None:
        await asyncio.gather(pool.check(e), pool.check(e))
        assert e.restarts == 0 and e.healthy
        e.handle.health.incarnation = "i1"
        await asyncio.gather(pool.check(e), pool.check(e))
        assert e.restarts == 1 and e.incarnation == "i1"
        await pool.check(e)
        assert e.restarts == 1
    asyncio.run(go())


# ---- on a cluster ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    # 1P2D; margin 0: on an idle cluster D prefilling alone is usually the cheaper path (no
    # link to cross), so turns run on a decode engine picked by its cached prefix. A TPOT
    # target no step on a loaded machine misses: the TTFT estimates alone decide here.
    yield from launched_cluster(tmp_path_factory, "local", "cache-routing", decode={"replicas": 2},
                                engine={"num_kv_blocks": 256, "max_model_len": 512},
                                proxy={"local_prefill_margin_ms": 0.0,
                                       "cache_events_interval": 0.1,
                                       "slo": {"tpot_ms": 60_000.0}})


def _metric(text: str, name: str, **labels: str) -> float:
    import re
    lab = ",".join(f'{k}="{v}"' for k, v in labels.items())
    m = re.search(rf"^{name}{{{lab}}} ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


@pytest.mark.timeout(900)  # the module's Ray cluster starts in this test's set-up
def test_conversations_stay_on_their_decode_engine_exactly(cluster) -> None:
    import random

    import httpx

    from pd_cluster import LLM
    from pd_cluster import SamplingParams as SP
    from pd_cluster.serving.cluster.cluster_config import resolve_model
    from pd_cluster.serving.cluster.testing import (cluster_status, leak_reports, wait_idle,
                                                    wait_until)

    def reports() -> int:
        return cluster_status(cluster.url)["proxy"]["cache_reports"]

    rng = random.Random(3)
    offline = LLM(model=resolve_model("tiny-llama"), num_kv_blocks=256, max_model_len=512)
    # Three conversations on two decode engines: rotation (least_loaded on an idle cluster)
    # would move some to the other engine at their next turn; cache_aware keeps them.
    convs = [[rng.randrange(4, 500) for _ in range(40)] for _ in range(3)]
    expected_cached = 0
    with httpx.Client(base_url=cluster.url, timeout=60) as http:
        for turn in range(3):
            for c, prompt in enumerate(convs):
                body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": 12,
                        "temperature": 0, "ignore_eos": True, "return_token_ids": True}
                r = http.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                got = r.json()["choices"][0]["token_ids"]
                ref = offline.generate([prompt], SP(temperature=0, max_tokens=12,
                                                    ignore_eos=True))[0].outputs[0].token_ids
                assert got == list(ref), f"conversation {c} turn {turn}"
                if turn:
                    expected_cached += len(prompt) // 16 * 16 - 16  # at least: all but new
                convs[c] = prompt + got + [rng.randrange(4, 500) for _ in range(20)]
            # The engines' reports of this turn's blocks reach the proxy: a round of reports
            # (one per engine) that started after the turn ended is in once 2 rounds' worth are.
            seen, engines = reports(), len(cluster_status(cluster.url)["engines"])
            wait_until(lambda: reports() >= seen + 2 * engines, 60.0, "the engines' reports")
        text = http.get("/metrics").text
    # Mostly local (the margin is 0); a turn may still go remote where the measured rates
    # say so (P has none measured: it borrows the decode engines' mean). Exact either way.
    local = _metric(text, "pd_disaggregation_decisions_total", path="local",
                    reason="local_cheaper")
    remote = _metric(text, "pd_disaggregation_decisions_total", path="remote",
                     reason="remote_cheaper")
    assert local + remote == 9 and local >= 1
    cached = _metric(text, "pd_route_cached_prompt_tokens_total", role="decode")
    assert cached >= expected_cached > 0
    hits = {e["name"]: e["stats"].get("prefix_cache_hit_blocks", 0)
            for e in cluster_status(cluster.url)["engines"] if e["role"] == "decode"}
    assert sum(hits.values()) >= expected_cached // 16
    wait_idle(cluster.url)
    assert leak_reports(cluster) == {}
