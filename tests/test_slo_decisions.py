"""Serving to the SLO: the TPOT slack of a decode engine's requests (tpot_budget.py), measured
from what the proxy sees (DecodeWatch), bounds the local prefills the P-or-D choice allows."""
from __future__ import annotations

import pytest

from pd_cluster.sampling_params import SamplingParams
from pd_cluster.serving.observability.metrics import ProxyMetrics
from pd_cluster.serving.routing.decode_watch import DecodeWatch
from pd_cluster.serving.routing.engine_pool import EnginePool
from pd_cluster.serving.routing.legs import GenerateJob
from pd_cluster.serving.routing.planner import Planner
from tests.routing_helpers import pd_pair
from pd_cluster.serving.routing.ttft_model import LOCAL, REMOTE, Link, Side, decide
from pd_cluster.tpot_budget import SAFETY, Decoding, StepTimes, pause_slack, request_slack


def test_request_slack_is_what_keeps_its_tpot_at_the_target() -> None:
    r = Decoding(elapsed=1.0, tokens=51, max_tokens=101)  # 50 gaps in 1 s: 20 ms a token
    slack = request_slack(r, step=0.02, target=0.05)
    # Pausing that long ends it exactly at SAFETY x the target.
    assert (r.elapsed + slack + (r.max_tokens - r.tokens) * 0.02) / 100 == pytest.approx(
        SAFETY * 0.05)
    late = Decoding(elapsed=6.0, tokens=51, max_tokens=101)  # already past the target
    assert request_slack(late, 0.02, 0.05) < 0


def test_pause_slack_is_the_least_and_counts_a_newcomer() -> None:
    running = [Decoding(0.5, 20, 100), Decoding(2.0, 60, 100)]
    least = min(request_slack(r, 0.01, 0.05) for r in running)
    assert pause_slack(running, 0.01, 0.05) == least
    newcomer = request_slack(Decoding(0.0, 1, 8), 0.01, 0.05)
    assert newcomer < least and pause_slack(running, 0.01, 0.05, newcomer_tokens=8) == newcomer
    assert pause_slack([], 0.01, 0.05) == float("inf")


def test_step_times_percentiles_over_a_window() -> None:
    st = StepTimes(window=4, default=0.5)
    assert st.percentile(50) == 0.5
    for x in (0.010, 0.011, 0.012, 1.0, 0.013):  # the first falls out of the window
        st.add(x)
    assert len(st) == 4 and st.percentile(0) == 0.011 and st.percentile(100) == 1.0
    assert st.percentile(50) in (0.012, 0.013)


def test_decide_refuses_a_pause_beyond_the_slack_and_lets_ttft_override_the_stall() -> None:
    p = Side(uncached_tokens=1000, backlog_tokens=4000, prefill_rate=1000.0)  # remote: 5 s
    d = Side(uncached_tokens=1000, backlog_tokens=0, prefill_rate=1000.0)  # local: 1 s pause
    link = Link(1000, 0.0, 1e9, 0.0)
    assert decide(p, d, link, slack=2.0).path == LOCAL
    refused = decide(p, d, link, slack=0.5)
    assert (refused.path, refused.reason) == (REMOTE, "tpot")
    assert "pause exceeds" in refused.describe()
    # A stall weight that alone would keep it remote gives way when only local meets TTFT.
    assert decide(p, d, link, stall=10.0, slack=2.0).reason == "stall"
    met = decide(p, d, link, stall=10.0, slack=2.0, ttft_target=2.0)
    assert (met.path, met.reason) == (LOCAL, "local_ttft")


class _Leg:
    """What DecodeWatch and the load need of a leg (a stand-in for one on a real engine)."""

    def __init__(self, max_tokens: int) -> None:
        self.request = GenerateJob("x", [1], SamplingParams(max_tokens=max_tokens), 1e18)
        self.finished, self.failure, self.on_delta = False, None, None
        self.next_seq, self.on_fail = 0, None


class _Delta:
    def __init__(self, n: int = 1, finished: bool = False) -> None:
        self.token_ids, self.finished = [0] * n, finished


def test_decode_watch_measures_steps_and_progress_from_deltas() -> None:
    watch, leg = DecodeWatch(), _Leg(max_tokens=101)
    watch.watch(leg)
    assert watch.decoding(now=5.0) == [Decoding(0.0, 1, 101)]  # not started: a newcomer
    t = 100.0
    for _ in range(51):  # 51 tokens, 20 ms apart
        watch.delta(id(leg), 1, False, now=t)
        t += 0.02
    (r,) = watch.decoding(now=t - 0.02)
    assert r.tokens == 51 and r.elapsed == pytest.approx(1.0)
    assert watch.step_seconds(90, {}) == pytest.approx(0.02)
    watch.delta(id(leg), 1, True, now=t)  # finished: no longer followed
    assert watch.decoding(now=t) == []


def test_step_time_falls_back_to_the_engines_stats() -> None:
    assert DecodeWatch().step_seconds(90, {"output_steps": 10, "output_step_seconds": 0.3}) \
        == pytest.approx(0.03)
    assert DecodeWatch().step_seconds(90, {}) == 0.0


def _cluster(tpot_ms: float) -> tuple[EnginePool, Planner, ProxyMetrics]:
    return pd_pair(slo={"tpot_ms": tpot_ms}, local_prefill_stall_weight=0.0)


def _decisions(metrics: ProxyMetrics, path: str, reason: str) -> float:
    return metrics.registry.get_sample_value("pd_disaggregation_decisions_total",
                                             {"path": path, "reason": reason}) or 0.0


@pytest.mark.parametrize("tpot_ms, path, reason", [(25.0, REMOTE, "tpot"),
                                                   (200.0, LOCAL, "local_cheaper")])
def test_a_decode_engine_near_its_tpot_target_refuses_a_local_prefill(
        tpot_ms: float, path: str, reason: str) -> None:
    pool, planner, metrics = _cluster(tpot_ms)
    p, d = pool.engines
    queued = [_Leg(1) for _ in range(4)]
    for leg in queued:  # P has 4k prompt tokens queued: D alone answers ~1 s sooner
        p.load.add(leg, 1000)
    running = _Leg(max_tokens=129)
    d.decoding.watch(running)
    import time
    t = time.monotonic() - 64 * 0.02
    for _ in range(65):  # D decodes it at 20 ms a step, measured from its deltas
        d.decoding.delta(id(running), 1, False, now=t)
        t += 0.02
    # A 2000-token prompt: 0.5 s at the default rate, 1 s sooner than through P's queue.
    job = GenerateJob("r", list(range(2000)), SamplingParams(temperature=0, max_tokens=129),
                      1e18)
    legs = planner.plan(job, set(), "r1")
    assert len(legs) == (2 if path == REMOTE else 1)
    assert _decisions(metrics, path, reason) == 1
    # At 25 ms the running request absorbs 0.9 x 25 ms x 128 - 1.28 s - 64 x 20 ms = 0.32 s
    # of pause (a newcomer as long: the same), less than the 0.5 s prefill; at 200 ms, 21 s.
    assert queued and running.finished is False
