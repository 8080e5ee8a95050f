"""Consumer-side staging for the nixl pipe's fragmented writes.

UCX pays ~10 us per descriptor here, and a shuffled grant (a fragmented block pool) makes a
layer's write one descriptor per 16 KiB block: 24k descriptors at 16k tokens, 0.5-1 GB/s
against 2.2 for one contiguous WRITE. So a decode engine with a host cache registers a staging
slab beside its cache (``kv_transfer.extra.nixl_staging_mb``) and grants each request a range
of it with the HOLD; a producer whose write would take many more descriptors than its own
source runs WRITEs those runs contiguously into the range instead, and its notification says
where (KVWrittenHeader.staged_at). The consumer copies the staged bytes into the granted blocks
and hashes them in the same pass (the GHASH kernel's copy_blocks, GIL released; OpenSSL over
the copied bytes without it), and only then do the blocks count: what is checked is what was
copied, so a write landing in the range meanwhile cannot slip past the MAC.

A range is released on every end of its request's receive (completed, failed closed,
cancelled, timed out); ``in_use`` is what the leak checks see.
"""
from __future__ import annotations

import hmac
import threading
from typing import Any, Optional, Sequence

import numpy as np
import torch

from connectors.pipes.written_check import Sealer

MiB = 1 << 20
DEFAULT_STAGING_MB = 512  # a 16k-token request of the bench's shape takes 384 MiB
_ALIGN = 4096
_MAX_RANGES = 4096  # ranges granted at once (requests being received)


def staging_bytes(extra: dict, mem: str) -> int:
    """The slab's size from ``extra.nixl_staging_mb`` (0: off); off by default for CUDA
    caches (staging there is unverified). ValueError naming the field."""
    raw = extra.get("nixl_staging_mb", DEFAULT_STAGING_MB if mem == "DRAM" else 0)
    if isinstance(raw, bool) or not isinstance(raw, (int, float)) or raw < 0:
        raise ValueError(f"kv_transfer.extra.nixl_staging_mb: expected a number >= 0 (MiB), "
                         f"got {raw!r}")
    return int(raw * MiB) // _ALIGN * _ALIGN


class RangeAllocator:
    """First-fit ranges of ``[0, size)``, one per key, aligned; thread-safe (the receiver
    thread grants and checks, the engine thread releases)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._free: list[tuple[int, int]] = [(0, size)] if size > 0 else []  # sorted
        self._held: dict[str, tuple[int, int]] = {}
        self._lock = threading.Lock()

    @property
    def in_use(self) -> int:
        with self._lock:
            return sum(n for _, n in self._held.values())

    def grant(self, key: str, nbytes: int) -> Optional[tuple[int, int]]:
        """(offset, size) of a fresh range of at least ``nbytes``; None when the key holds
        one already, nbytes is 0, or nothing fits."""
        size = -(-nbytes // _ALIGN) * _ALIGN
        with self._lock:
            if size <= 0 or key in self._held or len(self._held) >= _MAX_RANGES:
                return None
            for i, (at, n) in enumerate(self._free):
                if n >= size:
                    self._free[i:i + 1] = [(at + size, n - size)] if n > size else []
                    self._held[key] = (at, size)
                    return at, size
        return None

    def range_of(self, key: str) -> Optional[tuple[int, int]]:
        with self._lock:
            return self._held.get(key)

    def release(self, key: str) -> None:
        """Idempotent; the range merges with free neighbours."""
        with self._lock:
            got = self._held.pop(key, None)
            if got is None:
                return
            self._free.append(got)
            self._free.sort()
            merged = [self._free[0]]
            for at, n in self._free[1:]:
                last_at, last_n = merged[-1]
                if last_at + last_n == at:
                    merged[-1] = (last_at, last_n + n)
                else:
                    merged.append((at, n))
            self._free = merged


class StagingSlab:
    """The consumer's registered host memory for staged writes, and its ranges."""

    def __init__(self, nbytes: int) -> None:
        # empty: pages are touched only where writes land (a slab never used costs no RSS)
        self.buf = torch.empty(nbytes, dtype=torch.uint8)
        self.ranges = RangeAllocator(nbytes)
        self.registered: Any = None

    @property
    def addr(self) -> int:
        return self.buf.data_ptr()

    @property
    def size(self) -> int:
        return self.buf.numel()

    def region(self) -> list[tuple[int, int, int, str]]:
        return [(self.addr, self.size, 0, "")]

    def rows(self, request_id: str, at: int, parts: int, blocks: int, block_bytes: int
             ) -> torch.Tensor:
        """The staged bytes of a write, [parts, blocks, block_bytes]; ValueError unless they
        lie inside the request's range."""
        granted = self.ranges.range_of(request_id)
        need = parts * blocks * block_bytes
        if granted is None or not granted[0] <= at <= granted[0] + granted[1] - need:
            raise ValueError(f"a staged write at {at} of {need} bytes lies outside the "
                             f"request's staging range {granted}")
        return self.buf[at:at + need].view(parts, blocks, block_bytes)


def copy_and_check(mode: str, key: bytes, nonce: bytes, head: bytes, tag: bytes,
                   staged: torch.Tensor, rows: torch.Tensor, targets: Sequence[int]
                   ) -> Optional[str]:
    """Copy ``staged`` ([parts, n, bytes]) into blocks ``targets`` of ``rows`` ([parts,
    blocks, bytes] uint8) and check the write's code over the copied bytes, in block_chunks'
    order (part by part, blocks in order). Why they fail, or None."""
    sealer = Sealer(mode, key, nonce, head)
    ids = [int(t) for t in targets]
    if sealer.fused:
        sealer.copy_blocks(staged, rows, list(range(len(ids))), ids)
    else:
        src, dst = staged.numpy(), rows.numpy()
        index = np.asarray(ids, dtype=np.intp)
        for part in range(src.shape[0]):
            dst[part][index] = src[part]
            if mode != "none":
                whole = memoryview(dst[part].reshape(-1))
                size = dst.shape[2]
                for b in ids:  # the copied bytes, not the staging's (which a write may change)
                    sealer.update(whole[b * size:(b + 1) * size])
    if mode == "none" or hmac.compare_digest(sealer.tag(), tag):
        return None
    return f"{mode} mismatch"
