"""Helpers for serving tests and benchmarks: one shared local Ray, small clusters, polling."""
from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from pd_cluster.serving.cluster.cluster_config import ClusterConfig, load_config

if TYPE_CHECKING:
    import httpx

REPO_ROOT = Path(__file__).resolve().parents[3]
CONFIGS = REPO_ROOT / "configs"


def ensure_ray(num_cpus: int = 4) -> None:
    """Start (once per process) a local Ray big enough for a 2P2D test cluster."""
    import ray

    from pd_cluster.serving.cluster.ray_runtime import serving_priority
    if ray.is_initialized():
        return
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by the Ray workers
    # the workers at our priority, as a launch runs them (Ray's default renices them by 15:
    # an engine measured against an un-niced client or server would lose every core it shares)
    serving_priority()
    from connectors.secret import has_secret, install, new_secret
    if not has_secret():  # actors made outside launch() (fakes, benchmarks) inherit it
        install(new_secret())
    pythonpath = os.environ.get("PYTHONPATH", "")
    if str(REPO_ROOT) not in pythonpath.split(os.pathsep):  # workers import pd_cluster too
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), pythonpath) if p)
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
             namespace="pd-cluster-tests")


def local_config(name: str, namespace: str, **sections: dict[str, Any]) -> ClusterConfig:
    """configs/<name>.yaml on a free port, in ``namespace``, with section overrides."""
    overrides: dict[str, Any] = {"proxy": {"port": 0, "health_check_interval": 0.5},
                                 "ray": {"namespace": namespace}}
    for key, value in sections.items():
        overrides[key] = {**overrides.get(key, {}), **value}
    return load_config(CONFIGS / f"{name}.yaml", overrides)


def wait_until(pred: Callable[[], Any], timeout: float, what: str, interval: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = pred()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})")


def cluster_status(url: str) -> dict[str, Any]:
    import httpx
    return httpx.get(f"{url}/cluster/status", timeout=30.0).json()


def wait_idle(url: str, timeout: float = 30.0) -> dict[str, Any]:
    """Poll until no request is in flight and every engine holds no request and no KV block."""
    def idle() -> dict[str, Any] | None:
        st = cluster_status(url)
        busy = st["inflight"] or any(
            e["inflight"] or e["stats"].get("num_active") or e["stats"].get("kv_blocks_used")
            for e in st["engines"])
        return None if busy else st
    return wait_until(idle, timeout, "an idle cluster with all KV blocks free")


def leak_reports(cluster: Any, timeout: float = 30.0) -> dict[str, str]:
    """What each engine's check_no_leaks() raised (engine name -> message): {} when nothing
    is left anywhere."""
    import ray
    refs = {name: h.check_no_leaks.remote() for name, h in cluster.engines.items()}
    out = {}
    for name, ref in refs.items():
        try:
            ray.get(ref, timeout=timeout)
        except AssertionError as e:  # Ray's task error is also the cause's type
            out[name] = str(e)
    return out


async def stream_completion(http: httpx.AsyncClient, model: str, prompt: list[int],
                            max_tokens: int, started: asyncio.Event | None = None,
                            seed: int | None = None) -> tuple[str, list[int], str | None]:
    """('ok'|'error'|'http-<status>', token ids, error message) for one streamed completion
    (greedy, or sampled at temperature 0.8 with ``seed``); sets ``started`` after 3 tokens."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}
    if seed is not None:
        body.update(temperature=0.8, seed=seed)
    ids: list[int] = []
    async with http.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            return f"http-{resp.status_code}", ids, (await resp.aread()).decode()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if "error" in data:
                return "error", ids, data["error"]["message"]
            ids.extend(data["choices"][0].get("token_ids") or [])
            if started is not None and len(ids) >= 3:
                started.set()
    return "ok", ids, None
