"""The worker side of the KV tiers: one rank's host memory for KV blocks, and the step's ops.

Per layer one host tensor ``[num_slots, parts, block_size, heads, width]``, shaped like this
rank's device cache with the slot first (a slot's bytes are contiguous: one disk write, one
copy), pinned on CUDA. ``execute`` runs a step's TierOps in their fixed order (ops.py) at the
start of the step. On CPU the copies are synchronous copies inside the step (their cost is the
step's; ``op_seconds`` measures it: about 0.2 ms per MiB of block here). On CUDA they are non_blocking copies on the compute
stream, so the forward that follows is ordered after them without a wait; the stream is
synchronised only before the CPU itself reads or writes host slots (disk spills and fills).
"""
from __future__ import annotations

import time
from typing import Any

import torch

from pd_cluster.engine.kv_tiers.ops import TierOps


class HostTierStore:
    def __init__(self, kv_caches: list[torch.Tensor], num_slots: int, disk: Any = None) -> None:
        device = kv_caches[0].device
        self.cuda = device.type == "cuda"
        self.device = device
        # With KV cache groups one tensor serves a layer of every group (cache_engine.py): a
        # block id's page is held once per tensor, so each tensor counts once.
        self.kv_caches = list({id(c): c for c in kv_caches}.values())
        # Zeroed on CPU: the pages are committed now, not on a step's first save into them.
        alloc = torch.empty if self.cuda else torch.zeros
        self.host = [alloc((num_slots, cache.shape[0], *cache.shape[2:]), dtype=cache.dtype,
                           pin_memory=self.cuda) for cache in self.kv_caches]
        self.disk = disk  # a DiskTier (tensor parallel size 1: this is rank 0's store)
        self.restore_seconds = 0.0  # wall time of loads (on CUDA: of queueing them)
        self.op_seconds = 0.0  # wall time of every op, in the step

    @property
    def block_bytes(self) -> int:
        return sum(h[0].nbytes for h in self.host)

    def execute(self, ops: TierOps | None) -> None:
        if ops is None:
            return
        start = time.perf_counter()
        if self.cuda and (ops.spills or ops.fills):
            torch.cuda.current_stream(self.device).synchronize()
        for spill in ops.spills:
            if self.disk is None:
                raise RuntimeError("KV tiers: a disk spill on a rank without a disk tier")
            self.disk.write(spill.block_hash, tuple(spill.token_ids), self.slot_bytes(spill.slot))
        if ops.saves:
            self._copy(ops.saves, to_host=True)
        for slot, payload in ops.fills:
            self._write_slot(slot, payload)
        loads = time.perf_counter()
        if ops.loads:
            self._copy([(block, slot) for slot, block in ops.loads], to_host=False)
        end = time.perf_counter()
        self.restore_seconds += end - loads
        self.op_seconds += end - start

    def slot_bytes(self, slot: int) -> bytes:
        """A copy of the slot's bytes, every layer in order (what a disk file holds)."""
        return b"".join(h[slot].reshape(-1).view(torch.uint8).numpy().tobytes()
                        for h in self.host)

    def _write_slot(self, slot: int, payload: bytes | bytearray) -> None:
        if len(payload) != self.block_bytes:
            raise ValueError(f"KV tiers: a {len(payload)}-byte payload for a "
                             f"{self.block_bytes}-byte slot")
        data = torch.frombuffer(bytearray(payload) if isinstance(payload, bytes) else payload,
                                dtype=torch.uint8)
        offset = 0
        for h in self.host:
            dst = h[slot].reshape(-1).view(torch.uint8)
            dst.copy_(data[offset:offset + dst.numel()])
            offset += dst.numel()

    def _copy(self, pairs: list[tuple[int, int]], to_host: bool) -> None:
        """(device block, host slot) pairs, device -> host or host -> device: one copy per
        block and layer (measured faster on CPU than a gather + index_copy_, which goes
        through a temporary; on CUDA each is an async DMA from or to pinned memory)."""
        async_ = self.cuda
        for cache, host in zip(self.kv_caches, self.host):
            for block, slot in pairs:
                if to_host:
                    host[slot].copy_(cache[:, block], non_blocking=async_)
                else:
                    cache[:, block].copy_(host[slot], non_blocking=async_)
