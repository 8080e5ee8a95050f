"""Every wait for a request's events is bounded by its deadline (proxy.request_timeout): where
the dispatcher's own bound does not fire (a wait it does not bound: an engine paused mid-call,
a cleanup that hangs), the proxy still answers, a 504 before any output (streamed or not) and
the error in-band after some, and nothing is left running."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from pd_cluster.serving.api import request_deadline
from pd_cluster.serving.api.app import create_app
from pd_cluster.serving.cluster.cluster_config import parse_config
from tests.test_token_path import FakeEngineActor


def _hanging_stream(tokens_first: int, closed: list[str]):
    """A dispatcher stream that yields ``tokens_first`` events then waits forever, deaf to
    the deadline; its cleanup hangs too."""
    async def stream(job):
        real = stream.real(job)
        try:
            for _ in range(tokens_first):
                yield await anext(real)
            await asyncio.Event().wait()
        finally:
            closed.append(job.request_id)
            await real.aclose()
            await asyncio.Event().wait()  # a cleanup that never ends
    return stream


@pytest.mark.timeout(60)  # a wait left unbounded would hang here
@pytest.mark.parametrize("stream,tokens_first", [(False, 0), (True, 0), (True, 2)])
def test_a_wait_the_dispatcher_does_not_bound_still_ends_at_the_deadline(
        monkeypatch: pytest.MonkeyPatch, stream: bool, tokens_first: int) -> None:
    monkeypatch.setattr(request_deadline, "GRACE", 0.2)
    monkeypatch.setattr(request_deadline, "CLEANUP_BOUND", 0.3)
    cfg = parse_config({"mode": "colocated", "colocated": {"replicas": 1},
                        "proxy": {"request_timeout": 0.5, "port": 0}})

    async def go() -> tuple[int, str, float]:
        engine = FakeEngineActor()
        engine.step_seconds = 0.005
        app = create_app(cfg, [(engine.name, engine.role, engine.handle)])
        state = app.state.proxy
        closed: list[str] = []
        hanging = _hanging_stream(tokens_first, closed)
        hanging.real = state.dispatcher.stream
        monkeypatch.setattr(state.dispatcher, "stream", hanging)
        await state.pool.start()
        body = {"model": cfg.model_name, "prompt": [1, 2, 3], "max_tokens": 20,
                "ignore_eos": True, "stream": stream}
        try:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://proxy",
                                         timeout=30) as http:
                started = time.monotonic()
                r = await http.post("/v1/completions", json=body)
                took = time.monotonic() - started
            await asyncio.sleep(0.5)  # the bounded cleanup ends
            assert closed, "the engine stream was never closed"
            assert state.admission.running == 0 and state.inflight == 0
            return r.status_code, r.text, took
        finally:
            await state.pool.close()
            engine.stop()
    status, text, took = asyncio.run(go())
    assert took < 10, took  # the deadline (0.5 s) + grace (0.2 s) + cleanup bound (0.3 s)
    if tokens_first == 0:
        assert status == 504, text
        assert json.loads(text)["error"]["message"] == "request timed out"
    else:  # output went out: the error comes in-band, then the stream ends
        events = [ln[len("data: "):] for ln in text.splitlines() if ln.startswith("data: ")]
        assert status == 200 and events[-1] == "[DONE]", text
        assert json.loads(events[-2])["error"]["message"] == "request timed out", text
        assert sum(1 for e in events[:-2] if "choices" in json.loads(e)) >= tokens_first
