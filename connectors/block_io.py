"""Moving KV blocks in and out of a paged cache: block runs, gather/scatter, send buffers."""
from __future__ import annotations

import threading
from collections import defaultdict
from concurrent.futures import Future
from typing import NamedTuple

import torch

Key = tuple[tuple[int, ...], torch.dtype, torch.device, bool]


class BufferPool:
    """Reusable send buffers, keyed by what they are (shape, dtype, device, pinned): a device
    gather buffer and its pinned host copy are two different buffers, each reused as such."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes  # idle buffers kept at most; beyond that they are dropped
        self._free: dict[Key, list[torch.Tensor]] = defaultdict(list)
        self._idle_bytes = 0
        self._lock = threading.Lock()

    def acquire(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                pin: bool = False) -> torch.Tensor:
        key = (tuple(shape), dtype, torch.device(device), pin)
        with self._lock:
            if self._free[key]:
                buf = self._free[key].pop()
                self._idle_bytes -= buf.nbytes
                return buf
        return torch.empty(shape, dtype=dtype, device=device, pin_memory=pin)

    def release_when_done(self, buf: torch.Tensor, future: Future) -> None:
        future.add_done_callback(lambda _f: self.release(buf))

    def release(self, buf: torch.Tensor) -> None:
        pinned = buf.device.type == "cpu" and buf.is_pinned()
        key = (tuple(buf.shape), buf.dtype, buf.device, pinned)
        with self._lock:
            if self._idle_bytes + buf.nbytes > self.max_bytes:
                return
            self._free[key].append(buf)
            self._idle_bytes += buf.nbytes

    @property
    def idle_bytes(self) -> int:
        return self._idle_bytes


def gather_blocks(kv_layer: torch.Tensor, block_ids: tuple[int, ...], out: torch.Tensor) -> None:
    """Triton kernel on CUDA, plain torch elsewhere (never the Triton interpreter)."""
    from kernels.block_copy import gather_kv_blocks, gather_kv_blocks_torch
    (gather_kv_blocks if kv_layer.is_cuda else gather_kv_blocks_torch)(kv_layer, block_ids, out=out)


def copy_rows(dst: torch.Tensor, ids: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[ids] = src`` along dim 0 (KV blocks into a paged cache, src of dst's dtype). Host
    tensors: numpy's fancy assignment, one C loop of row copies; torch's index_copy_ walks
    elements (16 KiB blocks here: 0.7 ms per 8 MiB against 1.8 ms for float32, 12.8 ms for
    bytes: FP8 is copied as bytes)."""
    if (dst.device.type == "cpu" and src.device.type == "cpu" and dst.is_contiguous()
            and src.is_contiguous() and len(ids) == src.shape[0]):
        rows = dst.reshape(dst.shape[0], -1).view(torch.uint8).numpy()
        rows[ids.numpy()] = src.reshape(src.shape[0], -1).view(torch.uint8).numpy()
        return
    from kernels.kv_quant import as_bytes
    as_bytes(dst).index_copy_(0, ids.to(dst.device), as_bytes(src.to(dst.device, dst.dtype)))


def scatter_blocks(buffer: torch.Tensor, kv_layer: torch.Tensor, block_ids: torch.Tensor) -> None:
    if not kv_layer.is_cuda and buffer.dtype == kv_layer.dtype:
        for part in range(kv_layer.shape[0]):  # every part (K and V, or the one latent)
            copy_rows(kv_layer[part], block_ids, buffer[part])
        return
    from kernels.block_copy import scatter_kv_blocks, scatter_kv_blocks_torch
    (scatter_kv_blocks if kv_layer.is_cuda else scatter_kv_blocks_torch)(buffer, kv_layer, block_ids)


class BlockRun(NamedTuple):
    """A maximal run of consecutive block ids within a request's block list."""
    first: int  # index in the list of the run's first entry
    count: int  # how many blocks
    low: int  # the lowest block id of the run
    descending: bool  # ids go down along the list (offsets count from the high end)


def contiguous_runs(block_ids: tuple[int, ...]) -> list[BlockRun]:
    """Maximal runs of consecutive ids, ascending or descending."""
    runs: list[BlockRun] = []
    i = 0
    while i < len(block_ids):
        j = i + 1
        step = block_ids[j] - block_ids[i] if j < len(block_ids) else 1
        if step not in (1, -1):
            step = 1
        while j < len(block_ids) and block_ids[j] - block_ids[j - 1] == step:
            j += 1
        low = min(block_ids[i], block_ids[j - 1])
        runs.append(BlockRun(i, j - i, low, step == -1 and j - i > 1))
        i = j
    return runs
