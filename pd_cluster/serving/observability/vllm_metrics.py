"""Prometheus series under vLLM's names, so a stock vLLM Grafana dashboard works on this proxy.

Only where the meaning is the same: request latencies and token counts (observed by the
proxy, from a request's arrival: its wait in the proxy's queue included), and each engine's
queue depths, KV cache usage and preemptions (from its latest stats), labelled with
``model_name`` and ``engine`` as vLLM labels them. These series have no ``pd_`` twin; the
P/D-specific ones are ``pd_`` (metrics.py, engine_series.py).
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

_LATENCY = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
            7.5, 10.0, 20.0, 40.0, 80.0, 160.0)


class VLLMRequestMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str):
        labels = ["model_name"]
        self.model_name = model_name
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds", "Seconds from a request's arrival at the proxy "
            "to its first token (its wait in the proxy's queue included)", labels,
            buckets=_LATENCY, registry=registry).labels(model_name)
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds", "Seconds between a request's streamed chunks",
            labels, buckets=_LATENCY, registry=registry).labels(model_name)
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds", "Seconds from a request's arrival to its last "
            "token (successful requests)", labels, buckets=_LATENCY,
            registry=registry).labels(model_name)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of the requests "
                                     "received", labels, registry=registry).labels(model_name)
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Tokens generated and sent to clients", labels,
            registry=registry).labels(model_name)
        self.success = Counter("vllm:request_success", "Requests finished successfully, by "
                               "finish reason (stop, length, ...)",
                               ["model_name", "finished_reason"], registry=registry)


class VLLMEngineCollector(Collector):
    """vllm:num_requests_running / _waiting, vllm:kv_cache_usage_perc and
    vllm:num_preemptions per engine."""

    def __init__(self, snapshot: Callable[[], list[Any]], model_name: str):
        self._snapshot, self._model = snapshot, model_name

    def collect(self) -> Iterable[Metric]:
        labels = ["model_name", "engine"]
        running = GaugeMetricFamily("vllm:num_requests_running", "Requests in the engine's "
                                    "running batch now", labels=labels)
        waiting = GaugeMetricFamily("vllm:num_requests_waiting", "Requests waiting in the "
                                    "engine's queue now (those waiting for their KV from a "
                                    "prefill engine included)", labels=labels)
        usage = GaugeMetricFamily("vllm:kv_cache_usage_perc", "Share of the engine's KV cache "
                                  "blocks in use (1 = all)", labels=labels)
        preemptions = CounterMetricFamily("vllm:num_preemptions", "Requests the engine "
                                          "preempted (their KV freed, recomputed later)",
                                          labels=labels)
        for e in self._snapshot():
            s, lv = e.stats, [self._model, e.name]
            if "num_running" in s:
                running.add_metric(lv, float(s["num_running"]))
                waiting.add_metric(lv, float(s.get("num_waiting", 0))
                                   + float(s.get("num_waiting_for_remote_kv", 0)))
            if s.get("kv_blocks_total"):
                usage.add_metric(lv, s.get("kv_blocks_used", 0) / s["kv_blocks_total"])
            if "num_preemptions" in s:
                preemptions.add_metric(lv, float(s["num_preemptions"]))
        yield running
        yield waiting
        yield usage
        yield preemptions
