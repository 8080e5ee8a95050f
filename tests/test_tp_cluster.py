"""A Ray cluster with a TP2 prefill engine feeding two TP1 decode engines (CPU, Gloo, KV over
ZMQ), launched from the cluster config: outputs equal the colocated TP1 engine, decode
received KV with no fallback, `status` shows the ranks; then the prefill engine's worker is
SIGKILLed under load: no request is lost, the engine comes back as a whole, nothing leaks."""
from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import subprocess
import sys

import httpx
import pytest

from pd_cluster import LLM, SamplingParams
from pd_cluster.serving.cluster.cluster_config import resolve_model
from pd_cluster.serving.cluster.testing import (cluster_status, leak_reports, wait_idle,
                                                wait_until)
from tests.launch_helpers import launched_cluster


# a TP2 cluster's start-up and a whole-engine restart, on Ray
pytestmark = pytest.mark.timeout(1200)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    yield from launched_cluster(tmp_path_factory, "local", "tp",
                                # half a CPU a rank: Ray's 4 CPUs hold a second TP2 prefill
                                # engine when the scaling test adds one
                                prefill={"tensor_parallel_size": 2, "num_cpus": 0.5},
                                decode={"replicas": 2, "num_cpus": 1},
                                engine={"num_kv_blocks": 256, "max_model_len": 512,
                                        "collective_timeout": 10.0},
                                kv_transfer={"kv_transfer_timeout": 5.0},
                                # always through P: the KV must cross from P's two ranks
                                proxy={"request_timeout": 60.0, "health_check_timeout": 5.0,
                                       "disaggregation": "always"})


def work(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 500) for _ in range(rng.randrange(4, 80))] for _ in range(n)]


async def _complete(http: httpx.AsyncClient, prompt: list[int], max_tokens: int) -> list[int]:
    r = await http.post("/v1/completions", json={
        "model": "tiny-llama", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return list(choice.get("token_ids") or [])


def _run(url: str, prompts: list[list[int]], max_tokens: int, during=None) -> list[list[int]]:
    async def go() -> list[list[int]]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            tasks = [asyncio.create_task(_complete(http, p, max_tokens)) for p in prompts]
            if during is not None:  # under load: once the proxy has requests in flight
                deadline = asyncio.get_running_loop().time() + 60
                while not (await http.get("/cluster/status")).json()["inflight"]:
                    assert asyncio.get_running_loop().time() < deadline, "nothing in flight"
                    await asyncio.sleep(0.05)
                during()
            return await asyncio.gather(*tasks)
    return asyncio.run(go())


async def _admin_under_load(url: str, prompts: list[list[int]], max_tokens: int, path: str,
                            body: dict) -> tuple[httpx.Response, list[list[int]]]:
    """POST ``body`` to the admin ``path`` once the proxy has requests of ``prompts`` in
    flight; the reply and every request's output tokens."""
    async with httpx.AsyncClient(base_url=url, timeout=300) as http:
        tasks = [asyncio.create_task(_complete(http, p, max_tokens)) for p in prompts]
        deadline = asyncio.get_running_loop().time() + 60
        while not (await http.get("/cluster/status")).json()["inflight"]:
            assert asyncio.get_running_loop().time() < deadline, "nothing in flight"
            await asyncio.sleep(0.05)
        reply = await http.post(path, json=body)
        return reply, await asyncio.gather(*tasks)


def test_tp2_prefill_to_tp1_decode_and_a_killed_worker(cluster) -> None:
    offline = LLM(model=resolve_model("tiny-llama"), num_kv_blocks=512, max_model_len=512)
    prompts = work(12, seed=1)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in offline.generate(prompts, params)]
    got = _run(cluster.url, prompts, 24)
    assert got == want
    st = wait_idle(cluster.url)
    engines = {e["name"]: e for e in st["engines"]}
    assert engines["prefill-0"]["stats"]["tensor_parallel_size"] == 2
    pids = engines["prefill-0"]["stats"]["tp_pids"].split(",")
    assert len(pids) == 2 and pids[0] == str(engines["prefill-0"]["pid"])
    assert sum(engines[d]["stats"]["kv_bytes_received"] for d in ("decode-0", "decode-1")) > 0
    assert all(engines[d]["stats"]["kv_fallbacks"] == 0 for d in ("decode-0", "decode-1"))
    status = subprocess.run([sys.executable, "-m", "pd_cluster.cli", "status", "--url",
                             cluster.url], capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stderr
    assert re.search(rf"prefill-0\s.*\s2 \(pids {pids[0]},{pids[1]}\)", status.stdout), \
        status.stdout

    worker = int(pids[1])
    more = work(16, seed=2)
    want = [o.outputs[0].token_ids for o in offline.generate(more, params)]
    got = _run(cluster.url, more, 24, during=lambda: os.kill(worker, signal.SIGKILL))
    assert got == want  # no request lost: retried, migrated or served whole by decode

    def back() -> bool:
        p = next(e for e in cluster_status(cluster.url)["engines"] if e["name"] == "prefill-0")
        return (p["healthy"] and p["restarts"] >= 1
                and str(worker) not in p["stats"].get("tp_pids", ""))
    wait_until(back, 300, "prefill-0 restarted with fresh ranks", interval=0.5)
    assert _run(cluster.url, prompts[:4], 24) == [o.outputs[0].token_ids for o in
                                                  offline.generate(prompts[:4], params)]
    wait_idle(cluster.url, timeout=60)
    assert leak_reports(cluster) == {}


def test_the_tp2_engine_switches_role_under_load(cluster) -> None:
    """Issue 40: decode-1 turns prefill (so the TP2 prefill-0 is not the last prefill engine),
    then prefill-0 turns decode while requests run, and everything turns back: outputs equal
    offline, the TP2 engine keeps its ranks (no reload) and advertises one KV endpoint per
    rank as a consumer, and nothing is held after."""
    import ray
    offline = LLM(model=resolve_model("tiny-llama"), num_kv_blocks=512, max_model_len=512)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    wait_until(lambda: all(e["healthy"] and e["state"] == "serving"
                           for e in cluster_status(cluster.url)["engines"]), 300, "all serving")
    before = {e["name"]: e for e in cluster_status(cluster.url)["engines"]}

    def switch(engine: str, role: str) -> None:
        r = httpx.post(f"{cluster.url}/admin/switch_role", json={"engine": engine, "role": role},
                       timeout=300)
        assert r.status_code == 200, r.text

    switch("decode-1", "prefill")
    prompts = work(8, seed=3)
    reply, got = asyncio.run(_admin_under_load(cluster.url, prompts, 48, "/admin/switch_role",
                                               {"engine": "prefill-0", "role": "decode"}))
    assert reply.status_code == 200, reply.text
    assert got == [o.outputs[0].token_ids for o in offline.generate(prompts, params)]
    st = {e["name"]: e for e in wait_idle(cluster.url, timeout=60)["engines"]}
    assert st["prefill-0"]["role"] == "decode"
    assert st["prefill-0"]["stats"]["tp_pids"] == before["prefill-0"]["stats"]["tp_pids"]
    assert len(st["prefill-0"]["kv_endpoint"].split("|")) == 2
    more = work(6, seed=4)  # through the TP2 engine as a decode engine now
    assert _run(cluster.url, more, 48) == [o.outputs[0].token_ids
                                           for o in offline.generate(more, params)]
    switch("prefill-0", "prefill")
    switch("decode-1", "decode")
    assert _run(cluster.url, more, 48) == [o.outputs[0].token_ids
                                           for o in offline.generate(more, params)]
    wait_idle(cluster.url, timeout=60)
    assert leak_reports(cluster) == {}
    holds = ray.get([h.kv_holds.remote() for h in cluster.engines.values()], timeout=30)
    assert all(not any(h.values()) for h in holds), holds



def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _no_leaks(namespace: str, names: list[str]) -> None:
    """Every named engine (the ones scaling added too) holds no KV block and no KV hold."""
    import ray
    handles = [ray.get_actor(n, namespace=namespace) for n in names]
    ray.get([h.check_no_leaks.remote() for h in handles], timeout=30)
    holds = ray.get([h.kv_holds.remote() for h in handles], timeout=30)
    assert all(not any(h.values()) for h in holds), holds


def test_tp2_engines_come_and_go_under_load(cluster) -> None:
    """Issue 40: a second TP2 prefill engine is added while requests run, then one TP2
    prefill engine is drained and removed while requests run: outputs equal offline, the new
    engine has two ranks, a third finds no room (an error, not a wait), the removed engine's
    ranks exit, and nothing is held after."""
    offline = LLM(model=resolve_model("tiny-llama"), num_kv_blocks=512, max_model_len=512)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    wait_until(lambda: all(e["healthy"] and e["state"] == "serving"
                           for e in cluster_status(cluster.url)["engines"]), 300, "all serving")

    prompts = work(8, seed=5)
    reply, got = asyncio.run(_admin_under_load(cluster.url, prompts, 32, "/admin/scale",
                                               {"prefill": 2}))
    assert reply.status_code == 200, reply.text
    assert got == [o.outputs[0].token_ids for o in offline.generate(prompts, params)]
    st = {e["name"]: e for e in wait_idle(cluster.url, timeout=60)["engines"]}
    prefills = {n: e for n, e in st.items() if e["role"] == "prefill"}
    assert len(prefills) == 2, list(st)
    new = next(e for n, e in prefills.items() if n != "prefill-0")
    assert new["stats"]["tensor_parallel_size"] == 2
    assert len(new["stats"]["tp_pids"].split(",")) == 2
    # no room for a third TP2 engine on this Ray (4 CPUs, no autoscaler): a clear error
    r = httpx.post(f"{cluster.url}/admin/scale", json={"prefill": 3}, timeout=60)
    assert r.status_code >= 400 and "no room" in r.json()["error"]["message"], r.text
    more = work(8, seed=6)
    assert _run(cluster.url, more, 32) == [o.outputs[0].token_ids
                                           for o in offline.generate(more, params)]

    reply, got = asyncio.run(_admin_under_load(cluster.url, more, 32, "/admin/scale",
                                               {"prefill": 1}))
    assert reply.status_code == 200, reply.text
    assert got == [o.outputs[0].token_ids for o in offline.generate(more, params)]
    after = {e["name"]: e for e in wait_idle(cluster.url, timeout=60)["engines"]}
    left = [n for n, e in after.items() if e["role"] == "prefill"]
    assert len(left) == 1, list(after)
    removed = next(e for n, e in prefills.items() if n not in left)
    pids = [int(p) for p in removed["stats"]["tp_pids"].split(",")]
    wait_until(lambda: not any(_alive(p) for p in pids), 60, "the removed engine's ranks exit")
    assert _run(cluster.url, prompts[:4], 32) == [o.outputs[0].token_ids for o in
                                                  offline.generate(prompts[:4], params)]
    wait_idle(cluster.url, timeout=60)
    _no_leaks(cluster.namespace, list(after))
