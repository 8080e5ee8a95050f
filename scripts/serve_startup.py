#!/usr/bin/env python
"""Where `pd-cluster serve MODEL`'s time goes, from launch to the first completion.

Each run launches `pd-cluster serve MODEL --port P` with ``PD_START_TRACE`` set (every process
marks its phases, pd_cluster/start_trace.py), posts a completion every 50 ms until one answers,
stops the server (SIGINT) and prints each process's phases in seconds from the launch.

  cold: an empty PD_CLUSTER_CACHE (compiled-model and kernel caches) in a temp dir;
  warm: the same cache again, after the cold run filled it.

  python scripts/serve_startup.py [MODEL] [--runs 2] [--only cold|warm] [--importtime]
      [--wait-switch] [-- extra serve flags]
  python scripts/serve_startup.py --smoke   # the phase table of a synthetic trace, no server

``--importtime``: every process runs with -X importtime (PYTHONPROFILEIMPORTTIME) and the
slowest top-level imports per process are listed (the imports cost more with it on).
``--wait-switch``: also wait (bounded) for each engine's switch to the compiled step.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import defaultdict
from pathlib import Path
from typing import Any

_POLL = 0.05  # s between completion attempts
_STOP_TIMEOUT = 60.0
_IMPORT = re.compile(r"\(([A-Za-z]+) pid=(\d+)\).*import time:\s+(\d+) \|\s+(\d+) \| (\S+)$")
_SWITCH = re.compile(r"switched to the compiled step")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def complete(url: str, model: str, timeout: float) -> bool:
    body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 8,
                       "temperature": 0}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status == 200 and bool(json.loads(r.read())["choices"])
    except (urllib.error.URLError, ConnectionError, OSError, ValueError):
        return False


def serve_command(model: str, port: int, extra: list[str]) -> list[str]:
    exe = Path(sys.executable).with_name("pd-cluster")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "pd_cluster.cli"]
    return [*cmd, "serve", model, "--port", str(port), "--no-progress", *extra]


def run_once(model: str, cache: Path, extra: list[str], timeout: float, importtime: bool,
             wait_switch: float) -> dict[str, Any]:
    """One launch: {"first": s, "switch": [s...], "trace": events, "imports": lines}."""
    trace = Path(tempfile.mkdtemp(prefix="pd-start-trace-"))
    env = dict(os.environ, PD_CLUSTER_CACHE=str(cache), PD_START_TRACE=str(trace),
               RAY_DEDUP_LOGS="0")
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)  # under the cache root, as a user's
    if importtime:
        env["PYTHONPROFILEIMPORTTIME"] = "1"
    port = free_port()
    lines: list[tuple[float, str]] = []
    t0 = time.time()
    proc = subprocess.Popen(serve_command(model, port, extra), env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    reader = threading.Thread(target=lambda: [lines.append((time.time(), ln.rstrip()))
                                              for ln in proc.stdout], daemon=True)
    reader.start()
    first = None
    try:
        deadline = t0 + timeout
        while time.time() < deadline and proc.poll() is None:
            if complete(f"http://127.0.0.1:{port}", model, 30.0):
                first = time.time() - t0
                break
            time.sleep(_POLL)
        end = time.time() + (wait_switch if first is not None else 0)
        while time.time() < end and proc.poll() is None:
            if sum(bool(_SWITCH.search(ln)) for _, ln in list(lines)) >= 2:
                break
            time.sleep(0.2)
    finally:
        stop(proc)
        reader.join(5.0)
    if first is None:
        tail = "\n".join(ln for _, ln in lines[-30:])
        raise RuntimeError(f"no completion within {timeout:.0f}s (exit {proc.returncode}):\n"
                           f"{tail}")
    events = [json.loads(ln) for f in trace.glob("*.jsonl") for ln in f.read_text().splitlines()
              if ln.strip()]
    shutil.rmtree(trace, ignore_errors=True)
    return {"first": first, "t0": t0, "trace": events,
            "switch": [round(t - t0, 1) for t, ln in lines if _SWITCH.search(ln)],
            "imports": [ln for _, ln in lines if "import time:" in ln]}


def stop(proc: subprocess.Popen) -> None:
    """SIGINT (as Ctrl-C: the server drains and stops what it started), then SIGKILL."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(_STOP_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10.0)


def phase_table(events: list[dict[str, Any]], t0: float) -> list[str]:
    """One line per process (by pid, named by its actor's name where it said it), its events
    in seconds from ``t0`` in time order."""
    by_pid: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        by_pid[e["pid"]].append(e)
    rows = []
    for pid, evs in by_pid.items():
        evs.sort(key=lambda e: e["t"])
        named = [e["ev"][3:] for e in evs if e["ev"].startswith("is ")]
        name = named[0] if named else evs[0]["proc"]
        marks = [f"{e['ev']} {e['t'] - t0:.2f}" for e in evs if not e["ev"].startswith("is ")]
        rows.append((evs[0]["t"], f"{name:<11} pid {pid:<7} " + " | ".join(marks)))
    return [r for _, r in sorted(rows)]


def slowest_imports(lines: list[str], top: int = 8) -> list[str]:
    """Per process, the top-level imports (-X importtime) that took longest, cumulative ms."""
    per: dict[str, list[tuple[int, str]]] = defaultdict(list)
    for ln in lines:
        m = _IMPORT.search(ln)
        if m and not m.group(5).startswith(" "):
            per[f"{m.group(1)} pid={m.group(2)}"].append((int(m.group(4)), m.group(5)))
    out = []
    for proc, items in per.items():
        items.sort(reverse=True)
        out.append(f"{proc}: " + ", ".join(f"{n} {us / 1e6:.2f}s" for us, n in items[:top]))
    return out


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def smoke() -> int:
    t0 = 1000.0
    events = [{"proc": "launcher", "pid": 1, "ev": "cli main", "t": t0 + 0.4},
              {"proc": "engine", "pid": 2, "ev": "actor init", "t": t0 + 3.0},
              {"proc": "engine", "pid": 2, "ev": "is prefill-0", "t": t0 + 3.1},
              {"proc": "engine", "pid": 2, "ev": "engine ready", "t": t0 + 6.5}]
    table = phase_table(events, t0)
    print("\n".join(table))
    assert table[1].startswith("prefill-0") and "engine ready 6.50" in table[1], table
    return 0


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The options; what follows ``--`` goes to `serve` as is (argparse alone refuses
    ``-- --set K=V`` after the optional model)."""
    argv, extra = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv \
        else (argv, [])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default="tiny-llama")
    ap.add_argument("--runs", type=int, default=1, help="cold + warm pairs")
    ap.add_argument("--only", choices=("cold", "warm"), default=None)
    ap.add_argument("--timeout", type=float, default=240.0, help="s to the first completion")
    ap.add_argument("--importtime", action="store_true")
    ap.add_argument("--wait-switch", type=float, default=0.0, metavar="S",
                    help="then wait up to S s for both engines' switch to compiled")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    args.extra = extra
    return args


def main() -> int:
    args = parse_args(sys.argv[1:])
    if args.smoke:
        return smoke()
    results: dict[str, list[float]] = defaultdict(list)
    for i in range(args.runs):
        cache = Path(tempfile.mkdtemp(prefix="pd-start-cache-"))
        try:
            kinds = [k for k in ("cold", "warm") if args.only in (None, k)]
            if kinds == ["warm"]:  # fill the cache first, unmeasured
                run_once(args.model, cache, args.extra, args.timeout, False, 120.0)
            for kind in kinds:
                load = load_average()
                r = run_once(args.model, cache, args.extra, args.timeout, args.importtime,
                             args.wait_switch or (90.0 if kind == "cold" and "warm" in kinds
                                                  else 0.0))
                results[kind].append(r["first"])
                print(f"\n== run {i + 1} {kind}: first completion {r['first']:.1f} s from "
                      f"launch (load average before: {load}); compiled-step switches at "
                      f"{r['switch'] or '-'} s", flush=True)
                print("\n".join(phase_table(r["trace"], r["t0"])), flush=True)
                if args.importtime:
                    print("slowest imports:\n  " + "\n  ".join(slowest_imports(r["imports"])))
        finally:
            shutil.rmtree(cache, ignore_errors=True)
    print()
    for kind, firsts in results.items():
        print(f"{args.model} {kind}: first completion " + ", ".join(f"{x:.1f}" for x in firsts)
              + " s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
