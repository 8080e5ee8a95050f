"""Prometheus metrics of the proxy, on a private registry (several proxies may share a process).

One name per series: vLLM's (vllm_metrics.py) where vLLM exports the same thing (request
latencies, token counts, running and waiting requests, KV cache usage, preemptions), ``pd_``
only for what is P/D's own: the proxy's queue, routing and disaggregation decisions, retries
and migrations, and the engines' KV transfer and step stats (engine_series.py), read from each
engine's latest stats at scrape time (a stat an engine does not report is simply absent); the
engines' KV offloading tiers per engine and tier (offload_series.py).
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram,
                               disable_created_metrics, generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pd_cluster.serving.observability.engine_series import (AS_VLLM, NOT_SERIES, PIPE_SERIES,
                                                            describe, series_name)
from pd_cluster.serving.observability.offload_series import PREFIX as OFFLOAD, OffloadCollector
from pd_cluster.serving.observability.vllm_metrics import VLLMEngineCollector, VLLMRequestMetrics

disable_created_metrics()  # no *_created series: they double the scrape for no use here

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3,
                    0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 60.0)
_OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064,
                     0.128, 0.256, 0.512, 1.0)


class ProxyMetrics:
    def __init__(self, engines_snapshot: Callable[[], list[Any]], model_name: str = "",
                 block_size: int = 16):
        self.registry = CollectorRegistry()
        r = self.registry
        self.vllm = VLLMRequestMetrics(r, model_name)
        r.register(VLLMEngineCollector(engines_snapshot, model_name, block_size))
        self.requests = Counter(
            "pd_requests", "Requests the proxy finished, by outcome (success, client_error, "
            "error, rejected, aborted)", ["outcome"], registry=r)
        self.inflight = Gauge("pd_requests_inflight", "Requests in the proxy now, those waiting "
                              "in its queue included", registry=r)
        self.queued = Gauge("pd_requests_queued", "Requests waiting in the proxy's queue now "
                            "for an in-flight slot (proxy.max_inflight)", registry=r)
        self.queue_time = self.vllm.queue  # vllm:request_queue_time_seconds
        self.proxy_overhead = Histogram(
            "pd_proxy_overhead_seconds", "Seconds from an engine producing an output to the "
            "proxy forwarding it to the client", buckets=_OVERHEAD_BUCKETS, registry=r)
        self.retries = Counter("pd_retries", "Requests retried on another engine pair before "
                               "any output was sent", registry=r)
        self.migrations = Counter(
            "pd_migrations", "Requests resumed on another engine after theirs failed mid-stream",
            registry=r)
        self.drain_moves = Counter(
            "pd_drain_moves", "Requests moved off an engine that was draining (scaled down "
            "or switching role), continued on another", registry=r)
        self.scaling = Counter(
            "pd_scaling_operations", "Engines added, removed and switched between roles on "
            "the running cluster, by action", ["action"], registry=r)
        self.degraded = Counter(
            "pd_degraded_requests", "Requests served by one engine in a disaggregated cluster, "
            "by reason (no_decode, no_prefill, no_kv_link)", ["reason"], registry=r)
        self.first_token_mismatch = Counter(
            "pd_first_token_mismatch", "Requests whose first token from the decode engine "
            "differed from the prefill engine's", registry=r)
        self.shared_prefills = Counter(
            "pd_shared_prefills", "Choices (n > 1) run on the engine holding their prompt's KV "
            "from a sibling choice's prefill", registry=r)
        self.disagg_decisions = Counter(
            "pd_disaggregation_decisions", "Requests in a disaggregated cluster by path "
            "(remote: prefill on a prefill engine; local: on the decode engine alone) and what "
            "decided it (remote_cheaper, margin: local was sooner by less than "
            "proxy.local_prefill_margin_ms, stall: by less than the margin plus the delay it "
            "adds to the decode engine's running requests (proxy.local_prefill_stall_weight), "
            "tpot: the pause would push a request the decode engine runs past "
            "proxy.slo.tpot_ms, local_cheaper, local_ttft: only local meets "
            "proxy.slo.ttft_ms, always: proxy.disaggregation)",
            ["path", "reason"], registry=r)
        self.route_cached_tokens = Counter(
            "pd_route_cached_prompt_tokens", "Prompt tokens the chosen engine was expected to "
            "hold in its prefix cache when routed, by role", ["role"], registry=r)
        self.route_lower_tier_tokens = Counter(
            "pd_route_lower_tier_prompt_tokens", "Of pd_route_cached_prompt_tokens, those the "
            "chosen engine was expected to hold only in a lower KV tier (host or disk: "
            "restored by a copy), by role", ["role"], registry=r)
        self.cache_report_failures = Counter(
            "pd_cache_report_failures", "Prefix-cache reports an engine failed to give (routing "
            "misses its cache until one succeeds), by engine", ["engine"], registry=r)
        self.route_prompt_tokens = Counter(
            "pd_route_prompt_tokens", "Prompt tokens routed, by role (the denominator of "
            "pd_route_cached_prompt_tokens)", ["role"], registry=r)
        self.auth_failures = Counter(
            "pd_auth_failures", "Requests or peers refused for want of a valid key or cluster "
            "secret, by channel (api: the HTTP API)", ["channel"], registry=r)
        self.planner_decisions = Counter(
            "pd_planner_decisions", "Changes the SLO controller made (planner.enabled), by "
            "action (scale_up, scale_down, switch) and reason (prefill_capacity, "
            "decode_capacity, rebalance, measured_ttft, measured_tpot, idle)",
            ["action", "reason"], registry=r)
        self.planner_look_failures = Counter(
            "pd_planner_look_failures", "SLO controller looks that raised (logged in the "
            "proxy's log), by the error's type: a controller that silently stopped acting "
            "shows here", ["error"], registry=r)
        r.register(_EngineCollector(engines_snapshot))
        r.register(OffloadCollector(engines_snapshot, model_name))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector(Collector):
    """``pd_engine_<stat>{engine, role}`` for each engine stat that is P/D's own."""

    def __init__(self, snapshot: Callable[[], list[Any]]):
        self._snapshot = snapshot

    def collect(self) -> Iterable[Metric]:
        labels = ["engine", "role"]
        healthy = GaugeMetricFamily("pd_engine_healthy", "1 if the proxy routes to the engine "
                                    "(it passes its health checks), else 0", labels=labels)
        inflight = GaugeMetricFamily("pd_engine_inflight", "Requests the proxy has on the "
                                     "engine now", labels=labels)
        families: dict[str, Metric] = {}
        for e in self._snapshot():
            lv = [e.name, e.role]
            healthy.add_metric(lv, 1.0 if e.healthy else 0.0)
            inflight.add_metric(lv, float(e.inflight))
            for key, value in e.stats.items():
                if (key in AS_VLLM or key in NOT_SERIES or key.startswith(OFFLOAD)
                        or isinstance(value, bool) or not isinstance(value, (int, float))):
                    continue
                by_pipe = key in PIPE_SERIES  # {engine, role, pipe}: counted per KV pipe
                fam = families.get(key)
                if fam is None:
                    series = describe(key)
                    kind = CounterMetricFamily if series.counter else GaugeMetricFamily
                    fam = families[key] = kind(series_name(key), series.help, labels=labels
                                               + (["pipe"] if by_pipe else []))
                fam.add_metric(lv + ([str(e.stats.get("kv_pipe", ""))] if by_pipe else []),
                               float(value))
        yield healthy
        yield inflight
        yield from families.values()
