"""`pd-cluster launch | status | stop` (and the foreground run `serve` shares with `launch`)."""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from typing import Any

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the config (and torch behind it) loads only when a command runs
    from pd_cluster.serving.cluster.cluster_config import ClusterConfig

_DEFAULT_NAMESPACE = "pd-cluster"


def add_cluster_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("launch", help="start a P/D cluster (engines + OpenAI proxy) on Ray")
    p.add_argument("--config", required=True, help="cluster YAML (see configs/)")
    p.add_argument("--address", default=None,
                   help="Ray cluster to join (default: RAY_ADDRESS, the config's ray.address, "
                        "else start a local instance)")
    p.add_argument("--detach", action="store_true",
                   help="leave the cluster running and exit (stop it with `pd-cluster stop`)")
    p.add_argument("--host", default=None, help="override proxy.host")
    p.add_argument("--port", type=int, default=None, help="override proxy.port (0: any free)")
    p.add_argument("--namespace", default=None, help="override ray.namespace")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any config key, e.g. --set decode.replicas=2 (repeatable)")
    p.add_argument("--no-progress", action="store_true", help="no per-engine progress lines")
    p.set_defaults(run=run_launch)

    s = sub.add_parser("status", help="engines, health and load of a running cluster")
    add_target_args(s)
    s.add_argument("--url", default=None, help="proxy URL (default: from the launch record)")
    s.add_argument("--json", action="store_true", help="print the raw status JSON")
    s.set_defaults(run=run_status)

    t = sub.add_parser("stop", help="stop a cluster started with `pd-cluster launch`")
    add_target_args(t)
    t.add_argument("--address", default=None, help="Ray address (default: the launch record)")
    t.set_defaults(run=run_stop)


def add_target_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--namespace", default=None, help=f"default: {_DEFAULT_NAMESPACE}")
    p.add_argument("--config", default=None, help="take the namespace from this config")


def target_namespace(args: argparse.Namespace) -> str:
    if args.namespace:
        return args.namespace
    if args.config:
        from pd_cluster.serving.cluster.cluster_config import load_config
        return load_config(args.config).ray.namespace
    return _DEFAULT_NAMESPACE


def _config_from_args(args: argparse.Namespace) -> "ClusterConfig":
    from pd_cluster.serving.cluster.cluster_config import load_config, parse_overrides
    from pd_cluster.serving.cluster.schema import set_path
    overrides = parse_overrides(args.set)
    for key, value in (("proxy.host", args.host), ("proxy.port", args.port),
                       ("ray.namespace", args.namespace)):
        if value is not None:
            set_path(overrides, key, value)
    return load_config(args.config, overrides)


# ---- launch ---------------------------------------------------------------------------------
def run_launch(args: argparse.Namespace) -> int:
    return run_cluster(_config_from_args(args), args.address, args.detach, not args.no_progress)


def preflight(cfg: "ClusterConfig", address: str | None) -> str | None:
    """What stops this config from serving, found before Ray starts (in a fraction of a
    second, not after loading every engine); None when nothing does."""
    from pd_cluster.serving.cluster.model_source import check_model
    busy = _port_in_use(cfg.proxy.host, cfg.proxy.port)
    if busy:
        return (f"proxy.port {cfg.proxy.port} on {cfg.proxy.host} is not available ({busy}); "
                f"free it, or pass --port (0: any free port)")
    from pd_cluster.generation_defaults import load_generation_defaults
    try:
        if address is None:  # engines on this machine: their model must be here
            path = check_model(cfg.model)
        elif cfg.engine.get("generation_config", "auto") not in ("auto", "vllm"):
            path = ""  # the proxy (on this machine) reads the folder; the model may be elsewhere
        else:
            return None
        load_generation_defaults(path, cfg.engine.get("generation_config", "auto"),
                                 cfg.engine.get("override_generation_config"))
    except ValueError as e:
        return str(e)
    return None


def run_cluster(cfg: "ClusterConfig", cli_address: str | None, detach: bool,
                progress: bool) -> int:
    """Start the cluster; in the foreground, serve until Ctrl-C or SIGTERM, then stop all."""
    from pd_cluster.serving.cluster.launch_record import ClusterState
    from pd_cluster.serving.cluster.ray_runtime import pid_alive, resolve_address

    if not sys.stdout.isatty():  # a log file or pipe: Ray's actor-line prefixes uncoloured
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    address = resolve_address(cli_address, cfg.ray.address)
    from pd_cluster import start_trace
    start_trace.mark("launcher", "config built")
    problem = preflight(cfg, address)
    start_trace.mark("launcher", "preflight done")
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 1
    old = ClusterState.load(cfg.ray.namespace)
    if old is not None and old.launcher_pid != os.getpid() and (
            pid_alive(old.launcher_pid) if not old.detached
            else old.head_pid is None or pid_alive(old.head_pid)):
        print(f"error: a cluster is already running in namespace {cfg.ray.namespace!r} "
              f"({old.url}); `pd-cluster stop --namespace {cfg.ray.namespace}` first, or "
              f"use --namespace", file=sys.stderr)
        return 1
    # A plain flag, not a threading.Event: a signal handler that takes a lock can deadlock
    # when a second signal arrives while the first handler holds it (Ctrl-C twice).
    stop = [False]

    def on_term(signum: int, _frame: Any) -> None:
        if _launched:
            stop[0] = True  # repeated signals while shutting down are ignored: cleanup is bounded
        else:  # still starting up: unwind through launch()'s cleanup
            raise KeyboardInterrupt

    _launched = False
    signal.signal(signal.SIGTERM, on_term)
    from pd_cluster.serving.cluster.launcher import launch
    if cfg.shape_note:
        print(f"shape: {cfg.shape_note}", flush=True)
    names = ", ".join(repr(n) for n in cfg.served_names)
    print(f"launching {cfg.mode} cluster: {_describe(cfg)}; model {cfg.model} served as "
          f"{names}; Ray {'at ' + address if address else 'local'}", flush=True)
    try:
        cluster = launch(cfg, address=address, detach=detach, progress=progress,
                         show_logs=not detach)
    except KeyboardInterrupt:
        print("interrupted; cleaned up", file=sys.stderr)
        return 130
    except (RuntimeError, TimeoutError, ValueError) as e:  # launch checks: say why, no traceback
        print(f"error: launch failed: {e}", file=sys.stderr)
        return 1
    print(f"pd-cluster serving on {cluster.url}  (OpenAI base_url: {cluster.url}/v1)", flush=True)
    if detach:
        print(f"detached; `pd-cluster status --namespace {cluster.namespace}` / "
              f"`pd-cluster stop --namespace {cluster.namespace}`", flush=True)
        cluster.runtime.disconnect()  # detached actors (and a started head) live on
        return 0
    _launched = True
    signal.signal(signal.SIGINT, on_term)
    signal.signal(signal.SIGTERM, on_term)  # ray.init installed its own (noisy) one meanwhile
    print("press Ctrl-C to stop", flush=True)
    try:
        while not stop[0]:
            time.sleep(0.2)  # a signal interrupts the sleep; its handler only sets the flag
    finally:
        print("shutting down ...", flush=True)
        t0 = time.monotonic()
        cluster.shutdown()
        print(f"stopped in {time.monotonic() - t0:.1f}s", flush=True)
    return 0


def _port_in_use(host: str, port: int) -> str | None:
    """Why the proxy could not bind (host, port) on this node, or None."""
    if port == 0:
        return None
    import socket

    from pd_cluster.serving.cluster.proxy_actor import bind_socket
    try:
        bind_socket(host, port).close()
    except (OSError, socket.gaierror) as e:
        return e.strerror or str(e)
    return None


def _describe(cfg: "ClusterConfig") -> str:
    return ", ".join(f"{rc.replicas}x {role}" for role, rc in cfg.roles.items())


# ---- status ---------------------------------------------------------------------------------
def run_status(args: argparse.Namespace) -> int:
    import logging

    import httpx

    from pd_cluster.serving.cluster.launch_record import ClusterState
    from pd_cluster.serving.observability.engine_series import kv_link_line
    from pd_cluster.serving.observability.offload_series import tier_line

    logging.getLogger("httpx").setLevel(logging.WARNING)  # no per-request INFO lines here
    ns = target_namespace(args)
    url = args.url
    if url is None:
        st = ClusterState.load(ns)
        if st is None:
            print(f"no cluster is running in namespace {ns!r}: start one with `pd-cluster "
                  f"serve MODEL` (or `pd-cluster launch --config FILE`); a cluster in another "
                  f"namespace: --namespace NAME; a proxy started elsewhere: --url URL",
                  file=sys.stderr)
            return 1
        url = st.url
    key = os.environ.get("PD_CLUSTER_API_KEY")  # a keyed proxy (proxy.api_key) wants one
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        reply = httpx.get(f"{url}/cluster/status", timeout=30.0, headers=headers)
        body = reply.json()
    except (httpx.HTTPError, ValueError) as e:
        moved = _proxy_url_from_ray(ns, st) if args.url is None else None
        if moved is None or moved == url:
            print(f"the cluster at {url} is not reachable ({e}); if it was stopped, "
                  f"`pd-cluster stop --namespace {ns}` clears its record", file=sys.stderr)
            return 1
        print(f"the proxy moved: {url} -> {moved} (launch record updated)", file=sys.stderr)
        url = moved
        reply = httpx.get(f"{url}/cluster/status", timeout=30.0, headers=headers)
        body = reply.json()
    if reply.status_code == 401:
        print(f"the proxy at {url} wants an API key (proxy.api_key): set PD_CLUSTER_API_KEY",
              file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(body, indent=2))
        return 0
    proxy_node = body.get("proxy", {}).get("node_ip", "?")
    print(f"{body['mode']} cluster serving {body['model']} at {url} (proxy on node "
          f"{proxy_node}); {body['inflight']} request(s) in flight")
    cols = ("ENGINE", "ROLE", "HEALTH", "STATE", "RUNNING", "WAITING", "KV_USED", "KV_FREE",
            "KV_LINKS", "INFLIGHT", "RESTARTS", "PID", "NODE", "TP")
    rows = [cols]
    for e in body["engines"]:
        s = e.get("stats", {})
        # Ranks: rank 0 is the engine's process, the others its children on the same node.
        tp = s.get("tensor_parallel_size", 1)
        rows.append((e["name"], e["role"], "ok" if e["healthy"] else "UNHEALTHY",
                     e.get("state", "serving"),
                     s.get("num_running", "?"), s.get("num_waiting", "?"),
                     s.get("kv_blocks_used", "?"), s.get("kv_blocks_free", "?"),
                     e.get("kv_peers", 0) if e["role"] == "prefill" else "-", e["inflight"],
                     e["restarts"], e["pid"], e.get("node_ip") or "?",
                     tp if tp == 1 else f"{tp} (pids {s.get('tp_pids', '?')})"))
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(cols))]
    for r in rows:
        print("  ".join(str(v).ljust(w) for v, w in zip(r, widths)))
    for e in body["engines"]:  # what each engine's KV cache holds per token
        s = e.get("stats", {})
        if "kv_bytes_per_token" in s:
            print(f"{e['name']} KV cache: {s.get('kv_cache_dtype', 'auto')}, "
                  f"{s['kv_bytes_per_token']:.0f} bytes/token")
    for e in body["engines"]:  # engines with KV tiers below the device pool
        line = tier_line(e.get("stats", {}))
        if line is not None:
            print(f"{e['name']} KV tiers: {line}")
    for e in body["engines"]:  # each KV link of a prefill engine and its pipe
        line = kv_link_line(e, body["engines"])
        if line is not None:
            print(f"{e['name']} KV links: {line}")
    for e in body["engines"]:  # a CPU engine running without its C++ kernels: say why
        kernels = str(e.get("stats", {}).get("cpu_kernels", ""))
        if kernels.startswith("failed"):
            print(f"{e['name']} CPU kernels {kernels} (running the slower torch attention)")
    from pd_cluster.planner.status import status_lines
    for line in status_lines(body.get("planner")):  # the SLO controller's plan in force
        print(line)
    return 0


def _proxy_url_from_ray(namespace: str, st: Any) -> str | None:
    """Ask Ray where the proxy serves now (it may have restarted); update the launch record."""
    import dataclasses

    import ray

    from pd_cluster.serving.cluster.launcher import PROXY_NAME
    from pd_cluster.serving.cluster.ray_runtime import connect
    if st is None or not st.address:
        return None
    try:
        connect(st.address, namespace)
        url = ray.get(ray.get_actor(PROXY_NAME, namespace=namespace).url.remote(), timeout=30)
    except Exception:  # noqa: BLE001 - Ray gone too: the caller reports the old URL
        return None
    finally:
        ray.shutdown()
    dataclasses.replace(st, url=url).save()
    return url


# ---- stop -----------------------------------------------------------------------------------
def run_stop(args: argparse.Namespace) -> int:
    import ray

    from pd_cluster.serving.cluster.launcher import (PROXY_NAME, ClusterState, drain_proxy,
                                                     kill_actors)
    from pd_cluster.serving.cluster.placement import named_groups, remove_groups
    from pd_cluster.serving.cluster.ray_runtime import connect, pid_alive, stop_head

    ns = target_namespace(args)
    st = ClusterState.load(ns)
    if st is not None and not st.detached and pid_alive(st.launcher_pid):
        os.kill(st.launcher_pid, signal.SIGTERM)  # a foreground launcher cleans up itself
        deadline = time.monotonic() + 60 + st.shutdown_timeout  # it drains the proxy first
        while pid_alive(st.launcher_pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        print(f"stopped the launcher (pid {st.launcher_pid})")
        return 0 if not pid_alive(st.launcher_pid) else 1
    if st is not None and not args.address and (
            not st.detached or (st.head_pid and not pid_alive(st.head_pid))):
        st.remove()  # its launcher or its own Ray head is gone, and the cluster with it
        print(f"the cluster in namespace {ns!r} is no longer running; removed its record")
        return 0
    address = args.address or (st.address if st else None)
    if address is None:
        print(f"no cluster launched in namespace {ns!r}; pass --address", file=sys.stderr)
        return 1
    try:
        connect(address, ns)
    except Exception as e:  # noqa: BLE001 - unreachable Ray: say so, no traceback
        print(f"cannot reach Ray at {address}: {e}", file=sys.stderr)
        return 1
    try:
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if a.get("namespace") == ns]
        handles = {n: ray.get_actor(n, namespace=ns) for n in names}
        proxy = handles.pop(PROXY_NAME, None)
        drain_proxy(proxy)
        kill_actors(proxy, list(handles.values()))
        remove_groups(named_groups(ns, ("prefill", "decode", "colocated")))
        print(f"killed {len(names)} actor(s) in namespace {ns!r}")
    finally:
        ray.shutdown()
    if st is not None:
        if st.head_pid and pid_alive(st.head_pid):
            stop_head(st.head_pid, st.address)
            print(f"stopped the local Ray head (pid {st.head_pid})")
        st.remove()
    return 0
