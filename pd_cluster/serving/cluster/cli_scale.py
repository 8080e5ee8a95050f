"""`pd-cluster scale`: engines added, removed (drained first) or switched between roles on a
running cluster, through the proxy's admin routes (api/admin_routes.py).

    pd-cluster scale --prefill 2 --decode 3
    pd-cluster scale --switch decode-1=prefill
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any

_TIMEOUT = 1800.0  # s: engines load their model before they serve


def add_scale_command(sub: argparse._SubParsersAction) -> None:
    from pd_cluster.serving.cluster.cli_cluster import add_target_args
    p = sub.add_parser("scale", help="add, remove (drained, nothing lost) or switch engines of "
                                     "a running cluster")
    add_target_args(p)
    p.add_argument("--url", default=None, help="proxy URL (default: from the launch record)")
    for role in ("prefill", "decode", "colocated"):
        p.add_argument(f"--{role}", type=int, default=None, metavar="N",
                       help=f"run N {role} engines")
    p.add_argument("--switch", action="append", default=[], metavar="ENGINE=ROLE",
                   help="switch an engine to the other role in place (repeatable)")
    p.set_defaults(run=run_scale)


def run_scale(args: argparse.Namespace) -> int:
    counts = {r: getattr(args, r) for r in ("prefill", "decode", "colocated")
              if getattr(args, r) is not None}
    switches = []
    for item in args.switch:
        engine, sep, role = item.partition("=")
        if not sep or not engine or not role:
            return _fail(f"--switch {item!r}: expected ENGINE=ROLE (e.g. decode-1=prefill)")
        switches.append({"engine": engine, "role": role})
    if not counts and not switches:
        return _fail("give --prefill, --decode (or --colocated) N, or --switch ENGINE=ROLE")
    for role, n in counts.items():
        if n < 0:
            return _fail(f"--{role}: expected an engine count >= 0, got {n}")
    url = _proxy_url(args)
    if url is None:
        return 1
    calls: list[tuple[str, dict[str, Any]]] = [("/admin/switch_role", s) for s in switches]
    if counts:
        calls.append(("/admin/scale", counts))
    for path, body in calls:
        ok, lines = post(url, path, body)
        for line in lines:
            print(line if ok else f"error: {line}", file=sys.stdout if ok else sys.stderr)
        if not ok:
            return 1
    return 0


def post(url: str, path: str, body: dict[str, Any]) -> tuple[bool, list[str]]:
    """(ok, what to print) for one admin call."""
    import logging

    import httpx
    logging.getLogger("httpx").setLevel(logging.WARNING)  # no per-request INFO lines here
    key = os.environ.get("PD_CLUSTER_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        reply = httpx.post(f"{url}{path}", json=body, headers=headers, timeout=_TIMEOUT)
        data = reply.json()
    except (httpx.HTTPError, ValueError) as e:
        return False, [f"the proxy at {url} did not answer: {e}"]
    if reply.status_code == 401:
        return False, [f"the proxy at {url} wants an API key: set PD_CLUSTER_API_KEY"]
    if reply.status_code != 200:
        return False, [data.get("error", {}).get("message", reply.text)]
    engines = ", ".join(f"{e['id']} ({e['role']}, {e['state']})" for e in data["engines"])
    return True, [*data["done"], f"engines: {engines}"]


def _proxy_url(args: argparse.Namespace) -> str | None:
    from pd_cluster.serving.cluster.cli_cluster import target_namespace
    from pd_cluster.serving.cluster.launch_record import ClusterState
    if args.url:
        return args.url
    ns = target_namespace(args)
    st = ClusterState.load(ns)
    if st is None:
        _fail(f"no cluster is running in namespace {ns!r}: --namespace NAME, or --url URL")
        return None
    return st.url


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 1
