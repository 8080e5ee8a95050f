"""Folders and files only this user may touch, for what pd-cluster reuses across runs and
shares between its own processes (kernel builds, compiled graphs, core locks, disk-tier KV).

On a shared machine another user can pre-create a folder we would use, or plant a symlink or
a file in it: loading a pickle or a ``.so`` from there runs their code, and opening a planted
symlink for writing truncates their target. So: folders are made 0700 and must be ours and
not writable by others; files are opened with O_NOFOLLOW, created 0600, never truncated on
open, and checked for owner and mode before their contents are trusted.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path


class UnsafePath(PermissionError):
    """A path that another user owns or may write to (the message names it and why)."""


def _check(st: os.stat_result, path: Path, kind: str) -> None:
    if st.st_uid != os.geteuid():
        raise UnsafePath(f"{path}: {kind} owned by uid {st.st_uid}, not this user "
                         f"({os.geteuid()}); remove it or point the cache elsewhere")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafePath(f"{path}: {kind} writable by other users "
                         f"(mode {stat.S_IMODE(st.st_mode):o}); chmod go-w it")


def private_dir(path: Path | str) -> Path:
    """``path`` as a folder of this user's (made 0700 with its missing parents; an existing
    one must be ours, not a symlink, and not writable by others). Raises UnsafePath."""
    path = Path(path)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise UnsafePath(f"{path}: not a plain folder (a symlink or a file)")
    _check(st, path, "folder")
    return path


def check_private_file(path: Path | str) -> Path:
    """``path`` is a regular file of ours that others cannot write (not a symlink): check it
    before loading code or data from it. Raises UnsafePath (FileNotFoundError if missing)."""
    path = Path(path)
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        raise UnsafePath(f"{path}: not a regular file (a symlink or a special file)")
    _check(st, path, "file")
    return path


def open_private(path: Path | str, write: bool = True) -> int:
    """A file descriptor for ``path``, never through a symlink, created 0600 if missing and
    never truncated (``write``: read-write, else read-only); an existing file must pass
    ``check_private_file``. The caller closes it (``os.fdopen`` wraps it)."""
    flags = os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_RDWR | os.O_CREAT if write else os.O_RDONLY)
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as e:
        if e.errno == 40:  # ELOOP: the last component is a symlink
            raise UnsafePath(f"{path}: a symlink, not a file of ours") from e
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePath(f"{path}: not a regular file")
        _check(st, Path(path), "file")
    except BaseException:
        os.close(fd)
        raise
    return fd
