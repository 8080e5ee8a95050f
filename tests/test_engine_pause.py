"""An engine paused (SIGSTOP) longer than the proxy's health timeout never turns into a crash:
the proxy routes around it meanwhile (the other role serves whole requests), its control calls
time out and are dropped, and once resumed it serves again as the same process, healthy, with
every output exact and nothing held."""
from __future__ import annotations

import asyncio
import os
import signal

import httpx
import pytest

from pd_cluster.serving.cluster.testing import (cluster_status, leak_reports, wait_idle,
                                                wait_until)
from tests.launch_helpers import launched_cluster

MODEL = "tiny-llama"
PROMPTS = ["Once upon a time", "The little dog", "A red ball", "In the park"]
# Health: checked every 0.3 s, 1 s to answer, 2 failures: a pause of a few seconds is "long".
PROXY = {"health_check_interval": 0.3, "health_check_timeout": 1.0, "unhealthy_threshold": 2,
         "request_timeout": 60.0}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    yield from launched_cluster(tmp_path_factory, "local", "pause",
                                engine={"num_kv_blocks": 256, "max_model_len": 512},
                                kv_transfer={"kv_transfer_timeout": 2.0}, proxy=PROXY)


def _engine(url: str, name: str) -> dict:
    return next(e for e in cluster_status(url)["engines"] if e["name"] == name)


async def _completions(url: str, stream: bool, max_tokens: int = 48) -> list[str]:
    async def one(http: httpx.AsyncClient, prompt: str) -> str:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": stream}
        if not stream:
            r = await http.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]
        text = ""
        async with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    import json
                    chunk = json.loads(line[6:])
                    assert "error" not in chunk, chunk
                    text += chunk["choices"][0]["text"]
        return text
    async with httpx.AsyncClient(base_url=url, timeout=90) as http:
        return await asyncio.gather(*(one(http, p) for p in PROMPTS))


def _pause(pid: int, url: str, name: str) -> None:
    os.kill(pid, signal.SIGSTOP)
    try:
        wait_until(lambda: not _engine(url, name)["healthy"], 30, f"{name} marked unhealthy")
    except BaseException:
        os.kill(pid, signal.SIGCONT)
        raise


@pytest.mark.timeout(900)  # the module's Ray cluster starts in this test's set-up
@pytest.mark.parametrize("name", ["prefill-0", "decode-0"])
def test_a_paused_engine_resumes_as_itself_and_every_output_is_exact(cluster, name) -> None:
    url = cluster.url
    wait_idle(url, timeout=60)
    reference = asyncio.run(_completions(url, stream=False))
    pid = _engine(url, name)["pid"]
    restarts = _engine(url, name).get("restarts", 0)

    async def during_the_pause() -> list[str]:
        streams = asyncio.create_task(_completions(url, stream=True, max_tokens=48))
        await asyncio.sleep(0.2)  # some are mid-stream when the engine stops
        await asyncio.to_thread(_pause, pid, url, name)
        try:
            more = await _completions(url, stream=False)  # served around the paused engine
        finally:
            os.kill(pid, signal.SIGCONT)
        return [*await asyncio.wait_for(streams, 120), *more]

    outputs = asyncio.run(during_the_pause())
    assert outputs == reference + reference
    wait_until(lambda: _engine(url, name)["healthy"], 60, f"{name} healthy again")
    again = _engine(url, name)
    assert again["pid"] == pid and again.get("restarts", 0) == restarts, again  # not restarted
    assert asyncio.run(_completions(url, stream=True)) == reference
    wait_idle(url, timeout=60)
    assert leak_reports(cluster) == {}
