"""Per-request TTFT phase timestamps, switched on by ``PD_TTFT_TRACE=<directory>``.

Each process (proxy, engines) appends JSON lines ``{"rid", "ev", "t", ...}`` to its own file
in that directory; ``t`` is time.monotonic(), one clock for every process on a machine, so
the proxy's and the engines' events of one request line up (scripts/ttft_phases.py reads
them). Off (the default) a call costs one attribute test.
"""
from __future__ import annotations

import json
import os
import time
from typing import Any

_DIR = os.environ.get("PD_TTFT_TRACE") or None
_file: Any = None


def enabled() -> bool:
    return _DIR is not None


def mark(rid: str, ev: str, **fields: Any) -> None:
    """Record event ``ev`` of request ``rid`` now (nothing when tracing is off)."""
    global _file
    if _DIR is None:
        return
    if _file is None:
        os.makedirs(_DIR, exist_ok=True)
        # line-buffered: a process killed at shutdown still leaves its lines
        _file = open(os.path.join(_DIR, f"{os.getpid()}.jsonl"), "a", buffering=1)
    _file.write(json.dumps({"rid": rid, "ev": ev, "t": time.monotonic(), **fields}) + "\n")
