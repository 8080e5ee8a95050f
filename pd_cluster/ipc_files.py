"""Socket files this project's processes leave in a directory (the temp dir, by default):
each is named ``<prefix><owner pid>-<random>``, so a file whose owner is dead can be told
from one in use and removed. An engine that crashes or is killed (SIGKILL) closes nothing;
the next engine that starts on the node sweeps what it left (the session sockets,
serving/engine/session_sockets.py; the ZMQ pipe's ipc endpoint, connectors/pipes).
"""
from __future__ import annotations

import os
import stat


def sweep_stale(directory: str, prefix: str) -> list[str]:
    """Remove the socket files named ``<prefix><pid>-...`` in ``directory`` whose process is
    gone; returns the paths removed. Only sockets: a regular file of that name is kept."""
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(prefix):
            continue
        pid = name[len(prefix):].split("-", 1)[0]
        if not pid.isdigit() or pid_alive(int(pid)):
            continue
        path = os.path.join(directory, name)
        try:
            if stat.S_ISSOCK(os.lstat(path).st_mode):
                os.unlink(path)
                removed.append(path)
        except OSError:  # another process swept it first
            pass
    return removed


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by someone else
        return True
    return True
