"""Reusable send buffers, returned to the pool when the pipe no longer needs them."""
from __future__ import annotations

import threading
from collections import defaultdict
from concurrent.futures import Future

import torch

Key = tuple[tuple[int, ...], torch.dtype, torch.device]


class BufferPool:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes  # idle buffers kept at most; beyond that they are dropped
        self._free: dict[Key, list[torch.Tensor]] = defaultdict(list)
        self._idle_bytes = 0
        self._lock = threading.Lock()

    def acquire(self, shape: tuple[int, ...], dtype: torch.dtype,
                device: torch.device) -> torch.Tensor:
        key = (tuple(shape), dtype, torch.device(device))
        with self._lock:
            if self._free[key]:
                buf = self._free[key].pop()
                self._idle_bytes -= buf.nbytes
                return buf
        return torch.empty(shape, dtype=dtype, device=device)

    def release_when_done(self, buf: torch.Tensor, future: Future) -> None:
        future.add_done_callback(lambda _f: self._release(buf))

    def _release(self, buf: torch.Tensor) -> None:
        key = (tuple(buf.shape), buf.dtype, buf.device)
        with self._lock:
            if self._idle_bytes + buf.nbytes > self.max_bytes:
                return
            self._free[key].append(buf)
            self._idle_bytes += buf.nbytes


def gather_blocks(kv_layer: torch.Tensor, block_ids: tuple[int, ...], out: torch.Tensor) -> None:
    """Triton kernel on CUDA, plain torch elsewhere (never the Triton interpreter)."""
    from kernels.block_copy import gather_kv_blocks, gather_kv_blocks_torch
    (gather_kv_blocks if kv_layer.is_cuda else gather_kv_blocks_torch)(kv_layer, block_ids, out=out)


def scatter_blocks(buffer: torch.Tensor, kv_layer: torch.Tensor, block_ids: torch.Tensor) -> None:
    from kernels.block_copy import scatter_kv_blocks, scatter_kv_blocks_torch
    (scatter_kv_blocks if kv_layer.is_cuda else scatter_kv_blocks_torch)(buffer, kv_layer, block_ids)
