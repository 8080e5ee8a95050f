"""Shared helpers for the router tests: a planner over a fake pool of 2 prefill and 2 decode
engines, all healthy and linked, and a job for it."""
from __future__ import annotations

from typing import Any

from pd_cluster.sampling_params import SamplingParams
from pd_cluster.serving.cluster.cluster_config import ProxyConfig
from pd_cluster.serving.observability.metrics import ProxyMetrics
from pd_cluster.serving.routing.engine_pool import EnginePool
from pd_cluster.serving.routing.legs import GenerateJob
from pd_cluster.serving.routing.planner import Planner


def fake_pool(block_size: int, **cfg: Any) -> tuple[EnginePool, Planner]:
    names = ["prefill-0", "prefill-1", "decode-0", "decode-1"]
    pool = EnginePool([(n, n.split("-")[0], None) for n in names], ProxyConfig(**cfg))
    for st in pool.engines:
        st.healthy, st.incarnation = True, "i0"
        st.kv_endpoint = f"tcp://{st.name}" if st.role == "decode" else None
    for st in pool.engines:
        if st.role == "prefill":
            st.kv_peers = {d.kv_endpoint: d.incarnation for d in pool.engines if d.kv_endpoint}
    pool.cache.block_size = block_size
    return pool, Planner(pool, "disaggregated", ProxyMetrics(lambda: pool.engines))


def pd_pair(**cfg: Any) -> tuple[EnginePool, Planner, ProxyMetrics]:
    """A planner over one healthy, linked prefill and decode engine (proxy config ``cfg``),
    and its metrics."""
    pool = EnginePool([("prefill-0", "prefill", None), ("decode-0", "decode", None)],
                      ProxyConfig(**cfg))
    p, d = pool.engines
    for e in pool.engines:
        e.healthy, e.incarnation = True, "i0"
    d.kv_endpoint = "tcp://d"
    p.kv_peers = {"tcp://d": "i0"}
    metrics = ProxyMetrics(lambda: pool.engines)
    return pool, Planner(pool, "disaggregated", metrics), metrics


def greedy_job(prompt: list[int], max_tokens: int = 8) -> GenerateJob:
    return GenerateJob("r", prompt, SamplingParams(temperature=0, max_tokens=max_tokens), 1e18)
