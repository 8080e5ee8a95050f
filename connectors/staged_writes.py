"""The connector's side of staged writes (the nixl pipe's staging slab for fragmented grants:
connectors/pipes/nixl_staging.py). Consumer: a range per request with its HOLD, released on
every end of its receive. Producer: the range each HOLD granted, filled at a running offset by
the writes that stage (the pipe decides which: ``staging_plan``)."""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Iterable, Sequence


class StagingRanges:
    """Producer: per (consumer rank, request), the granted range and how much is used."""

    def __init__(self) -> None:
        self._by: OrderedDict[tuple[str, str], list[int]] = OrderedDict()  # [start, end, next]
        self._lock = threading.Lock()  # the receiver thread records, the engine thread takes

    def record(self, endpoint: str, request_id: str, staging: Sequence[int]) -> None:
        if len(staging) != 2 or staging[1] <= 0:
            return  # none granted (or malformed: writes go directly)
        with self._lock:
            self._by[(endpoint, request_id)] = [staging[0], staging[0] + staging[1], staging[0]]
            while len(self._by) > 4096:  # requests finished here
                self._by.popitem(last=False)

    def take(self, endpoint: str, request_id: str, nbytes: int) -> int:
        """The offset for ``nbytes`` more staged bytes, or -1 when the range has no room."""
        with self._lock:
            entry = self._by.get((endpoint, request_id))
            if entry is None or nbytes <= 0 or entry[2] + nbytes > entry[1]:
                return -1
            at, entry[2] = entry[2], entry[2] + nbytes
            return at

    def drop(self, request_id: str) -> None:
        with self._lock:
            for key in [k for k in self._by if k[1] == request_id]:
                del self._by[key]


def staged_offset(pipe: Any, ranges: StagingRanges, endpoint: str, request_id: str,
                  layer: int, src_ids: Sequence[int], dst_ids: Sequence[int]) -> int:
    """Producer: where this write goes in the consumer's staging slab, or -1 (directly)."""
    plan = getattr(pipe, "staging_plan", None)
    need = plan(endpoint, layer, src_ids, dst_ids) if plan is not None else 0
    return ranges.take(endpoint, request_id, need) if need else -1


def _runs(ids: Sequence[int]) -> int:
    return sum(1 for i, b in enumerate(ids) if i == 0 or b != ids[i - 1] + 1)


def grant_staging(pipe: Any, receiver: Any, request_id: str, granted: Sequence[int],
                  groups: Sequence[Sequence[int]] = ()) -> tuple[int, ...]:
    """Consumer, building a HOLD: a staging range for every granted block of every target
    layer, () when the pipe has none, it is full, or the grant has too few runs of blocks for
    staging to save ``stage_min_saved`` descriptors on any write (a fresh pool's contiguous
    grant: the slab stays free for fragmented ones). A request that ended meanwhile gets its
    range back at once (its end's release may have run before this grant)."""
    grant = getattr(pipe, "grant_staging", None)
    caches = receiver.kv_caches[:receiver.num_layers]
    if grant is None or not granted or not caches:
        return ()
    # a write posts at least one descriptor per part per run of our blocks, staged at least 1
    most = max(c.shape[0] for c in caches) * max(_runs(t) for t in (granted, *groups)) - 1
    if most < getattr(pipe, "stage_min_saved", 0):
        return ()
    per_block = sum(c[:, 0].nbytes for c in caches)
    got = grant(request_id, per_block * len(granted))
    if got is None:
        return ()
    if not receiver.is_receiving(request_id):
        pipe.release_staging(request_id)
        return ()
    return tuple(got)


def release_staging(pipe: Any, request_ids: Iterable[str]) -> None:
    """Consumer: the requests' receives ended (completed, failed, cancelled, timed out)."""
    release = getattr(pipe, "release_staging", None)
    if release is not None:
        for rid in request_ids:
            release(rid)
