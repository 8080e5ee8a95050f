"""The on-disk cache of CPU kernel builds: one private folder per build key, a lock per build,
and pruning of old builds.

Layout under the cache folder (``private_dir``: 0700, ours): ``<name>/`` (torch's build
folder, holding ``<name>.so``), and beside it ``<name>.flock``, held exclusively while a
process builds or loads that build (so no two build there at once), and ``<name>.inuse``,
held shared by every process that loaded it, for its lifetime. The pruner removes a build
only when it wins both locks: never one being built or in use.
"""
from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import stat
import time
from pathlib import Path
from typing import Iterator

from pd_cluster.private_files import UnsafePath, check_private_file, open_private, private_dir

logger = logging.getLogger(__name__)

KEEP_BUILDS = 8  # builds kept besides the one in use (other torch versions, ISA variants)
MAX_AGE_S = 30 * 86400.0  # builds unused for longer go, however few there are
PREFIX = "pd_cluster_cpu_"


def _lock_path(build: Path) -> Path:
    return build.parent / f"{build.name}.flock"


def _use_path(build: Path) -> Path:
    return build.parent / f"{build.name}.inuse"


def hold_in_use(build: Path) -> int:
    """A shared lock on ``build`` that keeps the pruner off it while this process runs: the
    caller keeps the returned descriptor open (the OS drops the lock when the process ends).
    Take it under ``build_lock`` (the pruner removes this file only under that lock)."""
    fd = open_private(_use_path(build))
    fcntl.flock(fd, fcntl.LOCK_SH)  # never blocks for long: the pruner only tries, NB
    return fd


@contextlib.contextmanager
def build_lock(build: Path, timeout_s: float) -> Iterator[None]:
    """Holds ``build``'s flock (waited on with a bound; the OS releases it when its holder
    dies, unlike torch's own lock file). Opened without following symlinks, 0600."""
    deadline = time.monotonic() + timeout_s
    while True:
        fd = open_private(_lock_path(build))
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"another process has been building {build} for "
                                           f"over {timeout_s:.0f} s") from None
                    time.sleep(0.2)  # another process is building: poll its lock
            # The pruner unlinks a lock file it removes a build with: a lock won on an
            # unlinked file guards nothing, so take the file now at that path instead.
            try:
                same = os.stat(_lock_path(build)).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                yield
                return
        finally:
            os.close(fd)  # closing releases the flock


def prepare(build: Path) -> None:
    """Makes ``build`` a private folder whose ``.so`` (if any) is safe to load: a library
    that is not a regular file of ours, writable only by us, is removed with its folder (and
    rebuilt), with a warning. Call under ``build_lock``. Raises UnsafePath when the folder
    itself is not ours."""
    private_dir(build)
    so = build / f"{build.name}.so"
    if not os.path.lexists(so):
        return
    try:
        check_private_file(so)
    except UnsafePath as e:
        logger.warning("CPU kernel cache: not loading %s (%s); rebuilding it", so, e)
        shutil.rmtree(build)
        private_dir(build)


def seal(build: Path) -> None:
    """After a build: its ``.so`` writable by us alone (the compiler made it with the
    umask's mode, group-writable under umask 002), so ``prepare`` accepts it next time."""
    so = build / f"{build.name}.so"
    mode = os.stat(so).st_mode
    if mode & 0o022:
        os.chmod(so, mode & 0o7755)
    os.utime(build)  # the LRU order: last used now


def prune(root: Path, keep_name: str, keep: int = KEEP_BUILDS,
          max_age_s: float = MAX_AGE_S) -> list[str]:
    """Removes the builds in ``root`` other than ``keep_name`` beyond the ``keep`` most
    recently used, and any unused for ``max_age_s``; a build whose lock another process holds
    (building or loading it) is skipped. Returns the names removed."""
    used: dict[Path, float] = {}
    for p in root.iterdir():
        if p.name.startswith(PREFIX) and p.name != keep_name:
            try:
                st = p.lstat()
            except FileNotFoundError:  # another process pruned it just now
                continue
            if stat.S_ISDIR(st.st_mode):
                used[p] = st.st_mtime
    now = time.time()
    removed = []
    for i, build in enumerate(sorted(used, key=used.__getitem__, reverse=True)):
        if i < keep and now - used[build] < max_age_s:
            continue
        if _remove_unless_locked(build):
            removed.append(build.name)
    return removed


def _remove_unless_locked(build: Path) -> bool:
    fds: list[int] = []
    try:
        for path in (_lock_path(build), _use_path(build)):
            fds.append(open_private(path))
            fcntl.flock(fds[-1], fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False  # being built, or loaded by a running process
    except OSError as e:  # UnsafePath included: not ours to judge, leave it
        logger.warning("CPU kernel cache: not pruning %s (%s)", build, e)
        return False
    else:
        shutil.rmtree(build, ignore_errors=True)
        # (lockers re-check that the file they locked is still the one at the path)
        _lock_path(build).unlink(missing_ok=True)
        _use_path(build).unlink(missing_ok=True)
        return True
    finally:
        for fd in fds:
            os.close(fd)
