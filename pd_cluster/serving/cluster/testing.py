"""Helpers for serving tests and benchmarks: one shared local Ray, small clusters, polling."""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable

from pd_cluster.serving.cluster.cluster_config import ClusterConfig, load_config

REPO_ROOT = Path(__file__).resolve().parents[3]
CONFIGS = REPO_ROOT / "configs"


def ensure_ray(num_cpus: int = 4) -> None:
    """Start (once per process) a local Ray big enough for a 2P2D test cluster."""
    import ray
    if ray.is_initialized():
        return
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by the Ray workers
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
