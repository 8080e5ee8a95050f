"""The shm pipe's shared memory: the decode engine's KV cache moved into one file under
/dev/shm, and a prefill engine's map of it.

Why a file of ours rather than torch's shared memory: torch shares a storage by passing a
file descriptor through its own multiprocessing sockets (or by a name it picks, with the
mode it picks); our peers are separate engines that meet through the pipe's handshake, so
what travels is a file name, and the file is created the way private_files.py makes every
file other processes of ours open: in a 0700 folder of this user, 0600, O_EXCL, never
through a symlink, its owner and mode checked by the producer before it maps it.

The consumer keeps the file open with a shared flock while it lives; a consumer killed by
SIGKILL leaves its file behind, and the next consumer to start removes files whose lock it
can take (their owner is gone), so a crash costs /dev/shm space only until the next start.
The memory is reserved up front (posix_fallocate): a /dev/shm too small for the cache fails
at start with the sizes, not with SIGBUS on a later write.
"""
from __future__ import annotations

import fcntl
import mmap
import os
import re
import socket
import stat
import uuid
from pathlib import Path
from typing import Optional, Sequence

import torch

from connectors.pipes.base import PipeError
from connectors.pipes.nixl_layout import CacheLayout, LayerLayout
from pd_cluster.private_files import UnsafePath, private_dir

_ALIGN = 4096  # each layer starts on a page: whole-page copies, no false sharing
_NAME = re.compile(r"kv-[0-9]+-[0-9a-f]{32}")  # what a consumer may name (no paths)


def host_id() -> str:
    """This host as both ends see it: hostname and boot id (a container on another host, or
    the same name after a reboot, differs)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def shm_folder(base: str) -> Path:
    """This user's folder for shared KV caches under ``base`` (made 0700; UnsafePath if
    another user owns it or may write to it)."""
    return private_dir(Path(base) / f"pd-cluster-kv-{os.geteuid()}")


def sweep_stale(folder: Path) -> int:
    """Remove cache files whose consumer is gone (its lock is free); returns how many."""
    removed = 0
    for entry in folder.iterdir():
        if not _NAME.fullmatch(entry.name):
            continue
        try:
            fd = os.open(entry, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # a live consumer holds it
        finally:
            os.close(fd)
        entry.unlink(missing_ok=True)
        removed += 1
    return removed


class SharedCache:
    """Consumer: its KV cache tensors, moved into a shared file (the engine's tensors keep
    their identity, shape and contents; only their storage moves)."""

    def __init__(self, base: str, caches: Sequence[torch.Tensor]) -> None:
        if any(c.device.type != "cpu" for c in caches):
            raise PipeError("kv_transfer.pipe: shm needs the decode engine's KV cache in host "
                            "memory (CPU engines); use zmq or nixl for a CUDA cache")
        folder = shm_folder(base)
        sweep_stale(folder)
        # With KV cache groups one tensor serves several layers (cache_engine.py): it moves
        # once, and each of its layers points at the same place.
        first: dict[int, int] = {}  # id(tensor) -> offset
        offsets, size = [], 0
        for c in caches:
            if id(c) not in first:
                first[id(c)] = size
                size += -(-c.nbytes // _ALIGN) * _ALIGN
            offsets.append(first[id(c)])
        st = os.statvfs(folder)
        if st.f_bavail * st.f_frsize < size:
            raise PipeError(f"kv_transfer.pipe: shm needs {size / 2**20:.0f} MiB free in "
                            f"{base} for the KV cache, it has "
                            f"{st.f_bavail * st.f_frsize / 2**20:.0f} MiB (grow /dev/shm, "
                            f"e.g. docker --shm-size, or lower the cache size)")
        self.name = f"kv-{os.getpid()}-{uuid.uuid4().hex}"
        self.path = folder / self.name
        self.size = size
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                     | os.O_CLOEXEC, 0o600)
        self._fd: Optional[int] = fd  # held open with a shared lock while we live
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            os.posix_fallocate(fd, 0, size)
            mem = torch.frombuffer(mmap.mmap(fd, size), dtype=torch.uint8)
            layers, moved = [], set()
            for c, off in zip(caches, offsets):
                if id(c) not in moved:
                    moved.add(id(c))
                    shared = mem[off:off + c.nbytes].view(c.dtype).view(c.shape)
                    shared.copy_(c)
                    c.set_(shared)  # the engine's tensor now lives in the file
                layers.append(LayerLayout(off, c.shape[0], c.shape[1], c[0, 0].nbytes, 0))
        except BaseException:
            self.close()
            raise
        self.layout = CacheLayout("DRAM", layers)  # addr: the layer's offset in the file

    def close(self) -> None:
        """Remove the file (producers' maps and our tensors stay valid until dropped)."""
        if self._fd is not None:
            self.path.unlink(missing_ok=True)
            os.close(self._fd)
            self._fd = None


def open_peer_cache(base: str, name: str, size: int, layout: CacheLayout
                    ) -> list[torch.Tensor]:
    """Producer: map a consumer's cache file; returns per layer a [parts, num_blocks,
    block_bytes] uint8 view. The name must be a bare cache file name in our own folder, and
    the file ours, 0600-like (no group/other access), regular, exactly ``size`` bytes, with
    every layer inside it: UnsafePath or ValueError otherwise."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"not a cache file name: {str(name)[:80]!r}")
    path = shm_folder(base) / name
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePath(f"{path}: not a regular file")
        if st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise UnsafePath(f"{path}: owned by uid {st.st_uid} with mode "
                             f"{stat.S_IMODE(st.st_mode):o}; expected ours and 0600")
        if st.st_size != size:
            raise ValueError(f"{path}: {st.st_size} bytes, the consumer said {size}")
        for i, lay in enumerate(layout.layers):
            if lay.addr < 0 or lay.addr + lay.parts * lay.num_blocks * lay.block_bytes > size:
                raise ValueError(f"layer {i} lies outside the cache file")
        # MAP_POPULATE: the page tables are filled now, at the handshake, not by a fault
        # per 4 KiB page inside the first transfers.
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        mem = torch.frombuffer(mmap.mmap(fd, size, flags=flags), dtype=torch.uint8)
    finally:
        os.close(fd)
    return [mem[lay.addr:lay.addr + lay.parts * lay.num_blocks * lay.block_bytes]
            .view(lay.parts, lay.num_blocks, lay.block_bytes) for lay in layout.layers]
