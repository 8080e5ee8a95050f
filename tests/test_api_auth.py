"""API keys on the proxy: the official OpenAI SDK and plain HTTP against the proxy app over a
fake engine (no Ray, no model). Without a valid key nothing is routed or run; /health stays
open; /metrics and /cluster/status are keyed unless configured open."""
from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from pd_cluster.serving.api.app import create_app
from pd_cluster.serving.api.auth import resolve_api_keys
from pd_cluster.serving.cluster.cluster_config import ConfigError, parse_config
from tests.test_token_path import FakeEngineActor


def _config(**proxy):
    return parse_config({"mode": "colocated", "colocated": {"replicas": 1},
                         "proxy": {"port": 0, "request_timeout": 30.0, **proxy}})


def _run(cfg, body) -> None:
    """``body(app, http, engine, submitted)`` against the app over one fake engine."""
    async def go() -> None:
        engine = FakeEngineActor()
        submitted: list = []
        real = engine.accept

        def counted(req) -> None:  # every request the engine's request socket takes
            submitted.append(req)
            real(req)
        engine.accept = counted
        app = create_app(cfg, [(engine.name, engine.role, engine.handle)])
        state = app.state.proxy
        await state.pool.start()
        try:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://proxy",
                                         timeout=30) as http:
                await body(app, http, engine, submitted)
        finally:
            await state.pool.close()
            engine.stop()
        assert state.inflight == 0 and not engine.sender._routes  # nothing left running
    asyncio.run(go())


def _sdk(http: httpx.AsyncClient, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url="http://proxy/v1", api_key=key, http_client=http,
                              max_retries=0)


def test_wrong_or_missing_key_is_401_and_nothing_runs() -> None:
    cfg = _config(api_key=["first-key", "second-key"], open_routes=[])  # /metrics keyed too

    async def body(app, http, engine, submitted) -> None:
        with pytest.raises(openai.AuthenticationError) as wrong:
            await _sdk(http, "not-the-key").completions.create(
                model=cfg.model_name, prompt=[1, 2, 3], max_tokens=4)
        assert wrong.value.status_code == 401
        assert wrong.value.body["code"] == "invalid_api_key"
        for headers in ({}, {"Authorization": "Bearer"}, {"Authorization": "Basic second-key"},
                        {"Authorization": "Bearer second-ke"}):
            r = await http.post("/v1/chat/completions", headers=headers, json={
                "model": cfg.model_name, "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 401, headers
            assert r.json()["error"]["type"] == "invalid_request_error"
            assert r.headers["www-authenticate"] == "Bearer"
        for path in ("/v1/models", "/metrics", "/cluster/status", "/tokenize", "/nowhere"):
            assert (await http.get(path)).status_code == 401, path
        assert not submitted  # nothing was routed to the engine
        health = await http.get("/health")
        assert health.status_code == 200 and health.json()["status"] == "ok"
        # the right key (either one) works, with the SDK and with plain HTTP
        done = await _sdk(http, "second-key").completions.create(
            model=cfg.model_name, prompt=[1, 2, 3], max_tokens=4, extra_body={"ignore_eos": True})
        assert done.usage.completion_tokens == 4 and len(submitted) == 1
        metrics = await http.get("/metrics", headers={"Authorization": "Bearer first-key"})
        assert metrics.status_code == 200
        assert 'pd_auth_failures_total{channel="api"} 10.0' in metrics.text
        assert 'pd_requests_total{outcome="success"} 1.0' in metrics.text
    _run(cfg, body)


def test_open_routes_and_no_keys() -> None:
    cfg = _config(api_key="k" * 20, open_routes=["/metrics"])

    async def body(app, http, engine, submitted) -> None:
        assert (await http.get("/metrics")).status_code == 200
        assert (await http.get("/cluster/status")).status_code == 401
    _run(cfg, body)

    async def open_body(app, http, engine, submitted) -> None:  # no key configured: open
        assert (await http.get("/v1/models")).status_code == 200
    _run(_config(), open_body)


def test_keys_from_the_environment_and_config_errors() -> None:
    env = {"MY_KEYS": "a-key, b-key", "EMPTY": " "}
    assert resolve_api_keys("c-key", "MY_KEYS", env) == ["c-key", "a-key", "b-key"]
    assert resolve_api_keys(None, None, env) == []
    for name in ("EMPTY", "UNSET"):
        with pytest.raises(ValueError, match=f"proxy.api_key_env: .*{name}"):
            resolve_api_keys(None, name, env)
    with pytest.raises(ConfigError, match="ssl_certfile, ssl_keyfile: set both"):
        _config(ssl_certfile="/tmp/cert.pem")
    with pytest.raises(ConfigError, match="open_routes"):
        _config(open_routes=["/v1/completions"])
