"""The consumer's staging area: KV messages that arrived before the scheduler registered
their request (the producer can be faster than the consumer's next step), bounded in bytes
overall and per peer (one peer holds at most half: the rest stays for the others). The
receiver (kv_receiver.py) calls it under its own lock."""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

Item = tuple[Any, torch.Tensor | None, str]  # (header, payload, producer peer)


@dataclass
class _Staged:
    arrived: float
    items: list[Item] = field(default_factory=list)


class Staging:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._by_request: OrderedDict[str, _Staged] = OrderedDict()
        self._by_peer: dict[str, int] = {}
        self.nbytes = 0

    def add(self, request_id: str, item: Item) -> str | None:
        """Stage ``item``; or why not ("all": the area is full, "this peer's share")."""
        size, peer = _size(item), item[2]
        by_peer = self._by_peer.get(peer, 0)
        if by_peer + size > self.max_bytes // 2:
            return "this peer's share"
        if self.nbytes + size > self.max_bytes:
            return "all"
        self._by_request.setdefault(request_id, _Staged(time.monotonic())).items.append(item)
        self.nbytes += size
        self._by_peer[peer] = by_peer + size
        return None

    def pop(self, request_id: str) -> list[Item]:
        """The request's staged messages in arrival order, no longer staged."""
        staged = self._by_request.pop(request_id, None)
        for item in (staged.items if staged else []):
            self.nbytes -= _size(item)
            left = self._by_peer.get(item[2], 0) - _size(item)
            if left > 0:
                self._by_peer[item[2]] = left
            else:
                self._by_peer.pop(item[2], None)
        return staged.items if staged else []

    def peers(self, request_id: str) -> set[str]:
        staged = self._by_request.get(request_id)
        return {peer for _, _, peer in staged.items} if staged else set()

    def expired(self, now: float, timeout: float) -> list[str]:
        """Requests staged longer than ``timeout``: never registered here."""
        return [rid for rid, s in self._by_request.items() if now - s.arrived > timeout]


def _size(item: Item) -> int:
    return item[1].nbytes if item[1] is not None else 0
