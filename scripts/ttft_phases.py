#!/usr/bin/env python
"""Where each request's time to first token goes, from a PD_TTFT_TRACE directory.

Run a benchmark with ``PD_TTFT_TRACE=/tmp/trace`` (the proxy and engines write their events
there, pd_cluster/ttft_trace.py), then ``python scripts/ttft_phases.py /tmp/trace``. Per path
(remote: through P; local/whole: one engine) it prints the p50 and mean of each phase in ms,
and the TTFT model's estimate against the first output the proxy saw (the estimate's bias).

  python scripts/ttft_phases.py DIR [--smoke]   # --smoke: a tiny synthetic trace, no cluster
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

_EST = re.compile(r"remote=([0-9.]+)ms local=([0-9.]+)ms")


def load(directory: Path) -> dict[str, list[dict[str, Any]]]:
    """rid -> its events, by time."""
    events: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for f in directory.glob("*.jsonl"):
        for line in f.read_text().splitlines():
            try:
                ev = json.loads(line)
            except ValueError:  # a line cut by a killed process
                continue
            events[ev["rid"]].append(ev)
    for evs in events.values():
        evs.sort(key=lambda e: e["t"])
    return events


def _first(evs: list[dict[str, Any]], name: str, **match: Any) -> float | None:
    for e in evs:
        if e["ev"] == name and all(e.get(k) == v for k, v in match.items()):
            return e["t"]
    return None


def phases(evs: list[dict[str, Any]]) -> tuple[str, dict[str, float]] | None:
    """(path, phase -> seconds) of one request, or None when its trace is incomplete."""
    plan = _first(evs, "plan")
    if plan is None:
        return None
    route = next(e.get("route", "") for e in evs if e["ev"] == "plan")
    mode = next(e.get("mode", "") for e in evs if e["ev"] == "plan")
    est = _EST.search(route)
    out: dict[str, float] = {}
    if _first(evs, "p_first") is not None:  # remote: the client's token 1 is P's
        side, first = "P", _first(evs, "p_first")
        path = "remote"
    elif _first(evs, "first") is not None:
        side, first = "W", _first(evs, "first")
        path = "local" if "local" in route else "whole"
    else:
        return None
    add, admit, tok1 = (_first(evs, "add", side=side), _first(evs, "admit", side=side),
                        None)
    chunks = [e["t"] for e in evs if e["ev"] == "chunk"]
    tok1 = next((e["t"] for e in evs if e["ev"] == "tok1" and admit and e["t"] >= admit), None)
    if None in (add, admit, tok1) or not chunks:
        return None
    first_chunk = next((t for t in chunks if t >= admit), admit)
    out["proxy->engine"] = add - plan
    out["engine queue"] = admit - add
    out["admit->1st step"] = first_chunk - admit
    out["prefill steps"] = tok1 - first_chunk
    out["n chunks"] = float(sum(1 for t in chunks if admit <= t <= tok1))
    out["tok1->proxy"] = first - tok1
    out["plan->first"] = first - plan
    if est:
        out["estimate"] = float(est.group(1 if path == "remote" else 2)) / 1e3
    if path == "remote":
        d_first, fin, kv = _first(evs, "d_first"), _first(evs, "fin"), _first(evs, "kv_ready")
        l0, ln, saved = _first(evs, "layer0"), _first(evs, "layerN"), _first(evs, "saved")
        if l0 is not None and ln is not None and saved is not None:
            out["P step->layer0"] = l0 - first_chunk
            out["P layer0->N"] = ln - l0
            out["P layerN->tok1"] = tok1 - ln  # sampling; the sends settle meanwhile
            out["P layerN->saved"] = saved - ln
        if d_first is not None and fin is not None and kv is not None:
            out["P tok1->FIN"] = fin - tok1
            out["FIN->D kv_ready"] = kv - fin
            out["P first->D first"] = d_first - first
    return f"{mode} {path}".strip(), out


def summarize(events: dict[str, list[dict[str, Any]]]) -> None:
    by_path: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for evs in events.values():
        got = phases(evs)
        if got is not None:
            for k, v in got[1].items():
                by_path[got[0]][k].append(v)
    for path, cols in sorted(by_path.items()):
        n = len(cols["plan->first"])
        print(f"\n{path}: {n} requests (ms; chunks as counts)")
        for k, vals in cols.items():
            vals = sorted(vals)
            scale = 1.0 if k == "n chunks" else 1e3
            print(f"  {k:<18} p50 {scale * vals[len(vals) // 2]:8.1f}   mean "
                  f"{scale * sum(vals) / len(vals):8.1f}")
        if cols.get("estimate"):
            bias = [d - e for d, e in zip(cols["plan->first"], cols["estimate"])]
            print(f"  delivered-estimate mean {1e3 * sum(bias) / len(bias):+.1f} ms")


def _smoke(directory: Path) -> None:
    lines = [("r1", "plan", 0.0, {"route": "local(x remote=30.0ms local=10.0ms)", "leg": "first"}),
             ("r1", "add", 0.001, {"side": "W"}), ("r1", "admit", 0.002, {"side": "W"}),
             ("r1", "chunk", 0.003, {"n": 64}), ("r1", "tok1", 0.010, {}),
             ("r1", "first", 0.011, {})]
    with open(directory / "1.jsonl", "w") as f:
        for rid, ev, t, extra in lines:
            f.write(json.dumps({"rid": rid, "ev": ev, "t": t, **extra}) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("directory", nargs="?")
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args(argv)
    if args.smoke:
        with tempfile.TemporaryDirectory() as d:
            _smoke(Path(d))
            summarize(load(Path(d)))
        return 0
    if not args.directory:
        p.error("directory is required (or --smoke)")
    summarize(load(Path(args.directory)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
