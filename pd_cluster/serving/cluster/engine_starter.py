"""Starting one more engine actor on a running cluster (the launcher's way), and making room
for it: on a Ray cluster with an autoscaler, an engine that fits on no node now asks Ray for
the resources (``ray.autoscaler.sdk.request_resources``) and waits a bounded time; without
one it is a clear error at once, naming what it needs and what is free.

An engine added after launch is placed by its role's resources and node labels only: the
role's placement group (``strategy``) was sized at launch for its ``replicas``.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
from typing import Any, Callable

from pd_cluster.driver.cpu_setup import preload_env
from pd_cluster.driver.messages import EngineSpec
from pd_cluster.serving.cluster.cluster_config import ClusterConfig

logger = logging.getLogger(__name__)

PROXY_NAME = "proxy"  # the proxy actor's name in its namespace (the engines have theirs)
# How to get each preload where it is missing (the names preload_env reports).
_INSTALL_HINT = {"tcmalloc": "apt install libtcmalloc-minimal4",
                 "libiomp5": "pip install intel-openmp"}

_AUTOSCALING_KEY = "__autoscaling_status"  # written by Ray's autoscaler monitor on each update


class ScaleError(RuntimeError):
    """An engine could not be added (no room, or it failed to start)."""


def autoscaler_present() -> bool:
    """Is an autoscaler managing this Ray cluster? Ray's v1 autoscaler publishes its status
    in the GCS's internal KV; v2 (the default under `ray up` and on KubeRay since Ray 2.5x)
    does not, it reports its state to the GCS instead: a state version above 0 once it ran."""
    return _v1_autoscaler() or _v2_autoscaler()


def _v1_autoscaler() -> bool:
    try:
        from ray.experimental.internal_kv import _internal_kv_get
        raw = _internal_kv_get(_AUTOSCALING_KEY)
    except Exception:  # noqa: BLE001 - no GCS access: treat as none
        return False
    return raw is not None and not _readonly_monitor(raw)


def _readonly_monitor(raw: bytes) -> bool:
    """Every Ray head runs the v1 monitor; without an autoscaling config (a local instance,
    `ray start` by hand) it uses the read-only provider, which launches nothing and names
    each node's type ``node_<node id>``. Such a monitor's status is not an autoscaler."""
    try:
        mapping = json.loads(raw)["autoscaler_report"]["node_type_mapping"] or {}
    except (ValueError, KeyError, TypeError):
        return False  # another layout: assume a real autoscaler (asking costs a bounded wait)
    return bool(mapping) and all(t == f"node_{n}" for n, t in mapping.items())


def _v2_autoscaler() -> bool:
    try:
        import ray
        from ray.autoscaler.v2.sdk import get_cluster_status
        from ray.autoscaler.v2.utils import is_autoscaler_v2
        if not is_autoscaler_v2(fetch_from_server=True):
            return False
        status = get_cluster_status(ray.get_runtime_context().gcs_address, timeout=10)
        return (status.stats.autoscaler_version or "0") != "0"
    except Exception:  # noqa: BLE001 - no GCS access, or a Ray without v2: treat as none
        return False


def missing(demand: dict[str, float], free: dict[str, float]) -> dict[str, float]:
    """What of ``demand`` the cluster's free resources lack (empty: it fits)."""
    return {k: v - free.get(k, 0.0) for k, v in demand.items() if free.get(k, 0.0) < v - 1e-9}


class EngineStarter:
    def __init__(self, config: ClusterConfig, namespace: str, secret: str | None,
                 detached: bool = False, engine_env: dict[str, str] | None = None,
                 ready_timeout: float = 600.0, autoscale_timeout: float = 300.0,
                 has_autoscaler: Callable[[], bool] = autoscaler_present,
                 free_resources: Callable[[], dict[str, float]] | None = None):
        from pd_cluster.serving.cluster.placement import Placement
        self.config, self.namespace, self.secret = config, namespace, secret
        self.detached = detached
        self.placement = Placement(config, detached, engine_env)  # no groups: see above
        self.ready_timeout, self.autoscale_timeout = ready_timeout, autoscale_timeout
        self.has_autoscaler = has_autoscaler
        self.free_resources = free_resources or _available_resources

    def demand(self, role: str) -> dict[str, float]:
        opts = self.placement.options(self.config.engine_spec(role, f"{role}-x"), 0)
        out = {"CPU": float(opts.get("num_cpus", 0)), "GPU": float(opts.get("num_gpus", 0))}
        out.update({k: float(v) for k, v in opts.get("resources", {}).items()})
        return {k: v for k, v in out.items() if v > 0}

    def make_room(self, role: str, count: int, keep: dict[str, int] | None = None) -> float:
        """Check that ``count`` engines of ``role`` fit now; if not, ask the autoscaler for
        them. ``keep``: the engines per role the cluster holds besides them (after this
        scaling). Returns how long to wait for them to start. ScaleError when nothing can
        host them."""
        one = self.demand(role)
        total = {k: v * count for k, v in one.items()}
        lack = missing(total, self.free_resources())
        if not lack:
            return self.ready_timeout
        if not self.has_autoscaler():
            raise ScaleError(f"{role}: no room for {count} more engine(s) (each needs {one}; "
                             f"the cluster lacks {lack}); add a node, or run Ray with an "
                             f"autoscaler")
        from ray.autoscaler.sdk import request_resources
        # request_resources sizes the whole cluster: it counts resources in use against the
        # request (Ray's docs), so it names every engine the cluster is to hold, not only
        # the new ones (those alone would "fit" on the nodes the running engines fill).
        held = [self.demand(r) for r, n in (keep or {}).items() for _ in range(n)]
        logger.info("asking Ray's autoscaler for %d %s engine(s) (%s each; %d engine(s) "
                    "held besides)", count, role, one, len(held))
        request_resources(bundles=[b for b in held if b] + [dict(one) for _ in range(count)])
        return self.autoscale_timeout + self.ready_timeout

    def spec(self, role: str, name: str) -> EngineSpec:
        return self.config.engine_spec(role, name)

    def start(self, spec: EngineSpec) -> Any:
        """Create the engine actor (named, in the cluster's namespace); not yet ready."""
        from pd_cluster.serving.engine.engine_actor import engine_actor_class
        rc = self.config.roles[spec.role]
        return engine_actor_class().options(
            name=spec.name, namespace=self.namespace, max_restarts=rc.max_restarts,
            max_task_retries=0, lifetime="detached" if self.detached else None,
            **self.placement.options(spec, 0)).remote(spec.to_dict(), self.secret)

    async def wait_ready(self, name: str, handle: Any, timeout: float) -> dict[str, Any]:
        """The engine's EngineInfo once it loaded; ScaleError (the actor killed) if it failed
        or did not start within ``timeout``."""
        try:
            return await asyncio.wait_for(handle.ready.remote(), timeout)
        except asyncio.TimeoutError:
            why = f"not ready within {timeout:.0f}s (no node could host it, or still loading)"
        except Exception as e:  # noqa: BLE001 - its constructor failed
            why = f"failed to start: {str(e).strip().splitlines()[-1][:300]}"
        kill(handle)
        raise ScaleError(f"{name}: {why}")

    def settled(self) -> None:
        """Every requested engine started: withdraw the standing autoscaler request."""
        if self.has_autoscaler():
            try:
                from ray.autoscaler.sdk import request_resources
                request_resources(bundles=[])
            except Exception:  # noqa: BLE001 - only a hint to the autoscaler
                pass


def kill(handle: Any) -> None:
    import ray
    try:
        ray.kill(handle, no_restart=True)
    except Exception:  # noqa: BLE001 - already gone
        pass


def _available_resources() -> dict[str, float]:
    import ray
    return dict(ray.available_resources())


def engine_env(config: ClusterConfig, quiet: bool = False) -> dict[str, str]:
    """The preloads engines start with (tcmalloc, Intel OpenMP) where this node has them;
    a missing one is said once, by the launcher, and the engines go on without it
    (``quiet``: the proxy's copy, for engines it adds, says nothing)."""
    if not config.cpu.preload_libraries:
        return {}
    env, missing = preload_env(os.environ.get("LD_PRELOAD"))
    if quiet:
        return env
    if missing:
        hints = ", ".join(f"{lib}: `{_INSTALL_HINT.get(lib, lib)}`" for lib in missing)
        logger.info("engines start without %s (not found on this node; %s)",
                    " and ".join(missing), hints)
    if env:
        logger.info("engines preload %s", env["LD_PRELOAD"])
    return env


def named_engines(namespace: str) -> dict[str, Any]:
    """Every engine actor alive in ``namespace`` by name (the proxy excluded)."""
    import ray
    try:
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if a.get("namespace") == namespace and a["name"] != PROXY_NAME]
    except Exception:  # noqa: BLE001 - Ray gone: the launched ones are killed anyway
        return {}
    out = {}
    for name in names:
        try:
            out[name] = ray.get_actor(name, namespace=namespace)
        except ValueError:  # gone meanwhile
            pass
    return out
