"""Prometheus series under vLLM's names, so a stock vLLM Grafana dashboard works on this proxy.

Only where the meaning is the same: request latencies, phases and token counts (observed by
the proxy, from a request's arrival: its wait in the proxy's queue included), and each
engine's queue depths, KV cache usage, preemptions and prefix-cache queries and hits (from its
latest stats), labelled with ``model_name`` and ``engine`` as vLLM labels them. These series
have no ``pd_`` twin; the P/D-specific ones are ``pd_`` (metrics.py, engine_series.py).
docs/design.md ("Metrics") lists vLLM's series left out and why.

A request's phases as the proxy sees them: queue = its wait for an in-flight slot, prefill =
admission to first token (the remote prefill and KV transfer included), decode = first to last
token, inference = prefill + decode.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

_TOKENS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
_N = (1, 2, 5, 10, 20)
_PHASE = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
          120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
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

        def hist(name: str, text: str, buckets: tuple) -> Any:
            return Histogram(name, text, labels, buckets=buckets,
                             registry=registry).labels(model_name)
        self.queue = hist("vllm:request_queue_time_seconds", "Seconds a request waited in the "
                          "proxy's queue for an in-flight slot (part of its TTFT)", _PHASE)
        self.prefill = hist("vllm:request_prefill_time_seconds", "Seconds from admission to "
                            "the first token (remote prefill and KV transfer included)", _PHASE)
        self.decode = hist("vllm:request_decode_time_seconds", "Seconds from the first token "
                           "to the last", _PHASE)
        self.inference = hist("vllm:request_inference_time_seconds", "Seconds from admission "
                              "to the last token (prefill + decode)", _PHASE)
        self.tpot = hist("vllm:request_time_per_output_token_seconds", "A request's decode "
                         "time per output token after the first", _LATENCY)
        self.prompt_len = hist("vllm:request_prompt_tokens", "Prompt tokens per request",
                               _TOKENS)
        self.output_len = hist("vllm:request_generation_tokens", "Tokens generated per "
                               "request", _TOKENS)
        self.max_tokens = hist("vllm:request_params_max_tokens", "The max_tokens request "
                               "parameter (after the default is applied)", _TOKENS)
        self.max_gen = hist("vllm:request_max_num_generation_tokens", "Most tokens a request "
                            "may generate (its max_tokens)", _TOKENS)
        self.n = hist("vllm:request_params_n", "The n request parameter", _N)

    def finished(self, queue: float, ttft: float | None, latency: float, n_prompt: int,
                 n_output: int, n: int, max_tokens: int | None) -> None:
        """A request that succeeded: its phases and sizes (vLLM observes them then too)."""
        inference = latency - queue
        prefill = (ttft - queue) if ttft is not None else inference
        decode = inference - prefill
        self.prefill.observe(prefill)
        self.decode.observe(decode)
        self.inference.observe(inference)
        if n_output > 1:
            self.tpot.observe(decode / (n_output - 1))
        self.prompt_len.observe(n_prompt)
        self.output_len.observe(n_output)
        self.n.observe(n)
        if max_tokens is not None:
            self.max_tokens.observe(max_tokens)
            self.max_gen.observe(max_tokens)


# Speculative decoding's counters: engine stat, vLLM's name (after vllm:spec_decode_), help.
_SPEC = (("spec_num_drafts", "num_drafts", "Verifications of a request's proposed tokens"),
         ("spec_num_draft_tokens", "num_draft_tokens", "Proposed tokens verified"),
         ("spec_num_accepted_tokens", "num_accepted_tokens", "Proposed tokens accepted"))


class VLLMEngineCollector(Collector):
    """vllm:num_requests_running / _waiting, vllm:kv_cache_usage_perc, vllm:num_preemptions,
    vllm:spec_decode_* (with speculation) and vllm:prefix_cache_queries / _hits per engine (in tokens, as vLLM counts them: the
    engines count whole blocks, so a prompt's partial last block is not in them)."""

    def __init__(self, snapshot: Callable[[], list[Any]], model_name: str,
                 block_size: int = 16):
        self._snapshot, self._model, self._block = snapshot, model_name, block_size

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
        queries = CounterMetricFamily("vllm:prefix_cache_queries", "Prompt tokens looked up "
                                      "in the engine's prefix cache", labels=labels)
        hits = CounterMetricFamily("vllm:prefix_cache_hits", "Prompt tokens found in the "
                                   "engine's prefix cache", labels=labels)
        spec = {key: CounterMetricFamily(f"vllm:spec_decode_{name}", text, labels=labels)
                for key, name, text in _SPEC}
        per_pos = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos", "Drafts accepted at each position "
            "(0: the first draft of a verification)", labels=labels + ["position"])
        for e in self._snapshot():
            s, lv = e.stats, [self._model, e.name]
            for key, family in spec.items():
                if key in s:
                    family.add_metric(lv, float(s[key]))
            for pos, n in enumerate(s.get("spec_accepted_per_pos") or ()):
                per_pos.add_metric(lv + [str(pos)], float(n))
            if "num_running" in s:
                running.add_metric(lv, float(s["num_running"]))
                waiting.add_metric(lv, float(s.get("num_waiting", 0))
                                   + float(s.get("num_waiting_for_remote_kv", 0)))
            if s.get("kv_blocks_total"):
                usage.add_metric(lv, s.get("kv_blocks_used", 0) / s["kv_blocks_total"])
            if "num_preemptions" in s:
                preemptions.add_metric(lv, float(s["num_preemptions"]))
            if "prefix_cache_queried_blocks" in s:
                queries.add_metric(lv, float(s["prefix_cache_queried_blocks"] * self._block))
            if "prefix_cache_hit_blocks" in s:
                hits.add_metric(lv, float(s["prefix_cache_hit_blocks"] * self._block))
        yield queries
        yield hits
        yield running
        yield waiting
        yield usage
        yield preemptions
        yield from spec.values()
        yield per_pos
