"""xPyD on Ray: a 2P2D cluster under concurrent load, and a decode actor killed mid-run."""
from __future__ import annotations

import asyncio
import os
import random
import signal

import httpx
import openai
import pytest

from pd_cluster import LLM, SamplingParams
from pd_cluster.serving.cluster.cluster_config import resolve_model
from pd_cluster.serving.cluster.testing import (cluster_status, leak_reports, wait_idle,
                                                wait_until)
from tests.launch_helpers import launched_cluster, stream_completion

MODEL = "tiny-llama"


pytestmark = pytest.mark.timeout(900)  # a Ray cluster's start-up counts in the first test


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    yield from launched_cluster(tmp_path_factory, "local-2p2d", "2p2d",
                                engine={"num_kv_blocks": 512, "max_model_len": 1024},
                                kv_transfer={"kv_transfer_timeout": 5.0},
                                # always through P: these tests are about P/D across 4 engines
                                proxy={"request_timeout": 60.0, "health_check_timeout": 5.0,
                                       "disaggregation": "always"})


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM(model=resolve_model(MODEL), num_kv_blocks=1024, max_model_len=1024)


def workload(n: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(4, 500) for _ in range(rng.randrange(4, 120))], rng.randrange(8, 40))
            for _ in range(n)]


def references(offline: LLM, work: list[tuple[list[int], int]]) -> list[list[int]]:
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in work]
    return [list(o.outputs[0].token_ids) for o in offline.generate([p for p, _ in work], params)]


def test_32_concurrent_requests_use_all_engines(cluster, offline) -> None:
    work = workload(32, seed=1)
    expected = references(offline, work)
    client = openai.AsyncOpenAI(base_url=f"{cluster.url}/v1", api_key="x", max_retries=0,
                                timeout=60)

    async def one(i: int) -> list[int]:
        prompt, max_tokens = work[i]
        kw = dict(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                  extra_body={"ignore_eos": True, "return_token_ids": True})
        if i % 2:  # half streamed, half not
            ids: list[int] = []
            async for chunk in await client.completions.create(stream=True, **kw):
                ids.extend(chunk.choices[0].token_ids)  # type: ignore[attr-defined]
            return ids
        r = await client.completions.create(**kw)
        return r.choices[0].token_ids  # type: ignore[attr-defined]

    async def run() -> list[list[int]]:
        try:
            return await asyncio.gather(*(one(i) for i in range(len(work))))
        finally:
            await client.close()

    got = asyncio.run(run())
    for i, (ids, ref) in enumerate(zip(got, expected)):
        assert ids == ref, f"request {i} differs"
    st = wait_idle(cluster.url)
    used = {e["name"]: e["stats"]["requests_total"] for e in st["engines"]}
    assert set(used) == {"prefill-0", "prefill-1", "decode-0", "decode-1"}
    assert all(n > 0 for n in used.values()), used
    assert sum(used[d] for d in ("decode-0", "decode-1")) == 32
    assert leak_reports(cluster) == {}


def test_decode_killed_mid_run_loses_nothing(cluster, offline) -> None:
    """24 streams (half greedy, half seeded); decode-0's process is SIGKILLed while they run:
    its requests move to decode-1 mid-stream and every one ends exactly as an unbroken run."""
    work = [(p, 120) for p, _ in workload(24, seed=2)]
    seeds = [None if i % 2 else 1000 + i for i in range(len(work))]
    params = [SamplingParams(temperature=0.0 if s is None else 0.8, seed=s, max_tokens=m,
                             ignore_eos=True) for (_, m), s in zip(work, seeds)]
    expected = [list(o.outputs[0].token_ids)
                for o in offline.generate([p for p, _ in work], params)]
    old_pid = next(e["pid"] for e in cluster_status(cluster.url)["engines"]
                   if e["name"] == "decode-0")
    migrations_before = _metric(cluster.url, "pd_migrations_total")

    async def run() -> list[tuple[str, list[int], str | None]]:
        async with httpx.AsyncClient(base_url=cluster.url, timeout=90) as http:
            events = [asyncio.Event() for _ in work]
            tasks = [asyncio.create_task(stream_completion(http, MODEL, p, m, ev, seed))
                     for (p, m), ev, seed in zip(work, events, seeds)]
            await asyncio.wait_for(asyncio.gather(*(ev.wait() for ev in events)), 60)
            os.kill(old_pid, signal.SIGKILL)  # Ray restarts it (max_restarts)
            return await asyncio.wait_for(asyncio.gather(*tasks), 120)

    results = asyncio.run(run())
    for i, ((outcome, ids, err), ref) in enumerate(zip(results, expected)):
        assert outcome == "ok" and ids == ref, (i, outcome, err)
    assert _metric(cluster.url, "pd_migrations_total") > migrations_before

    def restarted() -> bool:
        d0 = next(e for e in cluster_status(cluster.url)["engines"] if e["name"] == "decode-0")
        return d0["healthy"] and d0["pid"] != old_pid and d0["restarts"] >= 1
    wait_until(restarted, 120, "decode-0 restarted by Ray and healthy again", interval=0.5)

    async def after() -> list[tuple[str, list[int], str | None]]:
        async with httpx.AsyncClient(base_url=cluster.url, timeout=60) as http:
            return await asyncio.gather(*(stream_completion(http, MODEL, p, 24) for p, _ in work))

    ref_after = references(offline, [(p, 24) for p, _ in work])
    for (outcome, ids, err), ref in zip(asyncio.run(after()), ref_after):
        assert outcome == "ok" and ids == ref, (outcome, err)
    st = wait_idle(cluster.url, timeout=60)  # P's blocks for the dead D free after the timeout
    d0 = next(e for e in st["engines"] if e["name"] == "decode-0")
    assert d0["stats"]["requests_total"] > 0  # the restarted engine takes traffic again
    assert all(e["stats"]["kv_blocks_used"] == 0 for e in st["engines"])
    assert leak_reports(cluster) == {}



def test_prefill_killed_mid_run_loses_nothing(cluster, offline) -> None:
    """prefill-0's process is SIGKILLed while 24 streams are being prefilled: requests it had
    not answered go to prefill-1; decode engines waiting for its KV recompute the prompt."""
    wait_until(lambda: all(e["healthy"] and e["kv_peers"] == 2 for e in
                           cluster_status(cluster.url)["engines"] if e["role"] == "prefill"),
               120, "both prefill engines healthy and linked", interval=0.5)
    work = [([4 + (i * 13 + j * 7) % 490 for j in range(120 + 5 * i)], 16) for i in range(24)]
    expected = references(offline, work)
    pid = next(e["pid"] for e in cluster_status(cluster.url)["engines"]
               if e["name"] == "prefill-0")

    async def run() -> list[tuple[str, list[int], str | None]]:
        async with httpx.AsyncClient(base_url=cluster.url, timeout=90) as http:
            first = asyncio.Event()
            tasks = [asyncio.create_task(stream_completion(http, MODEL, p, m, first))
                     for p, m in work]
            await asyncio.wait_for(first.wait(), 60)  # prefill is under way
            os.kill(pid, signal.SIGKILL)
            return await asyncio.wait_for(asyncio.gather(*tasks), 120)

    for i, ((outcome, ids, err), ref) in enumerate(zip(asyncio.run(run()), expected)):
        assert outcome == "ok" and ids == ref, (i, outcome, err)
    wait_until(lambda: all(e["healthy"] and (e["name"] != "prefill-0" or e["pid"] != pid)
                           for e in cluster_status(cluster.url)["engines"]), 120,
               "prefill-0 restarted by Ray and healthy again", interval=0.5)
    wait_idle(cluster.url, timeout=60)
    assert leak_reports(cluster) == {}


def test_clients_disconnecting_mid_stream_leave_nothing_held(cluster) -> None:
    """20 clients read a few tokens and hang up: every engine aborts the request and frees its
    blocks (P's included) within a bound."""
    wait_until(lambda: all(e["healthy"] for e in cluster_status(cluster.url)["engines"]), 120,
               "all engines healthy", interval=0.5)

    async def hang_up(http: httpx.AsyncClient, prompt: list[int]) -> int:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 400, "temperature": 0,
                "ignore_eos": True, "stream": True}
        chunks = 0
        async with http.stream("POST", "/v1/completions", json=body) as resp:
            async for line in resp.aiter_lines():
                chunks += line.startswith("data: {")
                if chunks >= 3:
                    break  # leaving the block closes the connection mid-stream
        return chunks

    async def run() -> list[int]:
        async with httpx.AsyncClient(base_url=cluster.url, timeout=60) as http:
            return await asyncio.gather(*(hang_up(http, p) for p, _ in workload(20, seed=7)))

    assert all(n >= 3 for n in asyncio.run(run()))
    st = wait_idle(cluster.url, timeout=30)
    assert all(e["stats"]["kv_blocks_used"] == 0 and not e["stats"]["num_active"]
               for e in st["engines"])
    assert leak_reports(cluster) == {}


def _metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name))
