"""Writing KV into the consumer's blocks (pipes that write in place: nixl), both ends.

The consumer grants blocks per request: its HOLD (the answer to the producer's OFFER, sent once
it admitted the request) names the request's prompt blocks after the ones its prefix cache
holds (never those: they may be shared with running requests). The producer writes a layer's
blocks only into blocks of that grant, at their index in the request's block table, and only
until ``cutoff`` after the grant came: the consumer gives the request up ``kv_transfer_timeout``
after it registered it (then its blocks may be reused), the cutoff is half that counted from
later, so no write starts after the consumer stopped waiting (one in flight then is bounded by
the pipe's send_timeout; documented in docs/design.md). Each write's notification carries the
MAC of the bytes; the consumer checks it over its own blocks before they count (fail closed).
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Any, Callable, Optional, Sequence

import msgpack
import msgspec
import torch

from connectors.group_tables import layer_table
from connectors.metadata import KVWrittenHeader, encode_header
from connectors.pipes.device_hash import block_rows as device_block_rows
from connectors.pipes.nixl_layout import block_chunks

Grant = tuple[int, tuple[int, ...]]  # (index of the first granted block, the block ids)
Checker = Callable[[str, bytes, list, bytes, bytes], Optional[str]]  # peer head chunks tag nonce


def written_head(header: KVWrittenHeader) -> bytes:
    """The bytes a write's code covers besides the KV: the header without its tag and nonce
    (both ends build them with this function, so they agree byte for byte). A direct
    write's head has no ``staged_at`` (as before staging existed: older peers agree)."""
    body = encode_header(msgspec.structs.replace(header, tag=b"", nonce=b""))
    if header.staged_at < 0:
        body.pop("staged_at", None)
    return msgpack.packb(body, use_bin_type=True)


class Grants:
    """Producer: the blocks each consumer rank granted per request, until the cutoff."""

    def __init__(self, cutoff: float) -> None:
        self.cutoff = cutoff
        # (endpoint, request) -> (first, block ids, deadline, per-group ids, layer groups)
        self._by: OrderedDict[tuple[str, str], tuple[Any, ...]] = OrderedDict()
        self._lock = threading.Lock()  # the receiver thread records, the engine thread reads

    def record(self, endpoint: str, request_id: str, first: int, block_ids: Sequence[int],
               group_block_ids: Sequence[Sequence[int]] = (), layer_groups: Sequence[int] = ()
               ) -> None:
        """``group_block_ids`` / ``layer_groups``: a consumer with KV cache groups grants
        each group's blocks (group_tables.py); a layer is written into its group's."""
        with self._lock:
            self._by[(endpoint, request_id)] = (first, tuple(block_ids),
                                                time.monotonic() + self.cutoff,
                                                tuple(map(tuple, group_block_ids)),
                                                tuple(layer_groups))
            while len(self._by) > 4096:  # grants of requests finished here
                self._by.popitem(last=False)

    def get(self, endpoint: str, request_id: str, layer: int = 0) -> Grant | None:
        """The grant of ``layer``'s blocks, or None when none came or its cutoff passed."""
        with self._lock:
            entry = self._by.get((endpoint, request_id))
        if entry is None or time.monotonic() > entry[2]:
            return None
        return entry[0], tuple(layer_table(entry[1], entry[3], entry[4], layer))

    def drop(self, request_id: str) -> None:
        with self._lock:
            for key in [k for k in self._by if k[1] == request_id]:
                del self._by[key]


def granted_targets(grant: Grant, first_block: int, count: int) -> tuple[int, ...]:
    """The consumer's blocks for table entries first_block .. first_block + count - 1;
    ValueError for any outside the grant."""
    first, ids = grant
    lo = first_block - first
    if lo < 0 or count < 1 or lo + count > len(ids):
        raise ValueError(f"blocks {first_block}..{first_block + count - 1} are outside the "
                         f"grant (blocks {first}..{first + len(ids) - 1})")
    return ids[lo:lo + count]


def check_written(header: KVWrittenHeader, caches: Sequence[torch.Tensor],
                  block_ids: Sequence[int], held_blocks: int, peer: str,
                  checker: Checker | None, stager: Any = None) -> int:
    """Consumer: a producer's notification that it wrote ``header``'s blocks; returns the
    bytes they hold once their code checked out, else ValueError (the request fails closed).
    ``block_ids``: the request's prompt blocks; the held ones were never granted.
    ``stager``: the pipe's copy_staged, for writes into its staging slab (nixl_staging.py)."""
    if checker is None:
        raise ValueError("a write notification, but this pipe does not write in place")
    if not 0 <= header.layer < len(caches):
        raise ValueError("bad layer index")
    targets = granted_targets((held_blocks, tuple(block_ids[held_blocks:])),
                              header.first_block, header.num_blocks)
    if header.staged_at >= 0:
        if stager is None:
            raise ValueError("a staged write, but this pipe stages none")
        return stager(peer, header.request_id, header.staged_at, written_head(header),
                      header.tag, header.nonce, caches[header.layer], targets)
    # a checker marked on_device (the cuda_ipc pipe's) takes the blocks where they are
    chunker = device_block_rows if getattr(checker, "on_device", False) else block_chunks
    chunks = chunker(caches[header.layer], list(targets))
    bad = checker(peer, written_head(header), chunks, header.tag, header.nonce)
    if bad is not None:
        raise ValueError(f"the written blocks fail their check ({bad})")
    return chunks.nbytes if hasattr(chunks, "nbytes") else sum(c.nbytes for c in chunks)


def route_is_whole(route: Any, kv_layer: torch.Tensor) -> bool:
    """Writes carry whole blocks: the consumer rank takes every head this rank has."""
    return (route.src, route.count, route.dst) == (0, kv_layer.shape[3], 0)
