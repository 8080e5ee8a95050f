"""What one client can make the proxy hold: the unknown field names it remembers (bounded), the
request body it reads (proxy.max_body_bytes, an OpenAI-shaped 413), and the tokenizing it
does (under admission: a request refused with 429 is never tokenized, and tokenizing runs off
the event loop)."""
from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from typing import Any

import httpx
import pytest

from pd_cluster.serving.api.app import create_app
from pd_cluster.serving.api.openai_schemas import CompletionRequest, parse_request
from pd_cluster.serving.api.unknown_fields import UnknownFields
from pd_cluster.serving.cluster.cluster_config import parse_config
from tests.token_path_fakes import FakeEngineActor


def test_unknown_field_names_are_logged_once_and_remembered_up_to_a_bound(
        caplog: pytest.LogCaptureFixture) -> None:
    unknown = UnknownFields(max_names=4)
    with caplog.at_level(logging.DEBUG, logger="pd_cluster.serving.api.unknown_fields"):
        req = parse_request(CompletionRequest, b'{"model": "m", "prompt": "x", "store": true,'
                                               b' "metadata": {}}', unknown)
        assert req.prompt == "x" and len(unknown) == 2
        parse_request(CompletionRequest, b'{"model": "m", "prompt": "x", "store": 1}', unknown)
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warned) == 1 and "metadata, store" in warned[0]  # once per name
        for i in range(100):  # a client making names up
            unknown.note([f"made_up_{i}", "x" * 10_000])
        assert len(unknown) == 4  # what is remembered stays bounded
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warned) == 3  # two more names, then: no more are remembered
        assert "further ones are logged at DEBUG only" in warned[-1]
        assert all(len(name) <= 64 for name in unknown._seen)


class _CountingTokenizer:
    """The proxy's tokenizer, recording the thread of every encode."""

    def __init__(self, inner: Any):
        self._inner, self.threads = inner, []

    def encode(self, *args: Any, **kw: Any) -> Any:
        self.threads.append(threading.current_thread().name)
        return self._inner.encode(*args, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _proxy(**proxy: Any) -> tuple[Any, Any, FakeEngineActor]:
    cfg = parse_config({"mode": "colocated", "colocated": {"replicas": 1},
                        "proxy": {"port": 0, **proxy}})
    engine = FakeEngineActor()
    app = create_app(cfg, [(engine.name, engine.role, engine.handle)])
    return cfg, app, engine


async def _serve(app: Any, engine: FakeEngineActor, go: Any) -> None:
    state = app.state.proxy
    await state.pool.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://proxy", timeout=30) as http:
            await go(http)
    finally:
        await state.pool.close()
        state.close()
        engine.stop()


def test_a_body_over_the_limit_is_an_openai_shaped_413() -> None:
    cfg, app, engine = _proxy(max_body_bytes=400)
    small = {"model": cfg.model_name, "prompt": [1, 2, 3], "max_tokens": 2}
    big = {**small, "prompt": list(range(1, 200))}  # ~1 KB of JSON

    async def chunks() -> Any:  # no Content-Length: the limit holds while reading
        data = json.dumps(big).encode()
        for i in range(0, len(data), 100):
            yield data[i:i + 100]

    async def go(http: httpx.AsyncClient) -> None:
        assert (await http.post("/v1/completions", json=small)).status_code == 200
        for r in (await http.post("/v1/completions", json=big),
                  await http.post("/v1/chat/completions", content=chunks(),
                                  headers={"content-type": "application/json"}),
                  await http.post("/tokenize", json={"prompt": "x" * 1000})):
            assert r.status_code == 413, r.text
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error" and err["code"] == "request_too_large"
            assert "proxy.max_body_bytes" in err["message"]
        metrics = (await http.get("/metrics")).text
        assert 'pd_requests_total{outcome="client_error"} 3.0' in metrics, metrics
    asyncio.run(_serve(app, engine, go))


def test_tokenizing_is_bounded_by_admission_and_off_the_event_loop() -> None:
    """One running slot, no queue: while the slot is taken, a request is refused with 429
    without being tokenized; once free, the request is tokenized on the proxy's tokenizing
    thread, not the event loop's."""
    cfg, app, engine = _proxy(max_inflight=1, max_queue=0)
    state = app.state.proxy
    tokenizer = state.tokenizer = _CountingTokenizer(state.tokenizer)
    body = {"model": cfg.model_name, "prompt": "hello world " * 50, "max_tokens": 2}

    async def go(http: httpx.AsyncClient) -> None:
        await state.admission.enter(time.monotonic() + 60)  # a request holds the only slot
        refused = await http.post("/v1/completions", json=body)
        assert refused.status_code == 429 and tokenizer.threads == []
        state.admission.leave()
        served = await http.post("/v1/completions", json=body)
        assert served.status_code == 200, served.text
        assert served.json()["usage"]["prompt_tokens"] > 50
        assert len(tokenizer.threads) == 1
        assert tokenizer.threads[0].startswith("proxy-tokenize")
        assert tokenizer.threads[0] != threading.current_thread().name
        assert state.admission.running == 0
    asyncio.run(_serve(app, engine, go))
