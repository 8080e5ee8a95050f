"""What this machine allows a same-host KV transfer with a per-write MAC, for
bench_kv_transfer.py's shm part (issue 42): the shm pipe's work without its protocol.

Two processes map one /dev/shm file holding a source and a destination cache. Per layer, this
process copies the source blocks into the destination's blocks (same grant as the pipe's)
and hashes them in the same pass (the GHASH kernel's fused copy, as the shm pipe's producer),
then tells the other process over a multiprocessing pipe, which hashes that layer's
destination blocks (as the decode engine's check); timed from the first copy until the other
process hashed the last layer. No grant, no notifications, no Python per block: the ceiling
of the pipe's design here. Needs the CPU kernels (kernels/ghash_copy.py). Importable with
scripts/ on sys.path.
"""
from __future__ import annotations

import mmap
import os
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

from pipe_raw import bench_context

TIMEOUT_S = 120.0
_KEY, _NONCE = bytes(32), bytes(12)


def _layers(buf: torch.Tensor, layers: int, parts: int, blocks: int, block: int
            ) -> list[torch.Tensor]:
    per = parts * blocks * block
    return [buf[i * per:(i + 1) * per].view(parts, blocks, block) for i in range(layers)]


def _checker(conn: Any, path: str, nbytes: int, shape: tuple[int, int, int, int]) -> None:
    """The other process: hashes each layer's destination blocks when told."""
    from kernels import ghash_copy
    torch.set_num_threads(1)
    ghash_copy.available(wait=True)
    fd = os.open(path, os.O_RDWR)
    buf = torch.frombuffer(mmap.mmap(fd, nbytes), dtype=torch.uint8)
    os.close(fd)
    dst = _layers(buf[nbytes // 2:], *shape)
    conn.send("mapped")
    while True:
        msg = conn.recv()
        if msg is None:
            return
        layer, ids, last = msg
        mac = ghash_copy.Gmac(_KEY, _NONCE)
        mac.hash_blocks(dst[layer], ids)
        mac.tag()
        if last:
            conn.send("checked")


@contextmanager
def shared_peer(name: str, nbytes: int, target: Callable, *args: Any
                ) -> Iterator[tuple[torch.Tensor, Any]]:
    """A /dev/shm file of ``nbytes`` mapped here, and a process running ``target(conn, path,
    nbytes, *args)`` that maps it and sends "mapped": yields (the buffer, our end of the
    pipe); on exit the process is told None and joined, the file removed."""
    from connectors.pipes.shm_arena import shm_folder
    path = str(shm_folder("/dev/shm") / f"{name}-{os.getpid()}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    ctx = bench_context()
    here, there = ctx.Pipe()
    proc = None
    try:
        os.posix_fallocate(fd, 0, nbytes)
        buf = torch.frombuffer(mmap.mmap(fd, nbytes), dtype=torch.uint8)
        proc = ctx.Process(target=target, args=(there, path, nbytes, *args), daemon=True)
        proc.start()
        if not here.poll(TIMEOUT_S) or here.recv() != "mapped":
            raise TimeoutError(f"{name}: the other process did not start")
        yield buf, here
    finally:
        if proc is not None:
            here.send(None)
            proc.join(timeout=30)
        os.close(fd)
        os.unlink(path)


def ceiling(src_ids: list[int], dst_ids: list[int], layers: int, parts: int, blocks: int,
            block: int, repeats: int) -> float | None:
    """Best bytes/s of the fused copy + the other process's check over ``layers`` layers of
    ``src_ids`` -> ``dst_ids`` (``blocks`` per cache part of ``block`` bytes); None without
    the kernel."""
    from kernels import ghash_copy
    if not ghash_copy.available(wait=True):
        return None
    half = layers * parts * blocks * block
    shape = (layers, parts, blocks, block)
    with shared_peer("ceiling-bench", 2 * half, _checker, shape) as (buf, here):
        buf[:half].random_(0, 255)
        src, dst = _layers(buf[:half], *shape), _layers(buf[half:], *shape)
        best = 0.0
        for _ in range(repeats + 1):  # the first round faults the pages in
            t0 = time.perf_counter()
            for layer in range(layers):
                mac = ghash_copy.Gmac(_KEY, _NONCE)
                mac.copy_blocks(src[layer], dst[layer], src_ids, dst_ids)
                mac.tag()
                here.send((layer, dst_ids, layer == layers - 1))
            if not here.poll(TIMEOUT_S) or here.recv() != "checked":
                raise TimeoutError("ceiling checker did not answer")
            best = max(best, layers * parts * len(src_ids) * block / (time.perf_counter() - t0))
        return best
