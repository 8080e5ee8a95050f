"""Per-request TTFT phase timestamps, switched on by ``PD_TTFT_TRACE=<directory>``.

Each process (proxy, engines) appends JSON lines ``{"rid", "ev", "t", ...}`` to its own file
in that directory; ``t`` is time.monotonic(), one clock for every process on a machine, so
the proxy's and the engines' events of one request line up (scripts/ttft_phases.py reads
them). Off (the default) a call costs one attribute test.
"""
from __future__ import annotations

import time
from typing import Any

from pd_cluster.trace_file import TraceFile

_TRACE = TraceFile("PD_TTFT_TRACE")


def enabled() -> bool:
    return _TRACE.enabled


def mark(rid: str, ev: str, **fields: Any) -> None:
    """Record event ``ev`` of request ``rid`` now (nothing when tracing is off)."""
    if _TRACE.enabled:
        _TRACE.write({"rid": rid, "ev": ev, "t": time.monotonic(), **fields})
