"""An engine's lending board: 64 bytes of shared memory through which an engine of the other
role on the same node borrows this engine's cores for a step (driver/core_lending.py): a
prefill engine a decode engine's for a prefill step, a decode engine a prefill engine's for a
decode step.

One file per lending engine (``{role}-{pid}.board``) in a per-user 0700 folder under the temp
dir, mapped by both processes. Each field has one writer, so no lock is needed for the fields;
a borrower holds an flock on the file while it borrows (one borrower at a time). Times are
CLOCK_MONOTONIC, which every process of a node shares.

  lender writes:   pid, cores (bit mask), pause_ok_until, revoked (borrow number)
  borrower writes: borrow_until, borrower thread id, its home cores, borrow number
"""
from __future__ import annotations

import fcntl
import mmap
import os
import struct
import tempfile
from pathlib import Path

from pd_cluster.private_files import open_private, private_dir

_SIZE = 64
_MAGIC = 0x70644C454E440001  # "pdLEND", version 1
# name -> (offset, struct format); each 8 bytes, aligned: one store each on every target.
_FIELDS = {"magic": (0, "<Q"), "pid": (8, "<q"), "cores": (16, "<Q"),
           "pause_ok_until": (24, "<d"), "borrow_until": (32, "<d"), "tid": (40, "<q"),
           "home": (48, "<Q"), "borrow_no": (56, "<I"), "revoked": (60, "<I")}


def board_dir() -> Path:
    return private_dir(Path(tempfile.gettempdir()) / f"pd-cluster-lend-{os.geteuid()}")


def mask(cores: tuple[int, ...] | list[int] | set[int]) -> int:
    return sum(1 << c for c in cores)


def cores_of(bits: int) -> set[int]:
    return {i for i in range(64) if bits >> i & 1}


class Board:
    """One lending board, mapped."""

    def __init__(self, path: Path, fd: int):
        self.path, self._fd = path, fd
        self._map = mmap.mmap(fd, _SIZE)

    @classmethod
    def create(cls, cores: tuple[int, ...], role: str = "decode",
               folder: Path | None = None) -> "Board":
        """The calling (``role``) engine process's board, lending ``cores``."""
        path = (folder or board_dir()) / f"{role}-{os.getpid()}.board"
        fd = open_private(path)
        os.ftruncate(fd, _SIZE)
        board = cls(path, fd)
        board.set("pid", os.getpid())
        board.set("cores", mask(cores))
        board.set("magic", _MAGIC)
        return board

    @classmethod
    def find(cls, role: str = "decode", folder: Path | None = None) -> list["Board"]:
        """The boards of live ``role`` engine processes of this user on this node (stale ones
        of dead processes are removed)."""
        out = []
        root = folder or board_dir()
        for path in sorted(root.glob(f"{role}-*.board")):
            try:
                fd = open_private(path, write=True)
            except OSError:
                continue
            if os.fstat(fd).st_size != _SIZE:
                os.close(fd)
                continue
            board = cls(path, fd)
            if board.get("magic") != _MAGIC or not _alive(board.get("pid")):
                if board.get("magic") == _MAGIC:
                    path.unlink(missing_ok=True)  # its lender died without removing it
                board.close()
                continue
            out.append(board)
        return out

    def get(self, name: str) -> float | int:
        off, fmt = _FIELDS[name]
        return struct.unpack_from(fmt, self._map, off)[0]

    def set(self, name: str, value: float | int) -> None:
        off, fmt = _FIELDS[name]
        struct.pack_into(fmt, self._map, off, value)

    def try_lock(self) -> bool:
        """Be this board's one borrower (until ``unlock`` or this process ends)."""
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False

    def unlock(self) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self, remove: bool = False) -> None:
        if remove:
            self.path.unlink(missing_ok=True)
        if not self._map.closed:
            self._map.close()
            os.close(self._fd)


def _alive(pid: int) -> bool:
    try:
        os.kill(int(pid), 0)
        return True
    except (ProcessLookupError, ValueError, OverflowError):
        return False
    except PermissionError:
        return True
