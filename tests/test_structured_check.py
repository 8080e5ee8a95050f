"""The proxy's check that an output constraint compiles: off the event loop (a slow schema
does not stall other streams), bounded in size (proxy.grammar_max_bytes) and time
(proxy.grammar_check_timeout), each a 400 naming the field; results remembered."""
from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import httpx

from pd_cluster.serving.api import grammar_check
from tests.test_api_limits import _proxy, _serve  # a proxy over a fake engine, served in-process
from tests.token_path_fakes import FakeEngineActor

# xgrammar takes seconds on this nested repeat (a 50-byte spec); 0.3 s is its time limit here
SLOW = {"type": "object", "properties": {"s": {"type": "string",
                                               "pattern": "(a{1,200}){1,200}"}}}


def _run(app: Any, engine: FakeEngineActor, go: Any) -> None:
    asyncio.run(_serve(app, engine, go))


def _body(cfg: Any, **kw: Any) -> dict[str, Any]:
    return {"model": cfg.model_name, "prompt": [1, 2, 3], "max_tokens": 8, **kw}


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def test_a_slow_schema_is_a_400_while_other_streams_go_on(monkeypatch) -> None:
    cfg, app, engine = _proxy(grammar_check_timeout=0.3)
    compiles, real = [], grammar_check._compile_error
    compile_started, compile_done = threading.Event(), threading.Event()

    def counted(params, field):
        compiles.append(params.kind)
        compile_started.set()
        try:
            return real(params, field)
        finally:
            compile_done.set()

    monkeypatch.setattr(grammar_check, "_compile_error", counted)

    async def go(http: httpx.AsyncClient) -> None:
        slow = asyncio.create_task(http.post("/v1/completions", json=_body(
            cfg, response_format=_schema_format(SLOW))))
        await asyncio.to_thread(compile_started.wait, 30)
        # While it compiles, a plain request streams to its end (the loop is free).
        async with http.stream("POST", "/v1/completions",
                               json=_body(cfg, stream=True)) as r:
            lines = [line async for line in r.aiter_lines() if line.startswith("data:")]
        assert r.status_code == 200 and lines[-1] == "data: [DONE]"
        assert not compile_done.is_set()  # it streamed while the compile ran
        resp = await slow
        assert resp.status_code == 400, resp.text
        err = resp.json()["error"]
        assert err["param"] == "response_format" and "did not compile within" in err["message"]
        again = await http.post("/v1/completions", json=_body(
            cfg, response_format=_schema_format(SLOW)))
        assert again.status_code == 400 and again.json()["error"] == err  # remembered
        assert compiles == ["json"]  # compiled once
        await asyncio.to_thread(compile_done.wait, 60)  # let the compile thread end

    _run(app, engine, go)


def test_a_schema_over_the_size_limit_is_a_400_uncompiled(monkeypatch) -> None:
    cfg, app, engine = _proxy(grammar_max_bytes=1000)
    monkeypatch.setattr(grammar_check, "_compile_error",
                        lambda *a: (_ for _ in ()).throw(AssertionError("compiled")))
    big = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(100)}}

    async def go(http: httpx.AsyncClient) -> None:
        r = await http.post("/v1/completions", json=_body(
            cfg, structured_outputs={"json": big}))
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["param"] == "structured_outputs"
        assert f"is {len(json.dumps(big))} bytes, over proxy.grammar_max_bytes" in err["message"]

    _run(app, engine, go)


def test_bad_specs_and_tools_are_400s_naming_the_field() -> None:
    cfg, app, engine = _proxy()
    bad_tool = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "(("}}}}}]

    async def go(http: httpx.AsyncClient) -> None:
        r = await http.post("/v1/completions", json=_body(cfg, structured_outputs={
            "regex": "(("}))
        assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs"
        assert "regex does not compile" in r.json()["error"]["message"]
        r = await http.post("/v1/chat/completions", json={
            "model": cfg.model_name, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4, "tools": bad_tool, "tool_choice": "required"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
        ok = await http.post("/v1/completions", json=_body(cfg, structured_outputs={
            "choice": ["a", "b"]}))
        assert ok.status_code == 200, ok.text

    _run(app, engine, go)
