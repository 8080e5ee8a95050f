"""A shutdown that finishes what it started: the drain's parts on their own (no cluster), then
SIGINT to `pd-cluster serve` during 8 streams: each stream finishes or ends with "server
shutting down", a new request meanwhile gets 503 with Retry-After, nothing logs a 500, and no
process or Ray session folder of the launcher is left."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
from pathlib import Path
from typing import Any, AsyncIterator

import httpx
import pytest

from pd_cluster.serving.api.errors import APIError
from pd_cluster.serving.api.shutdown import Drain, DrainGate, until_shutdown
from pd_cluster.serving.cluster.testing import wait_until


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


# ---- the whole thing, as a user runs it ------------------------------------------------------
pytestmark_cluster = pytest.mark.timeout(900)


def _stream(url: str, out: dict[int, Any], i: int, started: threading.Event,
            counter: list[int], lock: threading.Lock) -> None:
    body = {"model": "tiny-llama", "prompt": f"Story {i}:", "max_tokens": 1500,
            "temperature": 0, "ignore_eos": True, "stream": True}
    events: list[Any] = []
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
            out[i] = {"status": r.status_code, "events": events}
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                events.append(data if data == "[DONE]" else json.loads(data))
                if len(events) == 1:
                    with lock:
                        counter[0] += 1
                        if counter[0] == 8:
                            started.set()
    except httpx.HTTPError as e:
        out[i] = {"status": None, "events": events, "error": repr(e)}


@pytestmark_cluster
def test_sigint_during_8_streams_drains_then_leaves_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.launch_helpers import Launcher, _env
    from tests.test_cli_serve import _session_pids
    before = set(Path("/tmp").glob("pd-cluster-ray-*"))
    env = _env(tmp_path, monkeypatch)
    launcher = Launcher(["serve", "tiny-llama", "--port", "0", "--namespace",
                         f"test-drain-{os.getpid()}", "--num-kv-blocks", "1024",
                         "--shutdown-timeout", "2", "--no-progress"], env)
    sid = launcher.proc.pid
    out: dict[int, Any] = {}
    started, lock, counter = threading.Event(), threading.Lock(), [0]
    try:
        url = launcher.wait_for_url()
        threads = [threading.Thread(target=_stream, args=(url, out, i, started, counter, lock),
                                    daemon=True) for i in range(8)]
        for t in threads:
            t.start()
        assert started.wait(120), out
        os.killpg(launcher.proc.pid, signal.SIGINT)  # Ctrl-C in its terminal
        refused = None
        for _ in range(200):  # a new request while the 8 drain: refused, not served
            try:
                r = httpx.post(f"{url}/v1/completions", timeout=10, json={
                    "model": "tiny-llama", "prompt": "x", "max_tokens": 1})
            except httpx.HTTPError:
                break
            if r.status_code == 503:
                refused = r
                break
        for t in threads:
            t.join(60)
        assert launcher.proc.wait(timeout=120) == 0, "".join(launcher.output)
    finally:
        launcher.kill()
    assert refused is not None and refused.headers.get("retry-after"), "no 503 while draining"
    assert refused.json()["error"]["code"] == "server_shutting_down"
    for i, res in out.items():
        assert res["status"] == 200, res
        last = [e for e in res["events"] if e != "[DONE]"][-1]
        finished = last.get("choices") and last["choices"][0].get("finish_reason") == "length"
        ended = last.get("error", {}).get("message") == "server shutting down"
        assert finished or ended, (i, last)
        assert res["events"][-1] == "[DONE]", (i, res["events"][-3:])
    text = "".join(launcher.output)
    assert " 500 " not in text and "no healthy engine" not in text, text
    assert "request(s) in flight finished" in text, text  # the launcher drained first
    assert "Token authentication" not in text, text  # no Ray auth warning at start
    wait_until(lambda: not _session_pids(sid), 30, "every process serve started to exit")
    assert set(Path("/tmp").glob("pd-cluster-ray-*")) == before, "a Ray temp dir was left"
    assert not list(Path("/tmp/ray").glob(f"session_*_{sid}")), "a /tmp/ray session was made"
