"""A shutdown that finishes what it started: the drain's parts on their own (no cluster).
SIGINT to `pd-cluster serve` during 8 streams (each stream finishes or ends with "server
shutting down", a new request meanwhile gets 503 with Retry-After, nothing logs a 500, and no
process or Ray session folder of the launcher is left) runs on the one `serve` of
tests/test_cli_serve.py."""
from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

import httpx

from pd_cluster.serving.api.errors import APIError
from pd_cluster.serving.api.shutdown import Drain, DrainGate, until_shutdown


async def _ticks(n: int, gate: asyncio.Event | None = None) -> AsyncIterator[int]:
    for i in range(n):
        if gate is not None and i == 1:
            await gate.wait()
        yield i


def test_drain_refuses_new_requests_with_503_and_retry_after() -> None:
    async def app(scope: dict, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})
    drain = Drain(lambda: 0)
    gated = DrainGate(app, drain)

    async def go() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(gated),
                                     base_url="http://t") as c:
            before = await c.post("/v1/completions", json={})
            drain.begin()
            return [before, await c.post("/v1/completions", json={}), await c.get("/metrics")]
    before, refused, metrics = asyncio.run(go())
    assert before.status_code == 200 and metrics.status_code == 200
    assert refused.status_code == 503 and refused.headers["retry-after"] == "5"
    assert refused.json()["error"] == {"message": "server shutting down",
                                       "type": "service_unavailable_error", "param": None,
                                       "code": "server_shutting_down"}


def test_running_requests_finish_then_the_rest_end_with_the_shutdown_error() -> None:
    async def go() -> tuple[list[int], str, dict[str, Any]]:
        inflight = [1]
        drain = Drain(lambda: inflight[0])
        gate = asyncio.Event()  # the stream is stuck after its first item
        got: list[int] = []
        error = ""

        async def consume() -> None:
            nonlocal error
            try:
                async for i in until_shutdown(_ticks(5, gate), drain):
                    got.append(i)
            except APIError as e:
                error = f"{e.status} {e.message}"
            finally:
                inflight[0] = 0
        task = asyncio.create_task(consume())
        running = asyncio.create_task(drain.run(timeout=0.2, poll=0.01))
        while not drain.expired:  # the engines keep stepping: the next item comes after
            await asyncio.sleep(0.01)
        gate.set()
        await task
        return got, error, await running
    got, error, result = asyncio.run(go())
    assert got == [0] and error == "503 server shutting down", (got, error)
    assert result["in_flight"] == 1 and result["ended"] == 1 and result["left"] == 0


def test_engine_failure_while_shutting_down_is_the_shutdown_error() -> None:
    async def failing() -> AsyncIterator[int]:
        yield 0
        raise APIError(503, "cannot resume the request: no healthy engine left to resume on")

    async def go() -> str:
        drain = Drain(lambda: 0)
        drain.begin()
        try:
            async for _ in until_shutdown(failing(), drain):
                pass
        except APIError as e:
            return e.message
        return ""
    assert asyncio.run(go()) == "server shutting down"
