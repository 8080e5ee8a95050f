"""Admission: past ``max_inflight`` requests wait in a bounded first-come-first-served queue
(their wait counts in TTFT and is exported); only beyond the queue is a request refused, with
a 429 and a Retry-After. Unit tests of the queue, then the HTTP proxy over fake engines."""
from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from pd_cluster.serving.api.app import create_app
from pd_cluster.serving.api.errors import APIError
from pd_cluster.serving.cluster.cluster_config import parse_config
from pd_cluster.serving.observability.metrics import ProxyMetrics
from pd_cluster.serving.routing.admission import Admission
from tests.test_token_path import FakeEngineActor


def _metric(text: str, name: str) -> float:
    line = next(ln for ln in text.splitlines() if ln.startswith((name + " ", name + "{")))
    return float(line.split()[-1])


def test_the_queue_is_first_come_first_served_and_bounded() -> None:
    async def go() -> None:
        metrics = ProxyMetrics(lambda: [])
        adm = Admission(max_inflight=2, max_queue=3, metrics=metrics)
        far = time.monotonic() + 60
        assert await adm.enter(far) == 0.0 and await adm.enter(far) == 0.0
        order: list[int] = []

        async def queued(i: int) -> None:
            await adm.enter(far)
            order.append(i)
        waiters = [asyncio.create_task(queued(i)) for i in range(3)]
        await asyncio.sleep(0.01)
        assert adm.running == 2 and adm.queued == 3 and not order
        with pytest.raises(APIError) as over:
            await adm.enter(far)
        assert over.value.status == 429 and over.value.code == "rate_limit_exceeded"
        assert int(over.value.headers["Retry-After"]) >= 1
        for expect in ([0], [0, 1], [0, 1, 2]):  # each slot freed goes to the longest waiting
            adm.leave(latency=0.5)
            await asyncio.sleep(0.01)
            assert order == expect
        await asyncio.gather(*waiters)
        assert adm.running == 2 and adm.queued == 0
        for _ in range(2):
            adm.leave()
        assert adm.running == 0
        text = metrics.render().decode()
        assert _metric(text, "vllm:request_queue_time_seconds_count") == 5
        assert _metric(text, "vllm:request_queue_time_seconds_sum") > 0
        assert _metric(text, "pd_requests_queued") == 0
    asyncio.run(go())


def test_a_request_leaving_the_queue_keeps_the_count_right() -> None:
    async def go() -> None:
        adm = Admission(max_inflight=1, max_queue=4, metrics=ProxyMetrics(lambda: []))
        await adm.enter(time.monotonic() + 60)
        with pytest.raises(APIError) as late:  # its deadline passes while it waits
            await adm.enter(time.monotonic() + 0.05)
        assert late.value.status == 504
        gone = asyncio.create_task(adm.enter(time.monotonic() + 60))  # the client goes away
        await asyncio.sleep(0.01)
        gone.cancel()
        await asyncio.gather(gone, return_exceptions=True)
        assert adm.queued == 0 and adm.running == 1
        adm.leave()
        assert adm.running == 0
        assert await adm.enter(time.monotonic() + 1) == 0.0  # the slot is free again
    asyncio.run(go())


def test_over_the_inflight_bound_requests_queue_then_get_429_with_retry_after() -> None:
    """The proxy with 2 running slots and a queue of 3, 8 requests at once: 5 are served (3
    after waiting), 3 are refused at once with a Retry-After; queue time shows in TTFT."""
    cfg = parse_config({"mode": "colocated", "colocated": {"replicas": 1},
                        "proxy": {"max_inflight": 2, "max_queue": 3, "request_timeout": 30.0,
                                  "port": 0}})

    async def go() -> None:
        engine = FakeEngineActor()
        engine.step_seconds = 0.005
        app = create_app(cfg, [(engine.name, engine.role, engine.handle)])
        state = app.state.proxy
        await state.pool.start()
        body = {"model": cfg.model_name, "prompt": [1, 2, 3], "max_tokens": 20,
                "ignore_eos": True}
        try:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://proxy",
                                         timeout=30) as http:
                rs = await asyncio.gather(*(http.post("/v1/completions", json=body)
                                            for _ in range(8)))
                metrics = (await http.get("/metrics")).text
        finally:
            await state.pool.close()
            engine.stop()
        served = [r for r in rs if r.status_code == 200]
        refused = [r for r in rs if r.status_code == 429]
        assert len(served) == 5 and len(refused) == 3, [r.status_code for r in rs]
        for r in served:
            assert r.json()["usage"]["completion_tokens"] == 20
        for r in refused:
            assert r.json()["error"]["code"] == "rate_limit_exceeded"
            assert int(r.headers["Retry-After"]) >= 1
        assert _metric(metrics, "vllm:request_queue_time_seconds_count") == 5
        # three waited for a whole request (20 steps of 5 ms) at least
        assert _metric(metrics, "vllm:request_queue_time_seconds_sum") > 3 * 0.09
        assert _metric(metrics, 'pd_requests_total{outcome="rejected"}') == 3
        assert state.admission.running == 0 and state.inflight == 0
        assert not engine.sender._routes  # nothing left running on the engine
    asyncio.run(go())
