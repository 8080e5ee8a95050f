"""Routing policies: pick one engine of a role for a request. New policies register by name.

Load is the proxy's own view (outstanding work it dispatched and not yet seen finish),
which is exact and immediate, unlike engine stats polled every few seconds. ``cached`` is,
per engine name, how many of the prompt's tokens its prefix cache is believed to hold (the
proxy's CacheIndex); policies other than cache_aware ignore it.
"""
from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from typing import Callable, Mapping, Protocol, Sequence


class Routable(Protocol):
    name: str
    outstanding_work: int  # prompt tokens still to prefill + tokens still to decode
    inflight: int


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
    """Least (work to compute the prompt's uncached tokens + outstanding work), both in tokens:
    a cached prefix is worth as many tokens of load as it saves. Nothing cached anywhere (or
    nothing known) reduces to least_loaded."""

    def pick(self, candidates: Sequence[Routable],
             cached: Mapping[str, int] | None = None) -> Routable:
        held = cached or {}
        return min(self._rotated(candidates),
                   key=lambda e: (e.outstanding_work - held.get(e.name, 0), e.inflight))
