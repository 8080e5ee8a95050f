"""Lowering one thread's CPU priority (Linux: nice is per thread, and the processes a thread
starts inherit it), so background builds never take cores from an engine's steps."""
from __future__ import annotations

import os
import threading

BUILD_NICE = 10  # background builds and compiles (engine/background_compile.py's child too)


def lower_this_thread(by: int) -> int:
    """The calling thread ``by`` nice levels below where it is (19 at most), as the compile
    child's ``os.nice``: an absolute level would raise it above a server started niced (a
    root one may). Returns the thread's level now."""
    tid = threading.get_native_id()
    level = min(19, os.getpriority(os.PRIO_PROCESS, tid) + by)
    os.setpriority(os.PRIO_PROCESS, tid, level)
    return level
