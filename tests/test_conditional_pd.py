"""Cost-based conditional disaggregation: the TTFT model on given rates and queues, the online
measurements it reads (engine_load.py), the planner's choice with its metrics and access-log
route, and the proxy/role config knobs. Fake engines: no Ray, no model."""
from __future__ import annotations

import gc
import time

import pytest

from pd_cluster.driver.messages import EngineDelta
from pd_cluster.sampling_params import SamplingParams
from pd_cluster.serving.cluster.cluster_config import (DECODE_PREFILL_CAP, ConfigError, parse_config)
from pd_cluster.serving.observability.metrics import ProxyMetrics
from pd_cluster.serving.routing.engine_load import EngineLoad, Ewma, LinkStats
from pd_cluster.serving.routing.engine_pool import EnginePool
from pd_cluster.serving.routing.legs import GenerateJob, Leg, LegKind
from pd_cluster.serving.routing.planner import Planner
from pd_cluster.serving.routing.ttft_model import LOCAL, REMOTE, Bias, Link, Side, decide
from tests.routing_helpers import pd_pair

NO_LINK = Link(0, 0.0, 1e9, 0.0)


def test_remote_when_p_is_idle_and_holds_as_much() -> None:
    d = decide(Side(500, 0, 1000.0), Side(500, 0, 1000.0), Link(500, 1e3, 1e9, 0.002), 0.02)
    assert d.path == REMOTE and d.reason == "margin"  # local is 2 ms sooner: under 20 ms
    assert d.remote_s == pytest.approx(0.5 + 0.002 + 500e3 / 1e9)
    assert d.local_s == pytest.approx(0.5)


def test_local_when_p_queue_costs_more_than_the_margin() -> None:
    p_busy = Side(500, 4000, 1000.0)  # 4.5 s of work on P
    d = decide(p_busy, Side(500, 0, 500.0), NO_LINK, 0.02)  # D is slower, yet 1 s
    assert d.path == LOCAL and d.reason == "local_cheaper"
    assert "local=1000.0ms sooner than remote=4500.0ms" in d.describe()


def test_margin_keeps_small_gains_remote() -> None:
    # D would answer 10 ms sooner: not worth prefilling between its decodes (margin 20 ms)
    p, dd = Side(100, 10, 1000.0), Side(100, 0, 1000.0)
    d = decide(p, dd, NO_LINK, 0.02)
    assert d.path == REMOTE and d.reason == "margin"  # the margin decided, not the cost
    assert d.describe() == ("remote(margin: local=100.0ms sooner than remote=110.0ms by less "
                            "than the margin 20.0ms)")
    d = decide(p, dd, NO_LINK, 0.0)
    assert d.path == LOCAL and d.reason == "local_cheaper"
    assert d.describe() == ("local(local_cheaper: local=100.0ms sooner than remote=110.0ms by "
                            "more than the margin 0.0ms)")
    d = decide(dd, p, NO_LINK, 0.02)
    assert d.describe() == "remote(remote_cheaper: remote=100.0ms <= local=110.0ms)"


def test_stall_on_d_running_requests_keeps_prefill_remote() -> None:
    # P's queue costs the new request 4 s, D alone 1 s: 3 s sooner. But 8 requests decoding on D
    # would each wait out that 1 s prefill: 8 s of their time for 3 s of the new one's.
    p_busy, dd = Side(500, 4000, 1000.0), Side(500, 0, 500.0)
    d = decide(p_busy, dd, NO_LINK, 0.02, stall=8 * 1.0)
    assert d.path == REMOTE and d.reason == "stall" and d.stall_s == 8.0
    assert d.describe() == ("remote(stall: local=1000.0ms sooner than remote=4500.0ms by less than "
                            "the margin 20.0ms plus the stall 8000.0ms it adds to D's running "
                            "requests)")
    d = decide(p_busy, dd, NO_LINK, 0.02, stall=2.0)  # fewer running: 3.5 s > 2 s + margin
    assert d.path == LOCAL and d.reason == "local_cheaper"


def test_cached_prefix_on_d_and_shipping_cost_count() -> None:
    # Multi-turn: D holds the history, P does not; P must compute and ship it all.
    p, dd = Side(600, 0, 2000.0), Side(40, 0, 1000.0)
    assert decide(p, dd, Link(600, 2e4, 1e8, 0.002), 0.02).path == LOCAL
    # Both hold it: remote again (P computes the same 40 tokens, D stays free).
    assert decide(Side(40, 0, 2000.0), dd, Link(40, 2e4, 1e8, 0.002), 0.02).path == REMOTE
    # A slow link alone can tip it: 10 MB at 10 MB/s is a second.
    assert decide(Side(100, 0, 2000.0), Side(100, 0, 1000.0),
                  Link(100, 1e5, 1e7, 0.0), 0.02).path == LOCAL


def test_bias_learnt_from_delivered_ttft_moves_the_choice() -> None:
    # Local answers 30 ms later than its formula says (proxy hops, step overhead), remote
    # 10 ms sooner: a choice that looked local by 25 ms is remote once both are learnt.
    p, dd = Side(100, 45, 1000.0), Side(100, 0, 1000.0)
    assert decide(p, dd, NO_LINK, 0.02).path == LOCAL
    bias = Bias(alpha=0.5)
    for _ in range(20):
        bias.add(LOCAL, 0.130, 0.100)
        bias.add(REMOTE, 0.135, 0.145)
    assert bias.value[LOCAL] == pytest.approx(0.030) and bias.value[REMOTE] == pytest.approx(-0.010)
    d = decide(p, dd, NO_LINK, 0.02, bias)
    assert d.path == REMOTE
    assert d.remote_s == pytest.approx(0.135) and d.local_s == pytest.approx(0.130)
    # A path not taken for a while is unbiased again (its bias could no longer be measured).
    bias._updated[LOCAL] -= 10.0
    assert bias.get(LOCAL) == 0.0 and decide(p, dd, NO_LINK, 0.02, bias).path == LOCAL


# ---- online measurements -------------------------------------------------------------------
def _Leg() -> Leg:
    """A leg waiting for its first output (the load reads only its state)."""
    return Leg(None, None, 0, LegKind.WHOLE)  # type: ignore[arg-type]


def test_backlog_counts_legs_until_first_output_or_gone() -> None:
    load = EngineLoad()
    a, b, c = _Leg(), _Leg(), _Leg()
    load.add(a, 100)
    load.add(b, 200)
    load.add(c, 50)
    assert load.backlog() == 350
    load.first_output(id(a), 100, 0)  # answered: no longer queued
    b.fail(RuntimeError("engine died"))  # failed legs do not count
    assert load.backlog() == 50
    del c
    gc.collect()
    assert load.backlog() == 0 and not load._pending


def test_prefill_rate_is_measured_from_first_outputs() -> None:
    load = EngineLoad(default_rate=1234.0)
    assert load.prefill_rate.get() == 1234.0
    for i in range(4):  # each sampled when the next one answers; two are warm-up
        leg = _Leg()
        load.add(leg, 400)
        time.sleep(0.002)
        load.first_output(id(leg), 400, 0)
        assert load.prefill_rate.samples == i
        assert (load.prefill_rate.value is None) == (i < 3)
    assert load.prefill_rate.get() > 1234.0  # answered at once: a high rate
    for _ in range(2):  # too short to measure a rate: joined with the next, no sample
        short = _Leg()
        load.add(short, 4)
        time.sleep(0.002)
        load.first_output(id(short), 4, 0)
    assert load.prefill_rate.samples == 4


def test_rate_is_the_service_rate_of_queued_and_batched_prefills(monkeypatch) -> None:
    from pd_cluster.serving.routing import engine_load
    now = [100.0]
    monkeypatch.setattr(engine_load.time, "monotonic", lambda: now[0])
    load = EngineLoad()
    load.prefill_rate.skip = 0
    a, b, c = _Leg(), _Leg(), _Leg()
    for leg in (a, b, c):  # three prompts queued at once
        load.add(leg, 200)
    now[0] = 100.1
    load.first_output(id(a), 200, 0)  # 200 tokens in 0.1 s
    load.first_output(id(b), 200, 0)  # batched with a: same step, no time of its own
    assert load.prefill_rate.samples == 0  # the step's batch may not be complete yet
    now[0] = 100.2
    load.first_output(id(c), 200, 50)  # served after b: closes a and b's step
    assert load.prefill_rate.get() == pytest.approx(4000.0)  # (200 + 200) / 0.1
    assert load.prefill_rate.samples == 1


def test_one_outlier_moves_the_rate_a_step() -> None:
    r = Ewma(100.0, alpha=0.5)
    r.add(1000.0)
    r.add(1.0)  # a 1000x slower spell: taken as 4x slower
    assert r.get() == pytest.approx(1000.0 + 0.5 * (250.0 - 1000.0))


def test_a_stale_low_rate_is_raised_so_the_engine_is_tried_again() -> None:
    import time
    pool, planner, _ = _planner()
    p, d = pool.engines
    p.load.prefill_rate.skip = d.load.prefill_rate.skip = 0  # past their warm-up
    p.load.prefill_rate.add(50.0)  # P had a slow spell...
    d.load.prefill_rate.add(5000.0)
    assert planner._rate(p) == 50.0
    p.load.prefill_rate.updated = time.monotonic() - 60  # ...and was not chosen since
    assert planner._rate(p) == pytest.approx((50.0 + 5000.0) / 2)
    p.load.prefill_rate.add(4000.0)  # its next sample is its rate again, not a step towards
    assert planner._rate(p) == 4000.0


def test_link_bandwidth_from_producer_counters() -> None:
    link = LinkStats()
    link.engine_stats("prefill-0", {"kv_bytes_sent": 0, "kv_send_seconds": 0.0})
    link.engine_stats("prefill-0", {"kv_bytes_sent": 5e6, "kv_send_seconds": 0.5})
    assert link.bandwidth.get() == pytest.approx(1e7)
    link.engine_stats("prefill-0", {"kv_bytes_sent": 0, "kv_send_seconds": 0.0})  # restart
    assert link.bandwidth.samples == 1


# ---- the planner's choice --------------------------------------------------------------------
def _planner(**cfg: object) -> tuple[EnginePool, Planner, ProxyMetrics]:
    return pd_pair(**cfg)


def _job(n: int) -> GenerateJob:
    return GenerateJob("r", list(range(n)), SamplingParams(temperature=0, max_tokens=8), 1e18)


def _count(metrics: ProxyMetrics, path: str, reason: str) -> float:
    return metrics.registry.get_sample_value("pd_disaggregation_decisions_total",
                                             {"path": path, "reason": reason}) or 0.0


def test_planner_goes_remote_on_an_idle_cluster() -> None:
    _, planner, metrics = _planner()
    job = _job(300)
    legs = planner.plan(job, set(), "r")
    assert [lg.kind for lg in legs] == [LegKind.DECODE, LegKind.PREFILL]
    # Both idle: D alone would skip the KV link's latency, a gain under the margin.
    assert _count(metrics, REMOTE, "margin") == 1
    assert job.route.startswith("prefill-0->decode-0 remote(margin: local=")


def test_planner_prefills_on_d_when_p_is_backed_up() -> None:
    pool, planner, metrics = _planner()
    busy = [_Leg() for _ in range(4)]
    for leg in busy:  # P has 4k prompt tokens queued
        pool.engines[0].load.add(leg, 1000)
    job = _job(300)
    legs = planner.plan(job, set(), "r9")
    assert len(legs) == 1 and legs[0].kind is LegKind.WHOLE
    assert legs[0].engine.name == "decode-0" and legs[0].request.kv_transfer_params is None
    assert _count(metrics, LOCAL, "local_cheaper") == 1
    assert job.route.startswith("decode-0 local(local_cheaper")
    assert pool.engines[1].load.backlog() == 300  # D's own queue now counts its prefill
    del busy, leg, legs  # every leg ends: both queues empty, remote again
    gc.collect()
    assert len(planner.plan(_job(300), set(), "r10")) == 2


@pytest.mark.parametrize("weight, path", [(1.0, REMOTE), (0.0, LOCAL)])
def test_planner_weighs_the_stall_of_d_running_requests(weight: float, path: str) -> None:
    pool, planner, metrics = _planner(local_prefill_stall_weight=weight)
    busy = [_Leg() for _ in range(4)]
    for leg in busy:  # P has 4k prompt tokens queued: D alone answers ~4 s sooner
        pool.engines[0].load.add(leg, 1000)
    pool.engines[1].inflight = 16  # ... but 16 requests decode there, each stalled ~0.3 s
    legs = planner.plan(_job(300), set(), "r9")
    assert len(legs) == (2 if path == REMOTE else 1)
    assert _count(metrics, path, "stall" if path == REMOTE else "local_cheaper") == 1


def test_planner_always_disaggregates_when_configured() -> None:
    pool, planner, metrics = _planner(disaggregation="always")
    busy = [_Leg() for _ in range(4)]
    for leg in busy:
        pool.engines[0].load.add(leg, 1000)
    legs = planner.plan(_job(300), set(), "r9")
    assert len(legs) == 2 and _count(metrics, REMOTE, "always") == 1


def test_planner_balances_prefills_between_p_and_d_under_load() -> None:
    # A TPOT target so loose that no pause breaks it: the TTFT estimates alone decide.
    _, planner, metrics = _planner(slo={"tpot_ms": 10_000.0})
    plans = [planner.plan(_job(1000), set(), f"r{i}") for i in range(4)]  # none answered yet
    assert [len(legs) for legs in plans] == [2, 1, 2, 1]  # each goes where the queue is shorter
    assert _count(metrics, LOCAL, "local_cheaper") == 2


def test_first_output_of_a_planned_leg_feeds_the_rate() -> None:
    pool, planner, _ = _planner()
    for i in range(2):  # the second answer closes the first one's sample
        legs = planner.plan(_job(300), set(), f"r{i}")
        p_leg = next(lg for lg in legs if lg.kind is LegKind.PREFILL)
        assert pool.engines[0].load.backlog() == 300
        time.sleep(0.002)
        p_leg.apply(EngineDelta(f"r{i}", 0, [5], "a", True, "length", None, 300, 0, 0.0))
        assert pool.engines[0].load.backlog() == 0
    assert pool.engines[0].load.prefill_rate.samples == 1


# ---- config -----------------------------------------------------------------------------------
def test_proxy_knobs_validate_with_their_key() -> None:
    cfg = parse_config({})
    assert cfg.proxy.routing == "cache_aware" and cfg.proxy.disaggregation == "auto"
    with pytest.raises(ConfigError, match=r"proxy\.disaggregation: must be one of"):
        parse_config({"proxy": {"disaggregation": "sometimes"}})
    with pytest.raises(ConfigError, match=r"proxy\.local_prefill_margin_ms: must be >= 0"):
        parse_config({"proxy": {"local_prefill_margin_ms": -1.0}})
    with pytest.raises(ConfigError, match=r"proxy\.local_prefill_stall_weight: must be >= 0"):
        parse_config({"proxy": {"local_prefill_stall_weight": -0.5}})
    with pytest.raises(ConfigError, match=r"proxy\.routing: must be one of"):
        parse_config({"proxy": {"routing": "random"}})
    with pytest.raises(ConfigError, match=r"decode\.max_prefill_tokens_per_step: must be >= 1"):
        parse_config({"decode": {"max_prefill_tokens_per_step": 0}})


def test_decode_engines_get_a_prefill_cap_by_default() -> None:
    specs = {s.role: s.engine_args
             for s in parse_config({"mode": "disaggregated"}).engine_specs()}
    assert specs["decode"]["max_prefill_tokens_per_step"] == DECODE_PREFILL_CAP
    assert "max_prefill_tokens_per_step" not in specs["prefill"]
    over = parse_config({"decode": {"max_prefill_tokens_per_step": 64}}).engine_specs()
    assert {s.role: s.engine_args.get("max_prefill_tokens_per_step") for s in over} == {
        "prefill": None, "decode": 64}
