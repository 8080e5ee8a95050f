"""How a received layer lands in the decode engine's cache (KVReceiver mixes these in; split from
kv_receiver.py): a message's payload scattered into the request's blocks (the target's or a
draft model's, whole or a head slice), a one-sided write's notification checked (its MAC over
our own blocks, or a staged write copied and checked: outside the receiver's lock, fenced so
a receive that ends waits for its staged copy) and marked written, and what a producer sent
for blocks this engine's prefix cache holds dropped. KVReceiver's __init__ sets the
attributes used here."""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterable

import msgspec
import numpy as np
import torch

from connectors.block_io import copy_rows, scatter_blocks
from connectors.granted_writes import check_written
from connectors.group_tables import layer_table
from connectors.metadata import FinHeader, KVLayerHeader, KVWrittenHeader, RecvSpec
from kernels.kv_quant import as_bytes

logger = logging.getLogger("connectors.kv_receiver")
_COPY_WAIT = 10.0  # seconds a receive that ended waits for a staged copy into its blocks


@dataclass
class Receiving:
    spec: RecvSpec
    block_index: torch.Tensor  # int64 block ids, for index_copy_
    deadline: float
    written: np.ndarray  # bool [layers, K/V, blocks, local heads] (numpy: any thread, any mode)
    fins: list[FinHeader] = field(default_factory=list)
    peers: set[str] = field(default_factory=set)
    first_layer_time: float | None = None
    draft_index: torch.Tensor | None = None  # the draft's blocks (None: no draft KV taken)
    first_arrival: float | None = None  # monotonic, for kv_recv_seconds
    group_index: list[torch.Tensor] = field(default_factory=list)  # per KV cache group
    # Producers granted its blocks to write in place that have not sent their FIN: they may
    # still write into them, so if the receive ends first its blocks are fenced (kv_receiver)
    writers: set[str] = field(default_factory=set)


class KVLanding:
    """Receiver-thread methods of KVReceiver (see its __init__ for the attributes)."""
    _lock: threading.Lock
    _active: dict[str, Any]

    def _check_unlocked(self, header: KVWrittenHeader, peer: str
                        ) -> tuple[Receiving, int | ValueError] | None:
        """A written layer's MAC, checked without the lock (a layer of a long prompt takes
        milliseconds; the engine thread's take_finished and register wait on the lock): the
        request's state and the bytes checked, or why they failed. None: not receiving it."""
        rid = header.request_id
        with self._lock:
            state = self._active.get(rid)
            if state is None:
                return None
            ids, held = self._table(state, header.layer)
            if header.staged_at >= 0:
                self._copying.add(rid)
        try:
            return state, check_written(header, self.kv_caches, ids, held, peer,
                                        self.check_written, self.copy_staged)
        except ValueError as e:
            return state, e
        finally:
            if header.staged_at >= 0:
                with self._lock:
                    self._copying.discard(rid)
                    self._copied.notify_all()

    def _wait_copies(self, request_ids: Iterable[str]) -> None:
        """(Lock held.) Until no staged copy into these requests' blocks runs: the scheduler
        frees and reuses their blocks once told the receive ended (a copy is a local memcpy
        of one layer, milliseconds; bounded all the same)."""
        ids = set(request_ids)
        if self._copying and not self._copied.wait_for(lambda: self._copying.isdisjoint(ids),
                                                       timeout=_COPY_WAIT):
            logger.error("a staged copy into %s still runs after %.0fs",
                         sorted(self._copying & ids)[:4], _COPY_WAIT)

    def _write_draft_layer(self, state: Receiving, header: KVLayerHeader,
                           tensor: torch.Tensor | None) -> None:
        """A draft layer into the draft's blocks; dropped when this request takes none."""
        if state.draft_index is None:
            self.bytes_skipped += tensor.nbytes if tensor is not None else 0
            return
        if header.head_start:
            raise ValueError("a draft layer comes whole (no head slices)")
        self._write_layer(state, header, tensor, state.draft_index)
        self.draft_bytes_received += tensor.nbytes

    def _write_layer(self, state: Receiving, header: KVLayerHeader,
                     tensor: torch.Tensor | None, index: torch.Tensor) -> None:
        """``index``: the block ids of the layer's table (the target's or the draft's)."""
        if not 0 <= header.layer < len(self.kv_caches) or tensor is None:
            raise ValueError("bad layer index or missing payload")
        cache = self.kv_caches[header.layer]
        both = header.part == 2  # every part of the layer (K and V, or the one latent)
        n = tensor.shape[1 if both else 0] if tensor.dim() == (5 if both else 4) else -1
        heads = tensor.shape[-2] if n > 0 else 0
        h0 = header.head_start
        expected = ((cache.shape[0], n) if both else (n,)) + (cache.shape[2], heads,
                                                              cache.shape[4])
        if (n <= 0 or heads < 1 or h0 + heads > cache.shape[3]
                or (not both and header.part >= cache.shape[0])
                or tuple(tensor.shape) != expected or tensor.dtype != cache.dtype):
            raise ValueError(f"payload {tuple(tensor.shape)} {tensor.dtype} does not match "
                             f"the cache layout {expected} {cache.dtype}")
        end = header.first_block + n
        if end > len(index):
            raise ValueError(f"blocks {header.first_block}..{end - 1} are past the prompt")
        targets = index[header.first_block:end]
        if header.descending:
            targets = targets.flip(0)
        parts = range(cache.shape[0]) if both else (header.part,)
        if both and heads == cache.shape[3]:
            scatter_blocks(tensor, cache, targets)
        elif heads == cache.shape[3]:  # one part, every head: no head-sliced view (1.5x)
            copy_rows(cache[header.part], targets, tensor)
        else:  # a slice of this rank's heads (a producer of another TP size)
            for i, part in enumerate(parts):  # (FP8 as bytes: no FP8 index_copy_ on CPU)
                as_bytes(cache[part, :, :, h0:h0 + heads]).index_copy_(
                    0, targets.to(cache.device),
                    as_bytes((tensor[i] if both else tensor).to(cache.device, cache.dtype)))
        for part in parts:
            state.written[header.layer, part, header.first_block:end, h0:h0 + heads] = True
        self.bytes_received += tensor.nbytes
        if state.first_layer_time is None and self.record_timings:
            state.first_layer_time = time.time()
            self.first_layer_times[state.spec.request_id] = state.first_layer_time
            if len(self.first_layer_times) > 4096:
                self.first_layer_times.popitem(last=False)

    def _mark_written(self, state: Receiving, header: KVWrittenHeader, peer: str,
                      checked: int | ValueError | None) -> None:
        """``checked``: the bytes verified, or why not, by _check_unlocked; None: check now
        (a notification staged before its request was registered)."""
        if header.layer >= self.num_layers and state.draft_index is None:
            return  # a draft layer this request takes none of (its FIN said so first)
        if isinstance(checked, ValueError):
            raise checked
        nbytes = checked if checked is not None else check_written(
            header, self.kv_caches, *self._table(state, header.layer), peer,
            self.check_written, self.copy_staged)
        end = header.first_block + header.num_blocks
        state.written[header.layer, :, header.first_block:end] = True  # every part and head
        self.bytes_received += nbytes
        if header.layer >= self.num_layers:
            self.draft_bytes_received += nbytes

    def _table(self, state: Receiving, layer: int) -> tuple[tuple[int, ...], int]:
        """A layer's prompt blocks and how many of them this engine held (never granted):
        the target's, or a draft model's (all granted: no prefix cache there)."""
        n = len(state.block_index)
        if layer >= self.num_layers:
            return (state.spec.draft_block_ids[:n] if state.draft_index is not None else ()), 0
        ids = layer_table(state.spec.block_ids, state.spec.group_block_ids, self.layer_groups,
                          layer)
        return tuple(ids[:n]), state.spec.num_cached_tokens // self.block_size

    def _skip_held(self, state: Receiving, header: KVLayerHeader, tensor: torch.Tensor | None
                   ) -> tuple[KVLayerHeader | None, torch.Tensor | None]:
        """The part of a layer message past the blocks this engine's cache holds (a producer
        sent before it learnt what we hold): (None, None) when nothing is left."""
        held = state.spec.num_cached_tokens // self.block_size
        if header.first_block >= held or tensor is None:
            return header, tensor
        dim = 1 if header.part == 2 else 0  # the block dimension
        n = tensor.shape[dim] if tensor.dim() > dim else 0
        keep = header.first_block + n - held
        self.bytes_skipped += tensor.nbytes * (n - max(keep, 0)) // max(n, 1)
        if keep <= 0:
            return None, None
        # Ascending rows are blocks first_block.. (drop the leading ones); descending rows
        # run from the top block down (drop the trailing ones).
        rows = slice(0, keep) if header.descending else slice(n - keep, n)
        return (msgspec.structs.replace(header, first_block=held),
                tensor[:, rows] if dim == 1 else tensor[rows])
