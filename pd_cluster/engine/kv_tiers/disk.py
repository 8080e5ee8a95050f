"""The disk tier: KV blocks written behind the host tier, one file per block hash.

A host slot evicted from the host tier's LRU is copied in the step (ops.py: spills) and written
here by a background writer thread, to ``<path>/<hash hex>.kvb``: a header (magic, version,
a fingerprint of model / dtype / block shape / rank, the hash, the token ids, the payload's
length and CRC32) then the payload (the block's bytes, every layer in order). The index (hash
-> token ids, least recently used first) is the engine thread's; files beyond ``size`` GiB
go, oldest first. A read verifies everything: a corrupt, truncated, foreign or missing file is
a miss (counted), never an error. Reads run in the engine process at admission, which is why
the disk tier needs tensor_parallel_size 1 (one rank: the engine's own). Files of the same
fingerprint left by an earlier engine are indexed at start (block hashes are the same in every
process).

Faults: a path that cannot be made or written at start is a ValueError naming
``kv_offloading_disk.path``. At run time a failed write (a full disk, the directory gone: it is
made again for the next write) leaves no partial file, is counted (``write_errors``) and drops
its block from the index (a miss, not a failed read, from then on); a failed read is a miss.
Neither ever raises into the step. Temporary files carry the writer's pid (engines may share
the directory); those of dead processes are removed at start.

The files hold prompts' token ids in clear and are loaded into the KV cache (a CRC is no
proof against a writer), so they are this user's alone (pd_cluster/private_files.py): the
folder is made 0700 and must be ours and not writable by others (else the ValueError above);
files are created 0600, opened without following symlinks, and read only when ours and not
writable by others. A planted or foreign file is never indexed nor restored: it is skipped and
counted (``unsafe_files``; a miss when it replaced an indexed block).
"""
from __future__ import annotations

import contextlib
import errno
import logging
import os
import queue
import shutil
import struct
import tempfile
import threading
import zlib
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pd_cluster.private_files import UnsafePath, open_private, private_dir

logger = logging.getLogger(__name__)

MAGIC = b"PDKVBLK\0"
VERSION = 1
# magic, version, fingerprint, hash, token count, payload length, payload CRC32
HEADER = struct.Struct("<8sH16sQIQI")
SUFFIX = ".kvb"


class DiskTier:
    def __init__(self, path: str, size_gib: float, fingerprint: bytes, block_size: int,
                 payload_bytes: int) -> None:
        self.dir = Path(path).expanduser()
        try:
            private_dir(self.dir)
            with tempfile.TemporaryFile(dir=self.dir) as probe:  # writable, not just there
                probe.write(b"\0")
        except OSError as e:
            raise ValueError(f"kv_offloading_disk.path: cannot use {path!r} ({e})") from None
        self.fingerprint = fingerprint
        self.payload_bytes = payload_bytes
        self.file_bytes = HEADER.size + 4 * block_size + payload_bytes
        self.capacity = int(size_gib * 2**30) // self.file_bytes
        if self.capacity < 1:
            raise ValueError(f"kv_offloading_disk.size: {size_gib} GiB holds no KV block "
                             f"({self.file_bytes} bytes per file)")
        free = shutil.disk_usage(self.dir).free
        if free < size_gib * 2**30:  # writes beyond it fail (counted, dropped): not an error
            logger.warning("kv_offloading_disk.size: %s GiB, but %s has %.1f GiB free",
                           size_gib, self.dir, free / 2**30)
        self._index: OrderedDict[int, tuple[int, ...]] = OrderedDict()
        self._pending: dict[int, bytes] = {}  # written in a step, not yet on disk
        self._failed: set[int] = set()  # writes that failed, to drop from the index
        # on_drop(hash): an entry left the index because its write failed (the TierManager
        # reports it to routing; misses and LRU removals it sees itself).
        self.on_drop: Callable[[int], None] = lambda block_hash: None
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[str, int, tuple[int, ...], bytes] | None] = queue.Queue()
        self.saved_blocks = self.saved_bytes = self.evicted_blocks = 0
        self.restored_bytes = self.misses = self.write_errors = self.unsafe_files = 0
        self._last_errno: int | None = None
        self._scan()
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-writer",
                                        daemon=True)
        self._writer.start()

    # ---- the engine thread: index ----------------------------------------------------------
    def has(self, block_hash: int, token_ids: tuple[int, ...]) -> bool:
        if self._failed:
            self._drop_failed()
        return self._index.get(block_hash) == token_ids

    def hashes(self) -> list[int]:
        if self._failed:
            self._drop_failed()
        return list(self._index)

    def _drop_failed(self) -> None:
        """Forget blocks whose write failed (unless written again since: then it is queued)."""
        with self._lock:
            failed, self._failed = self._failed, set()
            failed -= self._pending.keys()
        for block_hash in failed:
            if self._index.pop(block_hash, None) is not None:
                self.on_drop(block_hash)

    def touch(self, block_hash: int) -> None:
        self._index.move_to_end(block_hash)

    def admit(self, block_hash: int, token_ids: tuple[int, ...]) -> list[int]:
        """Index a block about to be written; returns the hashes it displaces (oldest first)."""
        self._index[block_hash] = token_ids
        gone = []
        while len(self._index) > self.capacity:
            old, _ = self._index.popitem(last=False)
            gone.append(old)
            self.evicted_blocks += 1
            if old != block_hash:
                self._queue.put(("delete", old, (), b""))
        return gone

    def read(self, block_hash: int, token_ids: tuple[int, ...]) -> bytearray | None:
        """The block's verified payload, or None (a miss: the entry is dropped)."""
        with self._lock:
            payload = self._pending.get(block_hash)
        if payload is None:
            payload = self._read_file(block_hash, token_ids)
        if payload is None:
            self.misses += 1
            self._index.pop(block_hash, None)
            self._queue.put(("delete", block_hash, (), b""))
            return None
        self._index.move_to_end(block_hash)
        self.restored_bytes += len(payload)
        return bytearray(payload)

    def stats(self) -> dict[str, Any]:
        return {"kv_offload_disk_blocks_used": len(self._index),
                "kv_offload_saved_blocks_disk": self.saved_blocks,
                "kv_offload_evicted_blocks_disk": self.evicted_blocks,
                "kv_offload_bytes_saved_disk": self.saved_bytes,
                "kv_offload_bytes_restored_disk": self.restored_bytes,
                "kv_offload_disk_misses": self.misses,
                "kv_offload_disk_write_errors": self.write_errors,
                "kv_offload_disk_unsafe_files": self.unsafe_files}

    # ---- the step (rank 0's store) ---------------------------------------------------------
    def write(self, block_hash: int, token_ids: tuple[int, ...], payload: bytes) -> None:
        """Queue a block's bytes (already copied out of its host slot) for the writer."""
        with self._lock:
            self._pending[block_hash] = payload
        self._queue.put(("write", block_hash, token_ids, payload))

    def wait_idle(self, timeout: float) -> bool:
        """Every queued write and delete done (True) within ``timeout`` seconds."""
        q = self._queue
        with q.all_tasks_done:
            return q.all_tasks_done.wait_for(lambda: q.unfinished_tasks == 0, timeout)

    def close(self, timeout: float = 10.0) -> None:
        self._queue.put(None)
        self._writer.join(timeout)

    # ---- files -----------------------------------------------------------------------------
    def file_of(self, block_hash: int) -> Path:
        return self.dir / f"{block_hash:016x}{SUFFIX}"

    def _encode(self, block_hash: int, token_ids: tuple[int, ...], payload: bytes) -> bytes:
        head = HEADER.pack(MAGIC, VERSION, self.fingerprint, block_hash, len(token_ids),
                           len(payload), zlib.crc32(payload))
        return head + struct.pack(f"<{len(token_ids)}i", *token_ids) + payload

    def _header(self, data: bytes) -> tuple[int, tuple[int, ...], int, int] | None:
        """(hash, token ids, payload length, crc) of a file of this engine's kind, else None."""
        if len(data) < HEADER.size:
            return None
        magic, version, fp, block_hash, n, length, crc = HEADER.unpack_from(data)
        if magic != MAGIC or version != VERSION or fp != self.fingerprint:
            return None
        if len(data) < HEADER.size + 4 * n:
            return None
        return (block_hash, struct.unpack_from(f"<{n}i", data, HEADER.size), length, crc)

    def _open(self, path: Path, limit: int = -1) -> bytes:
        """Up to ``limit`` bytes (-1: all) of a file of ours (UnsafePath, counted, else)."""
        try:
            fd = open_private(path, write=False)
        except UnsafePath:
            self.unsafe_files += 1
            raise
        with os.fdopen(fd, "rb") as fh:
            return fh.read(limit)

    def _read_file(self, block_hash: int, token_ids: tuple[int, ...]) -> bytes | None:
        try:
            data = self._open(self.file_of(block_hash))
        except OSError:  # UnsafePath among them
            return None
        head = self._header(data)
        if head is None or head[0] != block_hash or head[1] != token_ids:
            return None
        start = HEADER.size + 4 * len(token_ids)
        payload = data[start:]
        if head[2] != self.payload_bytes or len(payload) != head[2] \
                or zlib.crc32(payload) != head[3]:
            return None
        return payload

    def _scan(self) -> None:
        """Index this engine's kind of files an earlier engine left (oldest first)."""
        for f in self.dir.glob("*.tmp"):
            if not _writer_alive(f):
                with contextlib.suppress(OSError):
                    f.unlink(missing_ok=True)
        found = []
        for f in self.dir.glob(f"*{SUFFIX}"):
            try:
                head = self._header(self._open(f, HEADER.size + 4 * 128))
                mtime = f.stat().st_mtime
            except OSError:  # UnsafePath among them: never indexed
                continue
            if head is not None and f.name == self.file_of(head[0]).name:
                found.append((mtime, head[0], tuple(head[1])))
        for _, block_hash, token_ids in sorted(found):
            # Over capacity at start: the oldest are trimmed (deleted), not counted evicted.
            self.evicted_blocks -= len(self.admit(block_hash, token_ids))

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                op, block_hash, token_ids, payload = item
                if op == "write":
                    self._write_file(block_hash, token_ids, payload)
                else:
                    self.file_of(block_hash).unlink(missing_ok=True)
            except OSError as e:  # a full or failing disk: the block is a miss later
                self.write_errors += 1
                # Once per kind of error: a full disk fails every write.
                log = logger.warning if e.errno != self._last_errno else logger.debug
                self._last_errno = e.errno
                log("KV disk tier: a write failed (%d so far; dropped): %s",
                    self.write_errors, e)
            finally:
                self._queue.task_done()

    def _write_file(self, block_hash: int, token_ids: tuple[int, ...], payload: bytes) -> None:
        path = self.file_of(block_hash)
        tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp")
        ok = False
        try:
            data = self._encode(block_hash, token_ids, payload)
            try:
                self._write_bytes(tmp, data)
            except FileNotFoundError:  # the directory was removed: make it again, once
                private_dir(self.dir)
                self._write_bytes(tmp, data)
            os.replace(tmp, path)
            ok = True
            self.saved_blocks += 1
            self.saved_bytes += len(payload)
        finally:
            if not ok:
                with contextlib.suppress(OSError):
                    tmp.unlink(missing_ok=True)  # no partial file left taking space
            with self._lock:
                if ok:
                    self._failed.discard(block_hash)  # an earlier failure of this hash
                if self._pending.get(block_hash) is payload:
                    del self._pending[block_hash]
                    if not ok:
                        self._failed.add(block_hash)

    @staticmethod
    def _write_bytes(path: Path, data: bytes) -> None:
        # 0600, never through a symlink; a stale file of ours (a reused pid) is cut here,
        # after open_private checked it, not by O_TRUNC before.
        with os.fdopen(open_private(path), "wb") as fh:
            fh.truncate(0)
            fh.write(data)


def _writer_alive(tmp: Path) -> bool:
    """A temporary file's writer (``<hash>.<pid>.tmp``) is a live process."""
    try:
        os.kill(int(tmp.name.split(".")[1]), 0)
    except (IndexError, ValueError):
        return False
    except PermissionError:  # alive, another user's
        return True
    except OSError as e:
        return e.errno != errno.ESRCH
    return True
