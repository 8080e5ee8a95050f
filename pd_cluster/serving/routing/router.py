"""Routing policies: pick one engine of a role for a request. New policies register by name.

Load is the proxy's own view (outstanding work it dispatched and not yet seen finish, the
prefill tokens queued, the requests running), which is exact and immediate, unlike engine
stats polled every few seconds. ``cached`` is, per engine name, how many of the prompt's
tokens it need not prefill by the proxy's CacheIndex: those its device prefix cache holds,
plus those only its lower KV tiers hold at proxy.lower_tier_hit_weight (restoring one costs a
copy, a fraction of its prefill); policies other than cache_aware ignore it.
"""
from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from typing import Callable, Mapping, Protocol, Sequence


class Routable(Protocol):
    name: str
    outstanding_work: int  # prompt tokens still to prefill + tokens still to decode
    inflight: int  # requests (legs) dispatched and not finished
    queued_prefill: int  # prompt tokens it has yet to compute before answering its legs


class Router(ABC):
    @abstractmethod
    def pick(self, candidates: Sequence[Routable],
             cached: Mapping[str, int] | None = None) -> Routable:
        """One of ``candidates`` (non-empty, all healthy)."""


_ROUTERS: dict[str, Callable[[], Router]] = {}


def register_router(name: str) -> Callable[[type[Router]], type[Router]]:
    def deco(cls: type[Router]) -> type[Router]:
        _ROUTERS[name] = cls
        return cls
    return deco


def router_names() -> list[str]:
    return sorted(_ROUTERS)


def create_router(name: str) -> Router:
    try:
        return _ROUTERS[name]()
    except KeyError:
        raise ValueError(f"routing: unknown policy {name!r} (one of {router_names()})") from None


@register_router("round_robin")
class RoundRobinRouter(Router):
    def __init__(self) -> None:
        self._counter = itertools.count()

    def pick(self, candidates: Sequence[Routable],
             cached: Mapping[str, int] | None = None) -> Routable:
        return candidates[next(self._counter) % len(candidates)]


@register_router("least_loaded")
class LeastLoadedRouter(Router):
    """Least outstanding work; ties rotate so equally idle engines all get used."""

    def __init__(self) -> None:
        self._counter = itertools.count()

    def pick(self, candidates: Sequence[Routable],
             cached: Mapping[str, int] | None = None) -> Routable:
        return min(self._rotated(candidates), key=lambda e: (e.outstanding_work, e.inflight))

    def _rotated(self, candidates: Sequence[Routable]) -> list[Routable]:
        start = next(self._counter) % len(candidates)
        return list(candidates[start:]) + list(candidates[:start])


@register_router("cache_aware")
class CacheAwareRouter(LeastLoadedRouter):
    """Least (prefill tokens queued + requests running - prompt tokens cached), all in tokens:
    a cached prefix is worth as many tokens as it saves, a queued prefill token delays the
    newcomer by one token, and a running request by about one per step (decode is batched:
    a decode engine's queued decode tokens do not make a newcomer wait, so they must not
    outweigh a conversation's history there). Nothing cached anywhere (or nothing known)
    reduces to least_loaded; so does a load imbalance past ``BALANCE_ABS`` requests and
    ``BALANCE_REL`` times, so that one hot prefix cannot pile every request onto one engine.
    """
    BALANCE_ABS = 8
    BALANCE_REL = 1.5

    def pick(self, candidates: Sequence[Routable],
             cached: Mapping[str, int] | None = None) -> Routable:
        held = cached or {}
        if not any(held.values()) or self._imbalanced(candidates):
            return super().pick(candidates)
        return min(self._rotated(candidates),
                   key=lambda e: (e.queued_prefill + e.inflight - held.get(e.name, 0),
                                  e.outstanding_work))

    def _imbalanced(self, candidates: Sequence[Routable]) -> bool:
        most = max(e.inflight for e in candidates)
        least = min(e.inflight for e in candidates)
        return most - least > self.BALANCE_ABS and most > self.BALANCE_REL * least
