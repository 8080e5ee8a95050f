"""Two machines (network namespaces), one cluster: prefill engines on one node, decode engines
on the other, from a config with no address in it, launched with `pd-cluster launch`.

Checks: outputs equal the colocated engine, KV crosses nodes (bytes received by both decode
engines, no fallback), the proxy serves on the launch node, `status` shows both nodes; when
the decode node dies requests keep succeeding (prefill engines serve them whole); when it
rejoins, P/D is used again; no KV block is left anywhere.
"""
from __future__ import annotations

import asyncio
import os
import random
import signal
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from connectors.pipes.base import PipeError
from connectors.pipes.nixl_pipe import load_nixl
from pd_cluster import LLM, SamplingParams
from pd_cluster.serving.cluster.cluster_config import resolve_model
from pd_cluster.serving.cluster.testing import wait_until
from tests.launch_helpers import Launcher, _cli, _env
from tests.two_nodes import HEAD_LABEL, WORKER_LABEL, TwoNodes, why_unavailable

MODEL = "tiny-llama"
_SKIP = why_unavailable()
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900),  # two Ray nodes in namespaces
              pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")]


def _config(tmp: Path, namespace: str, replicas: int = 2, pipe: str = "zmq") -> Path:
    (key, head), (_, worker) = next(iter(HEAD_LABEL.items())), next(iter(WORKER_LABEL.items()))
    cfg = {"mode": "disaggregated", "model": MODEL,
           "prefill": {"replicas": replicas, "num_cpus": 1, "node_labels": {key: head},
                       "strategy": "spread"},
           "decode": {"replicas": replicas, "num_cpus": 1, "node_labels": {key: worker},
                      "strategy": "pack", "max_restarts": -1},
           "engine": {"device": "cpu", "dtype": "float32", "num_kv_blocks": 512,
                      "max_model_len": 1024},
           "kv_transfer": {"kv_transfer_timeout": 10.0, "pipe": pipe},  # no address anywhere
           # always through P: the test is that KV crosses between the nodes
           "proxy": {"host": "127.0.0.1", "port": 0, "health_check_interval": 0.5,
                     "health_check_timeout": 3.0, "request_timeout": 90.0,
                     "disaggregation": "always"},
           "ray": {"namespace": namespace}}
    path = tmp / "two-node.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture(scope="module")
def nodes() -> Iterator[TwoNodes]:
    """The module's two nodes, started and stopped once: each test launches its own cluster
    on them, in its own namespace (ci8: 62 s and 50 s, each with its own two nodes)."""
    with TwoNodes() as two:
        yield two


def _nixl_unavailable() -> str | None:
    try:
        load_nixl()
    except PipeError as e:
        return str(e)
    return None


def _workload(n: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(4, 500) for _ in range(rng.randrange(8, 200))], rng.randrange(8, 32))
            for _ in range(n)]


def _send(url: str, work: list[tuple[list[int], int]]) -> tuple[list[list[int]], list[float]]:
    """All requests at once (half streamed); token ids and latency of each."""
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=90)

    async def one(i: int) -> tuple[list[int], float]:
        prompt, max_tokens = work[i]
        kw = dict(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                  extra_body={"ignore_eos": True, "return_token_ids": True})
        t0 = time.monotonic()
        if i % 2:
            ids: list[int] = []
            async for chunk in await client.completions.create(stream=True, **kw):
                ids.extend(chunk.choices[0].token_ids)  # type: ignore[attr-defined]
            return ids, time.monotonic() - t0
        r = await client.completions.create(**kw)
        return r.choices[0].token_ids, time.monotonic() - t0  # type: ignore[attr-defined]

    async def run() -> list[tuple[list[int], float]]:
        try:
            return await asyncio.gather(*(one(i) for i in range(len(work))))
        finally:
            await client.close()
    out = asyncio.run(run())
    return [ids for ids, _ in out], [t for _, t in out]


def _status(url: str) -> dict:
    return httpx.get(f"{url}/cluster/status", timeout=30).json()


def _engines(url: str, role: str) -> list[dict]:
    return [e for e in _status(url)["engines"] if e["role"] == role]


def _metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name))


def _idle_and_leak_free(url: str) -> bool:
    st = _status(url)
    return not st["inflight"] and all(
        e["healthy"] and not e["stats"].get("num_active") and not e["stats"].get("kv_blocks_used")
        for e in st["engines"])


def test_two_nodes_prefill_here_decode_there(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             nodes: TwoNodes) -> None:
    path = resolve_model(MODEL)  # made once here; both "machines" share this disk
    offline = LLM(model=path, num_kv_blocks=1024, max_model_len=1024)

    def expected(work: list[tuple[list[int], int]]) -> list[list[int]]:
        params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in work]
        return [list(o.outputs[0].token_ids)
                for o in offline.generate([p for p, _ in work], params)]

    ns = f"two-node-{os.getpid()}"
    env = {**_env(tmp_path, monkeypatch), **nodes.client_env}
    launcher = Launcher(["launch", "--config", str(_config(tmp_path, ns)), "--address",
                         nodes.address, "--no-progress"], env)
    url = ""
    try:
        url = launcher.wait_for_url(timeout=300)
        st = _status(url)
        assert st["proxy"]["node_ip"] == nodes.head_ip  # served where `launch` ran
        nodes_of = {e["name"]: e["node_ip"] for e in st["engines"]}
        assert nodes_of == {"prefill-0": nodes.head_ip, "prefill-1": nodes.head_ip,
                            "decode-0": nodes.worker_ip, "decode-1": nodes.worker_ip}
        assert all(e["kv_peers"] == 2 for e in _engines(url, "prefill"))  # linked at launch
        assert all(e["kv_endpoint"].startswith(f"tcp://{nodes.worker_ip}:")
                   for e in _engines(url, "decode"))
        shown = _cli(["status", "--namespace", ns], env)
        assert shown.returncode == 0, shown.stderr
        assert nodes.head_ip in shown.stdout and nodes.worker_ip in shown.stdout
        print("\n" + shown.stdout)

        # 1. P/D across the nodes.
        work = _workload(16, seed=3)
        got, latencies = _send(url, work)
        assert got == expected(work)
        decodes = _engines(url, "decode")
        assert all(e["stats"]["kv_bytes_received"] > 0 for e in decodes)
        assert sum(e["stats"]["kv_fallbacks"] for e in decodes) == 0
        kv_bytes = sum(e["stats"]["kv_bytes_received"] for e in decodes)
        print(f"\ntwo-node P/D: 16 requests, latency p50 {statistics.median(latencies):.3f}s "
              f"max {max(latencies):.3f}s, KV bytes received {kv_bytes}, fallbacks 0")
        wait_until(lambda: _idle_and_leak_free(url), 30, "no KV block held")

        # 2. The decode node dies: prefill engines serve whole requests.
        nodes.kill_worker()
        wait_until(lambda: not any(e["healthy"] for e in _engines(url, "decode")), 60,
                   "the proxy to see the decode engines gone")
        degraded_before = _metric(url, 'pd_degraded_requests_total{reason="no_decode"}')
        work = _workload(6, seed=4)
        got, _ = _send(url, work)
        assert got == expected(work)
        assert _metric(url, 'pd_degraded_requests_total{reason="no_decode"}') \
            >= degraded_before + 6

        # 3. The node rejoins: Ray restarts the decode engines there, P/D resumes.
        nodes.start_worker()
        wait_until(lambda: all(e["healthy"] for e in _engines(url, "decode"))
                   and all(e["kv_peers"] == 2 for e in _engines(url, "prefill")), 180,
                   "decode engines back and linked")
        before = {e["name"]: e["stats"]["kv_bytes_received"] for e in _engines(url, "decode")}
        work = _workload(8, seed=5)
        got, _ = _send(url, work)
        assert got == expected(work)
        decodes = _engines(url, "decode")
        assert sum(e["stats"]["kv_bytes_received"] - before[e["name"]] for e in decodes) > 0
        assert sum(e["stats"]["kv_fallbacks"] for e in decodes) == 0
        wait_until(lambda: _idle_and_leak_free(url), 30, "no KV block held")

        os.killpg(launcher.proc.pid, signal.SIGINT)
        assert launcher.proc.wait(timeout=60) == 0, "".join(launcher.output)
    except BaseException:
        print("".join(launcher.output)[-5000:], "\n", nodes.logs())
        try:
            print("status at failure:", _status(url))
        except Exception as e:  # noqa: BLE001 - diagnostics only
            print("no status:", e)
        raise
    finally:
        launcher.kill()


@pytest.mark.skipif(_nixl_unavailable() is not None, reason=_nixl_unavailable() or "")
def test_two_nodes_over_nixl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                             nodes: TwoNodes) -> None:
    """The nixl pipe between two nodes: P on the head writes into D's cache on the worker
    (NIXL/UCX over the veth pair), outputs equal the colocated engine, no block left."""
    path = resolve_model(MODEL)
    offline = LLM(model=path, num_kv_blocks=1024, max_model_len=1024)
    work = _workload(8, seed=6)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in work]
    expected = [list(o.outputs[0].token_ids)
                for o in offline.generate([p for p, _ in work], params)]
    ns = f"two-node-nixl-{os.getpid()}"
    if nodes.worker is None or nodes.worker.poll() is not None:
        nodes.start_worker()  # the test before failed while its worker node was down
    env = {**_env(tmp_path, monkeypatch), **nodes.client_env}
    launcher = Launcher(["launch", "--config", str(_config(tmp_path, ns, 1, "nixl")),
                         "--address", nodes.address, "--no-progress"], env)
    url = ""
    try:
        url = launcher.wait_for_url(timeout=300)
        nodes_of = {e["name"]: e["node_ip"] for e in _status(url)["engines"]}
        assert nodes_of == {"prefill-0": nodes.head_ip, "decode-0": nodes.worker_ip}
        got, _ = _send(url, work)
        assert got == expected
        (decode,) = _engines(url, "decode")
        assert decode["stats"]["kv_pipe"] == "nixl"
        assert decode["stats"]["kv_bytes_received"] > 0
        assert decode["stats"]["kv_fallbacks"] == 0
        text = httpx.get(f"{url}/metrics", timeout=30).text
        assert any(line.startswith("pd_engine_kv_bytes_received") and 'pipe="nixl"' in line
                   and float(line.rsplit(" ", 1)[1]) > 0 for line in text.splitlines())
        wait_until(lambda: _idle_and_leak_free(url), 30, "no KV block held")
        os.killpg(launcher.proc.pid, signal.SIGINT)
        assert launcher.proc.wait(timeout=60) == 0, "".join(launcher.output)
    except BaseException:
        print("".join(launcher.output)[-5000:], "\n", nodes.logs())
        raise
    finally:
        launcher.kill()
