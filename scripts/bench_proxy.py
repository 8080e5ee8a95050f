#!/usr/bin/env python
"""The proxy alone: real engine actors, real dispatcher and HTTP proxy, but an engine that
computes nothing and emits one token per step for every request, as fast as Ray allows.

Each token's text is the wall-clock time the engine emitted it (hex microseconds), so the
client measures, per token, emit -> received over HTTP: Ray hop + actor + dispatcher + proxy +
SSE. Concurrency levels run 1..256 streams of 256 tokens each, twice: with the engine stepping
every 5 ms like a real decode engine (latency without a backlog), then as fast as it can
(throughput). Printed last: ``proxy_overhead_ms_p50``/``_p99`` (paced, per token, 1 stream)
and ``proxy_max_stream_tokens_per_s`` (unpaced, the best level).

  python scripts/bench_proxy.py            # ~1-2 min on 2 CPUs
  python scripts/bench_proxy.py --quick    # smoke run
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("OMP_NUM_THREADS", "1")

_REF_LEVEL = 1  # streams at which the overhead percentiles are reported (no backlog)


class FakeEngine:
    """LLMEngine's public interface, no model: every step, one token for every request."""

    def __init__(self, config: Any):
        from collections import OrderedDict
        self.config = config
        self.max_model_len = 4096
        self.requests: OrderedDict[str, Any] = OrderedDict()
        self.step_seconds = 0.0  # > 0: a paced engine (like a real decode step), no backlog

    def add_request(self, request_id: str, prompt: Any, params: Any,
                    kv_transfer_params: Any = None) -> None:
        self.requests[request_id] = {"prompt": list(prompt), "ids": [], "text": "",
                                     "max": params.max_tokens}

    def step(self) -> list[Any]:
        from pd_cluster.outputs import CompletionOutput, RequestOutput
        if self.step_seconds:
            time.sleep(self.step_seconds)
        outs, now = [], time.time()
        for rid, r in list(self.requests.items()):
            token_text = f" {int(now * 1e6) % (1 << 40):x}"
            r["ids"].append(100 + len(r["ids"]) % 300)
            r["text"] += token_text
            done = len(r["ids"]) >= r["max"]
            outs.append(RequestOutput(rid, None, r["prompt"], [CompletionOutput(
                0, r["text"], list(r["ids"]), "length" if done else None, None, None,
                token_text, r["ids"][-1:])], done))
            if done:
                del self.requests[rid]
        return outs

    def abort_request(self, request_ids: list[str]) -> list[Any]:
        from pd_cluster.outputs import CompletionOutput, RequestOutput
        out = []
        for rid in request_ids:
            r = self.requests.pop(rid, None)
            if r is not None:
                out.append(RequestOutput(rid, None, r["prompt"], [CompletionOutput(
                    0, r["text"], list(r["ids"]), "abort")], True))
        return out

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def stats(self) -> dict[str, Any]:
        return {"num_running": len(self.requests), "num_waiting": 0, "kv_blocks_used": 0,
                "kv_blocks_free": 1, "kv_blocks_total": 1}

    def check_no_leaks(self) -> None:
        assert not self.requests, sorted(self.requests)

    def kv_endpoint(self) -> None:
        return None

    def kv_peers(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass


def bench_actor_class() -> Any:
    import ray

    from pd_cluster.serving.engine.engine_actor import EngineActor

    class BenchEngineActor(EngineActor):
        def __init__(self, spec: dict[str, Any]):
            import pd_cluster.engine.llm_engine as llm_engine
            llm_engine.LLMEngine = FakeEngine  # this worker process only
            super().__init__(spec)

        async def pace(self, step_seconds: float) -> None:
            self.engine.step_seconds = step_seconds
    return ray.remote(BenchEngineActor)


def start(namespace: str) -> tuple[str, list[Any]]:
    import ray

    from pd_cluster.serving.cluster.cluster_config import parse_config
    from pd_cluster.serving.cluster.proxy_actor import proxy_actor_class
    cfg = parse_config({"mode": "colocated", "colocated": {"replicas": 1, "num_cpus": 1},
                        "engine": {"device": "cpu", "num_kv_blocks": 16},
                        "proxy": {"port": 0, "max_inflight": 1024, "request_timeout": 300.0},
                        "ray": {"namespace": namespace}})
    ray.init(address="local", num_cpus=4, namespace=namespace, include_dashboard=False,
             log_to_driver=False)
    specs = cfg.engine_specs()
    engines = [bench_actor_class().options(name=s.name, namespace=namespace, num_cpus=1)
               .remote(s.to_dict()) for s in specs]
    ray.get([e.ready.remote() for e in engines], timeout=300)
    proxy = proxy_actor_class().options(name="proxy", namespace=namespace, num_cpus=0,
                                        max_concurrency=4).remote(
        cfg.to_dict(), [{"name": s.name, "role": s.role} for s in specs], namespace)
    return ray.get(proxy.url.remote(), timeout=300), [proxy, *engines]


async def stream(session: Any, url: str, tokens: int, lat: list[float]) -> int:
    body = {"model": "tiny-llama", "prompt": [1, 2, 3], "max_tokens": tokens, "stream": True,
            "ignore_eos": True}
    n = 0
    async with session.post(f"{url}/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        async for raw in r.content:
            line = raw.strip()
            if not line.startswith(b"data: {"):
                continue
            now = time.time()
            text = json.loads(line[6:])["choices"][0]["text"]
            now_us = int(now * 1e6)
            for stamp in text.split():  # emit times, microseconds modulo 2**40
                lat.append(((now_us - int(stamp, 16)) % (1 << 40)) / 1e6)
                n += 1
    return n


async def level(url: str, streams: int, tokens: int) -> dict[str, float]:
    import aiohttp
    lat: list[float] = []
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        t0 = time.perf_counter()
        counts = await asyncio.gather(*(stream(session, url, tokens, lat)
                                        for _ in range(streams)))
        wall = time.perf_counter() - t0
    assert all(c == tokens for c in counts), f"lost tokens: {counts}"
    lat.sort()
    return {"streams": streams, "tokens_per_s": sum(counts) / wall,
            "p50_ms": lat[len(lat) // 2] * 1e3, "p99_ms": lat[int(len(lat) * 0.99)] * 1e3,
            "mean_ms": statistics.fmean(lat) * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="levels 1 and 16, 64 tokens")
    ap.add_argument("--tokens", type=int, default=256)
    args = ap.parse_args()
    levels, tokens = ([1, 16], 64) if args.quick else ([1, 4, 16, 64, 256], args.tokens)
    step_ms = 5.0
    import ray
    print("starting Ray, one engine actor (no model) and the proxy ...", flush=True)
    url, actors = start(f"bench-proxy-{os.getpid()}")
    try:
        asyncio.run(level(url, 4, 16))  # warm-up
        rows, paced = [], []
        header = f"{'streams':>8} {'tokens/s':>10} {'p50 ms':>8} {'p99 ms':>8} {'mean ms':>8}"
        for title, step, out in ((f"paced engine ({step_ms:.0f} ms steps): latency", step_ms,
                                  paced), ("unpaced engine: throughput", 0.0, rows)):
            ray.get([a.pace.remote(step / 1e3) for a in actors[1:]])
            print(f"{title}\n{header}", flush=True)
            for n in levels:
                row = asyncio.run(level(url, n, tokens))
                out.append(row)
                print(f"{n:>8} {row['tokens_per_s']:>10.0f} {row['p50_ms']:>8.2f} "
                      f"{row['p99_ms']:>8.2f} {row['mean_ms']:>8.2f}", flush=True)
    finally:
        for a in actors:
            ray.kill(a)
        ray.shutdown()
    ref = next((r for r in paced if r["streams"] == _REF_LEVEL), paced[-1])
    print(f"proxy_overhead_ms_p50={ref['p50_ms']:.2f}  (per token, emit -> client, "
          f"{ref['streams']} streams, engine stepping every {step_ms:.0f} ms)")
    print(f"proxy_overhead_ms_p99={ref['p99_ms']:.2f}")
    print(f"proxy_max_stream_tokens_per_s={max(r['tokens_per_s'] for r in rows):.0f}")


if __name__ == "__main__":
    main()
