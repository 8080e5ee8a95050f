"""Start-up phase timestamps, switched on by ``PD_START_TRACE=<directory>``.

Each process (the launcher, engine actors, the proxy actor) appends JSON lines
``{"proc", "pid", "ev", "t"}`` to its own file in that directory; ``t`` is time.time() (one
clock for every process on a machine, and the measuring script's too), so the phases of one
start, across processes, line up (scripts/serve_startup.py reads them). Ray workers inherit
the variable from the launcher. Off (the default) a call costs one attribute test; this module
imports nothing heavy, so it can be the first import of any process.
"""
from __future__ import annotations

import os
import time

from pd_cluster.trace_file import TraceFile

_TRACE = TraceFile("PD_START_TRACE")
_started_marked = False


def enabled() -> bool:
    return _TRACE.enabled


def mark(proc: str, ev: str, t: float | None = None) -> None:
    """Record that process ``proc`` reached ``ev`` now (or at ``t``); nothing when off."""
    if _TRACE.enabled:
        _TRACE.write({"proc": proc, "pid": os.getpid(), "ev": ev,
                      "t": time.time() if t is None else t})


def process_start_time() -> float | None:
    """When this process was started (time.time() clock, 10 ms resolution): Linux only."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        since_boot = time.clock_gettime(time.CLOCK_BOOTTIME)  # the clock starttime counts on
        return time.time() - (since_boot - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def mark_process_start(proc: str) -> None:
    """The process's own start (before Python and Ray's worker set-up ran), once."""
    global _started_marked
    if _TRACE.enabled and not _started_marked:
        _started_marked = True
        t = process_start_time()
        if t is not None:
            mark(proc, "process start", t)
