"""The compiled-model artifacts on disk (``compile_cache.artifact_dir()``): read only when they
are this user's and not writable by others, written whole, and pruned.

An artifact is a pickle: loading one that another user could write runs their code. So a read
opens it without following symlinks and checks its owner and mode on the open descriptor
(``private_files``); one that fails is not loaded (a warning, once per process) and the caller
compiles afresh. A write goes to a 0600 temp file renamed over the artifact, so a reader (or
the pruner) never sees a partial one.

Each read or write sets the artifact's times to now, so its mtime is when it was last used.
Once per process, after the engine's own artifact is loaded or saved, ``prune_once`` removes
artifacts unused for ``$PD_CLUSTER_COMPILE_CACHE_DAYS`` (default 30) and then the least
recently used until the folder holds at most ``$PD_CLUSTER_COMPILE_CACHE_GB`` GiB of them
(default 2). The newest is always kept, and one whose lock another process holds (it is
compiling or loading it) is skipped.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from pd_cluster.private_files import UnsafePath, open_private

logger = logging.getLogger(__name__)

SUFFIX = ".aot"
MAX_GB_ENV = "PD_CLUSTER_COMPILE_CACHE_GB"
MAX_DAYS_ENV = "PD_CLUSTER_COMPILE_CACHE_DAYS"
_DEFAULT_GB = 2.0
_DEFAULT_DAYS = 30.0
# A temp file this old is a writer's leftover (killed between write and rename): no compile
# takes a day.
_STALE_TMP_S = 24 * 3600.0

_state_lock = threading.Lock()
_warned: set[str] = set()  # unsafe paths already reported by this process
_pruned: set[Path] = set()  # folders already pruned by this process


@dataclass(frozen=True)
class Limits:
    max_bytes: int
    max_age_s: float


def limits_from_env() -> Limits:
    """The pruning limits; ValueError naming the variable when one is not a number >= 0."""
    def number(env: str, default: float) -> float:
        raw = os.environ.get(env, "").strip()
        if not raw:
            return default
        try:
            value = float(raw)
        except ValueError:
            value = -1.0
        if not value >= 0:  # also refuses nan
            raise ValueError(f"{env} must be a number >= 0, got {raw!r}")
        return value
    return Limits(max_bytes=int(number(MAX_GB_ENV, _DEFAULT_GB) * 2**30),
                  max_age_s=number(MAX_DAYS_ENV, _DEFAULT_DAYS) * 86400.0)


def warn_unsafe(error: UnsafePath) -> None:
    """Log why a cache path is not used, once per process and path."""
    with _state_lock:
        if str(error) in _warned:
            return
        _warned.add(str(error))
    logger.warning("not using the compiled-model cache: %s (compiling afresh)", error)


def read_artifact(path: Path) -> bytes | None:
    """The artifact's bytes (None if there is none), its use recorded in its mtime. Raises
    UnsafePath for a symlink, another user's file or one others may write."""
    try:
        fd = open_private(path, write=False)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as f:
        data = f.read()
        os.utime(f.fileno())  # last used: now (atime alone is unreliable under relatime)
    return data


def write_artifact(path: Path, data: bytes) -> None:
    """``data`` as ``path``, atomically: a 0600 temp file beside it, then a rename."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.unlink(missing_ok=True)  # a dead process's with our pid (the folder is ours alone)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def prune_once(folder: Path, limits: Limits) -> list[Path]:
    """``prune(folder, limits)`` the first time this process asks for ``folder``."""
    with _state_lock:
        if folder in _pruned:
            return []
        _pruned.add(folder)
    try:
        return prune(folder, limits)
    except OSError as e:  # a cache we cannot list or delete from: the start goes on
        logger.warning("pruning the compiled-model cache %s failed: %s", folder, e)
        return []


def prune(folder: Path, limits: Limits, now: float | None = None) -> list[Path]:
    """Remove artifacts unused for longer than ``limits.max_age_s``, then the least recently
    used until the rest fit in ``limits.max_bytes``; the newest always stays. Returns the
    artifacts removed."""
    now = time.time() if now is None else now
    entries = []
    for path in folder.glob(f"*{SUFFIX}"):
        try:
            st = path.lstat()
        except FileNotFoundError:  # pruned or replaced by another process meanwhile
            continue
        entries.append((st.st_mtime, st.st_size, path))
    entries.sort(reverse=True)  # newest first
    removed, kept_bytes = [], 0
    for i, (mtime, size, path) in enumerate(entries):
        too_old = now - mtime > limits.max_age_s
        too_big = kept_bytes + size > limits.max_bytes
        if i == 0 or not (too_old or too_big) or not _remove_unless_busy(path):
            kept_bytes += size
        else:
            removed.append(path)
    # Writers' leftovers, and probe records (compile_cache.py) of CPUs or torches long gone.
    leftovers = [(p, _STALE_TMP_S) for p in folder.glob(".*.tmp")]
    leftovers += [(p, limits.max_age_s) for p in folder.glob("vec-isa-*.json")]
    for path, max_age in leftovers:
        try:
            if now - path.lstat().st_mtime > max_age:
                path.unlink()
        except FileNotFoundError:
            pass
    if removed:
        logger.info("compiled-model cache %s: removed %d unused artifact(s), %d MiB kept",
                    folder, len(removed), kept_bytes >> 20)
    return removed


def _remove_unless_busy(path: Path) -> bool:
    """Delete ``path`` and its lock file, holding the lock that compiled_model.py takes to
    compile or load it; False (kept) when another process holds it."""
    from filelock import FileLock, Timeout
    lock = FileLock(f"{path}.lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        return False
    try:
        path.unlink(missing_ok=True)
        # A process already waiting on this lock file gets it after us and finds no artifact
        # (it compiles); one that opens a new lock file meanwhile may compile beside it: a
        # repeated compile, never a wrong load (artifacts are renamed in whole).
        Path(lock.lock_file).unlink(missing_ok=True)
    finally:
        lock.release()
    return True
