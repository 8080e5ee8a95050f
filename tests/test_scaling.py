"""Engines that come and go, and switch roles, under load (issue 40, items 3 and 4).

One 1P1D cluster on Ray for the module: scaled up to 2P2D while streams run, a decode engine
switched to prefill and back while streams run, scaled down to 1P1D while streams run (the
drained engines' decodes move to the others). Every stream ends exactly as offline greedy
generation, and afterwards no engine holds a request, a KV block or a KV hold (staging bytes,
receives, send leases). Bad counts and switches are 400s naming the field, and one line
from the CLI.
"""
from __future__ import annotations

import asyncio
import subprocess
import sys
from typing import Any

import httpx
import pytest

from pd_cluster import LLM, SamplingParams
from pd_cluster.serving.cluster.cluster_config import resolve_model
from pd_cluster.serving.cluster.testing import REPO_ROOT, cluster_status, wait_idle, wait_until
from tests.launch_helpers import launched_cluster, stream_completion

MODEL = "tiny-llama"
pytestmark = pytest.mark.timeout(900)  # a Ray cluster's start-up counts in the first test
IDLE = {"kv_staging_bytes": 0, "kv_receiving": 0, "kv_send_holds": 0}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    yield from launched_cluster(tmp_path_factory, "local", "scale",
                                engine={"num_kv_blocks": 512, "max_model_len": 512},
                                kv_transfer={"kv_transfer_timeout": 5.0},
                                proxy={"request_timeout": 120.0, "health_check_timeout": 5.0,
                                       "disaggregation": "always"})


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM(model=resolve_model(MODEL), num_kv_blocks=512, max_model_len=512)


def _work(n: int, seed: int, max_tokens: int) -> list[tuple[list[int], int]]:
    return [([4 + (seed * 97 + i * 31 + j * 7) % 490 for j in range(8 + 9 * i)], max_tokens)
            for i in range(n)]


def _expected(offline: LLM, work: list[tuple[list[int], int]]) -> list[list[int]]:
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in work]
    return [list(o.outputs[0].token_ids) for o in offline.generate([p for p, _ in work], params)]


def _under_load(url: str, work: list[tuple[list[int], int]], path: str | None = None,
                body: Any = None) -> tuple[list[tuple[str, list[int], str | None]], Any]:
    """Every stream started (3 tokens in), then the admin call (``body``: or a function of
    the cluster's status then), then every stream's end."""
    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=300) as http:
            started = [asyncio.Event() for _ in work]
            tasks = [asyncio.create_task(stream_completion(http, MODEL, p, m, ev))
                     for (p, m), ev in zip(work, started)]
            await asyncio.wait_for(asyncio.gather(*(ev.wait() for ev in started)), 120)
            reply = None
            if path is not None:
                if callable(body):
                    body_now = body((await http.get("/cluster/status")).json())
                else:
                    body_now = body
                reply = await http.post(path, json=body_now)
            return await asyncio.wait_for(asyncio.gather(*tasks), 300), reply
    return asyncio.run(run())


def _check(cluster, results, expected) -> dict:
    for i, ((outcome, ids, err), ref) in enumerate(zip(results, expected)):
        assert outcome == "ok" and ids == ref, (i, outcome, err)
    st = wait_idle(cluster.url, timeout=60)
    assert all(e["state"] == "serving" and e["healthy"] for e in st["engines"]), st["engines"]
    _no_leaks(cluster.namespace, [e["name"] for e in st["engines"]])
    return st


def _no_leaks(namespace: str, names: list[str]) -> None:
    import ray
    handles = [ray.get_actor(n, namespace=namespace) for n in names]
    ray.get([h.check_no_leaks.remote() for h in handles], timeout=30)
    wait_until(lambda: all(h == IDLE for h in ray.get([h.kv_holds.remote() for h in handles],
                                                      timeout=30)),
               30, "no KV hold on any engine")


def _roles(st: dict) -> dict[str, str]:
    return {e["name"]: e["role"] for e in st["engines"]}


def _metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name))


def test_scale_up_under_load(cluster, offline) -> None:
    work = _work(8, seed=1, max_tokens=120)
    results, reply = _under_load(cluster.url, work, "/admin/scale", {"prefill": 2, "decode": 2})
    assert reply.status_code == 200, reply.text
    assert sorted(reply.json()["done"]) == ["added decode-1 (decode)", "added prefill-1 (prefill)"]
    st = _check(cluster, results, _expected(offline, work))
    assert _roles(st) == {"prefill-0": "prefill", "prefill-1": "prefill",
                          "decode-0": "decode", "decode-1": "decode"}
    # the new engines are linked and take traffic
    after = _work(12, seed=2, max_tokens=16)
    results, _ = _under_load(cluster.url, after)
    st = _check(cluster, results, _expected(offline, after))
    assert all(e["stats"]["requests_total"] > 0 for e in st["engines"]), st["engines"]


def test_role_switch_under_load(cluster, offline) -> None:
    wait_until(lambda: len(cluster_status(cluster.url)["engines"]) == 4, 60, "2P2D")
    moves = _metric(cluster.url, "pd_drain_moves_total")
    work = _work(8, seed=3, max_tokens=200)
    chosen: list[str] = []

    def busiest_decode(st: dict) -> dict:  # it has decodes in flight: they must move
        e = max((e for e in st["engines"] if e["role"] == "decode"), key=lambda e: e["inflight"])
        chosen.append(e["name"])
        return {"engine": e["name"], "role": "prefill"}
    results, reply = _under_load(cluster.url, work, "/admin/switch_role", busiest_decode)
    assert reply.status_code == 200, reply.text
    st = _check(cluster, results, _expected(offline, work))
    name = chosen[0]
    assert _roles(st)[name] == "prefill"
    assert _metric(cluster.url, "pd_drain_moves_total") > moves  # its decodes moved on
    pid = next(e["pid"] for e in st["engines"] if e["name"] == name)
    # and back, again under load; the same process all along (no reload)
    work = _work(8, seed=4, max_tokens=60)
    results, reply = _under_load(cluster.url, work, "/admin/switch_role",
                                 {"engine": name, "role": "decode"})
    assert reply.status_code == 200, reply.text
    st = _check(cluster, results, _expected(offline, work))
    assert _roles(st)[name] == "decode"
    assert next(e["pid"] for e in st["engines"] if e["name"] == name) == pid
    assert all(e["kv_peers"] == 2 for e in st["engines"] if e["role"] == "prefill")


def test_scale_down_under_load(cluster, offline) -> None:
    moves = _metric(cluster.url, "pd_drain_moves_total")
    work = _work(8, seed=5, max_tokens=200)
    results, reply = _under_load(cluster.url, work, "/admin/scale", {"prefill": 1, "decode": 1})
    assert reply.status_code == 200, reply.text
    st = _check(cluster, results, _expected(offline, work))
    assert sorted(e["role"] for e in st["engines"]) == ["decode", "prefill"]
    assert _metric(cluster.url, "pd_drain_moves_total") > moves


@pytest.mark.parametrize("path, body, param", [
    ("/admin/scale", {"decode": 0}, "decode"),
    ("/admin/scale", {"prefill": -1}, "prefill"),
    ("/admin/scale", {"colocated": 2}, "colocated"),
    ("/admin/scale", {"decodes": 2}, "decodes"),
    ("/admin/switch_role", {"engine": "nope-9", "role": "prefill"}, "engine"),
    ("/admin/switch_role", {"engine": "decode-0", "role": "sideways"}, "role"),
])
def test_bad_input_is_a_400_naming_the_field(cluster, path, body, param) -> None:
    reply = httpx.post(f"{cluster.url}{path}", json=body, timeout=30)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


def test_cli_bad_count_is_one_line(cluster) -> None:
    out = subprocess.run([sys.executable, "-m", "pd_cluster.cli", "scale", "--url", cluster.url,
                          "--decode", "0"], cwd=REPO_ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: decode: at least 1"), out.stderr
