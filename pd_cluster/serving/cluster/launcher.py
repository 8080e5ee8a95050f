"""Start a cluster (engine actors + proxy actor) from a ClusterConfig, and take it down again.

Used by ``pd-cluster launch`` and by tests/benchmarks in-process. Engines are named actors
in the config's namespace, so ``status``/``stop`` (or a restarted proxy) can find them.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

from pd_cluster import start_trace
from pd_cluster.serving.cluster.cluster_config import ClusterConfig
from pd_cluster.serving.cluster.engine_starter import PROXY_NAME, engine_env, named_engines
from pd_cluster.serving.cluster.launch_record import ClusterState, state_dir
from pd_cluster.driver.messages import ROLE_DECODE, ROLE_PREFILL, EngineSpec
from pd_cluster.serving.cluster.placement import Placement, check_feasible
from pd_cluster.serving.cluster.ray_runtime import RayRuntime, start_ray, stop_head

logger = logging.getLogger(__name__)

_READY_TIMEOUT = 600.0  # s: model loading (and first-use generation of a preset) per engine
_STOP_TIMEOUT = 10.0
_LINK_TIMEOUT = 15.0  # s: every launch-time P -> D handshake, all in parallel


@dataclass
class Cluster:
    config: ClusterConfig
    runtime: RayRuntime
    url: str
    engines: dict[str, Any]  # name -> actor handle
    specs: list[EngineSpec]
    proxy: Any
    placement: Placement
    detached: bool = False
    _down: bool = field(default=False, repr=False)

    @property
    def namespace(self) -> str:
        return self.config.ray.namespace

    def state(self) -> ClusterState:
        return ClusterState(self.namespace, self.runtime.address, self.url, list(self.engines),
                            self.detached, os.getpid(), self.runtime.head_pid,
                            self.config.proxy.shutdown_timeout)

    def shutdown(self) -> None:
        """Stop the proxy (frees the port), kill the engines, leave/stop Ray. Idempotent."""
        if self._down:
            return
        self._down = True
        drain_proxy(self.proxy)  # in-flight requests finish (or end) before engines stop
        # the engines launched and any the proxy added since (`pd-cluster scale`)
        kill_actors(self.proxy, {**self.engines, **named_engines(self.namespace)}.values())
        self.placement.release()
        ClusterState(self.namespace, None, "", [], False, 0).remove()
        self.runtime.disconnect()
        if self.runtime.head_pid:
            stop_head(self.runtime.head_pid, self.runtime.address)


def drain_proxy(proxy: Any) -> None:
    """The proxy's drain (api/shutdown.py): no new requests, in-flight ones finish within
    proxy.shutdown_timeout, the rest end with "server shutting down". Bounded; a proxy that
    is gone or hung is passed by (kill_actors follows)."""
    import ray
    if proxy is None:
        return
    try:
        timeout = ray.get(proxy.shutdown_timeout.remote(), timeout=_STOP_TIMEOUT)
        result = ray.get(proxy.drain.remote(), timeout=timeout + 3 * _STOP_TIMEOUT)
    except Exception as e:  # noqa: BLE001 - the proxy is down already: nothing to drain
        logger.info("no drain: the proxy did not answer (%s)", type(e).__name__)
        return
    if result.get("in_flight"):
        print(f"drained: {result['in_flight'] - result['ended']} of {result['in_flight']} "
              f"request(s) in flight finished, {result['ended']} ended with 'server shutting "
              f"down' ({result['seconds']}s)", flush=True)


def kill_actors(proxy: Any, engines: Any) -> None:
    import ray
    graceful = []
    if proxy is not None:
        graceful.append(proxy.stop.remote())
    graceful += [e.shutdown.remote() for e in engines]
    try:  # bounded: a hung or dead actor is killed below anyway
        ray.wait(graceful, num_returns=len(graceful), timeout=_STOP_TIMEOUT)
    except Exception:  # noqa: BLE001
        pass
    for actor in [proxy, *engines]:
        if actor is not None:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass


def launch(config: ClusterConfig, *, address: str | None = None, detach: bool = False,
           progress: bool = True, ready_timeout: float = _READY_TIMEOUT,
           show_logs: bool = False) -> Cluster:
    """Start everything and wait until every engine is ready, every prefill engine holds a
    KV link to every decode engine, and the proxy serves on this node."""
    import ray

    from connectors.secret import new_secret
    from pd_cluster.serving.api.auth import resolve_api_keys
    from pd_cluster.serving.engine.engine_actor import engine_actor_class
    from pd_cluster.serving.cluster.proxy_actor import proxy_actor_class

    # Resolved here, in the user's shell; handed to the actors through Ray only.
    api_keys = resolve_api_keys(config.proxy.api_key, config.proxy.api_key_env)
    secret = new_secret()
    ns = config.ray.namespace
    num_cpus = config.ray.num_cpus or max(config.required_cpus(), 1.0)
    start_trace.mark("launcher", "ray.init")
    runtime = start_ray(address, ns, num_cpus, config.ray.num_gpus, detach, state_dir(),
                        log_to_driver=show_logs)
    start_trace.mark("launcher", "ray up")
    lifetime = "detached" if detach else None
    engines: dict[str, Any] = {}
    proxy = None
    placement = Placement(config, detach, engine_env(config))
    try:
        check_feasible(config, ray.nodes())
        placement.reserve()
        specs = config.engine_specs()
        cls = engine_actor_class()
        for spec in specs:
            index = int(spec.name.rsplit("-", 1)[1])
            engines[spec.name] = cls.options(
                name=spec.name, namespace=ns, max_restarts=config.roles[spec.role].max_restarts,
                max_task_retries=0, lifetime=lifetime, **placement.options(spec, index),
            ).remote(spec.to_dict(), secret)
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
        here = ray.get_runtime_context().get_node_id()  # serve where the user launched
        # Made now, beside the engines: its process and libraries load while they do (the
        # first answer comes seconds sooner); it serves once they are ready and linked.
        proxy = proxy_actor_class().options(
            name=PROXY_NAME, namespace=ns, num_cpus=0, max_concurrency=4, lifetime=lifetime,
            max_restarts=config.proxy.max_restarts,
            scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False),
        ).remote(config.to_dict(), [{"name": s.name, "role": s.role} for s in specs], ns,
                 {"cluster": secret, "api_keys": api_keys}, detach, True)
        start_trace.mark("launcher", "actors requested")
        infos = wait_ready(engines, ready_timeout, progress)
        start_trace.mark("launcher", "engines ready")
        link_engines(engines, infos, config)
        start_trace.mark("launcher", "engines linked")
        url = ray.get(proxy.start.remote(), timeout=ready_timeout)
        start_trace.mark("launcher", "proxy serving")
    except BaseException:
        kill_actors(proxy, engines.values())
        placement.release()
        runtime.disconnect()
        if runtime.head_pid:
            stop_head(runtime.head_pid, runtime.address)
        raise
    cluster = Cluster(config, runtime, url, engines, specs, proxy, placement, detached=detach)
    cluster.state().save()
    return cluster


def link_engines(engines: dict[str, Any], infos: dict[str, dict[str, Any]],
                 config: ClusterConfig, timeout: float = _LINK_TIMEOUT) -> None:
    """Every prefill engine handshakes with every decode engine, in parallel and bounded.
    A pair that cannot connect fails the launch with both addresses and the reason (or, with
    ``kv_transfer.unreachable: warn``, is logged loudly and retried later by the proxy)."""
    import ray

    consumers = {n: i for n, i in infos.items() if i["role"] == ROLE_DECODE and i["kv_endpoint"]}
    producers = [n for n, i in infos.items() if i["role"] == ROLE_PREFILL]
    if not consumers or not producers:
        return
    peers = {i["kv_endpoint"]: i["incarnation"] for i in consumers.values()}
    refs = {n: engines[n].connect_peers.remote(peers, timeout) for n in producers}
    by_endpoint = {i["kv_endpoint"]: n for n, i in consumers.items()}
    failures = []
    for name, ref in refs.items():
        try:
            results = ray.get(ref, timeout=timeout + 10)
        except Exception as e:  # noqa: BLE001 - the producer itself is the problem
            results = {ep: f"{type(e).__name__}: {e}" for ep in peers}
        for endpoint, error in sorted(results.items()):
            if error:
                failures.append(f"{name} (node {infos[name]['node_ip']}) -> "
                                f"{by_endpoint[endpoint]} at {endpoint}: {error}")
    if not failures:
        logger.info("KV links: %d prefill x %d decode engines connected", len(producers),
                    len(consumers))
        return
    msg = ("prefill engines cannot reach decode engines' KV endpoints (open the KV ports "
           "between nodes, or pick the network with kv_transfer.interface / cidr):\n  "
           + "\n  ".join(failures))
    if config.kv_transfer.unreachable == "error":
        raise RuntimeError(msg)
    logger.warning("%s\n(kv_transfer.unreachable: warn - those pairs are not used until a "
                   "retried handshake succeeds)", msg)


def wait_ready(engines: dict[str, Any], timeout: float, progress: bool
               ) -> dict[str, dict[str, Any]]:
    """Block until every engine's ready() returns (its EngineInfo), showing progress."""
    import ray

    infos: dict[str, dict[str, Any]] = {}
    pending = {actor.ready.remote(): name for name, actor in engines.items()}
    view = _Progress(list(engines), progress)
    start = time.monotonic()
    try:
        while pending:
            left = timeout - (time.monotonic() - start)
            if left <= 0:
                raise TimeoutError(f"engines not ready after {timeout:.0f}s: "
                                   f"{sorted(pending.values())}")
            done, _ = ray.wait(list(pending), num_returns=1, timeout=min(0.5, left))
            for ref in done:
                name = pending.pop(ref)
                try:
                    info = infos[name] = ray.get(ref)
                except Exception as e:
                    raise RuntimeError(f"engine {name} failed to start: {_cause(e)}") from None
                view.ready(name, f"ready: pid {info['pid']} on {info['node_ip']}, "
                                 f"{info['stats'].get('kv_blocks_total', '?')} KV blocks")
            view.tick()
    finally:
        view.close()
    return infos


def _cause(e: BaseException) -> str:
    """The engine's own error out of Ray's wrapping (the last line says what went wrong)."""
    text = str(getattr(e, "error_msg", None) or e).strip()
    lines = [ln for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "Error:" in ln]
    return errors[-1].strip() if errors else (lines[-1] if lines else repr(e))


class _Progress:
    """One tqdm line per engine on a terminal; plain log lines otherwise (CI, pipes)."""

    def __init__(self, names: list[str], enabled: bool):
        import sys

        from tqdm import tqdm
        self.enabled, self.start = enabled, time.monotonic()
        self.tty = enabled and sys.stderr.isatty()
        self.bars = {n: tqdm(total=1, desc=f"{n:<12}", position=i, leave=True,
                             bar_format="{desc} {bar:10} {postfix} [{elapsed}]")
                     for i, n in enumerate(names)} if self.tty else {}
        for bar in self.bars.values():
            bar.set_postfix_str("loading model")
        if enabled and not self.tty:
            print(f"starting {len(names)} engine(s): {', '.join(names)}", file=sys.stderr,
                  flush=True)

    def ready(self, name: str, text: str) -> None:
        if name in self.bars:
            self.bars[name].set_postfix_str(text, refresh=False)
            self.bars[name].update(1)
        elif self.enabled:
            import sys
            print(f"  {name}: {text} ({time.monotonic() - self.start:.1f}s)", file=sys.stderr,
                  flush=True)

    def tick(self) -> None:
        for bar in self.bars.values():
            bar.refresh()

    def close(self) -> None:
        for bar in self.bars.values():
            bar.close()
