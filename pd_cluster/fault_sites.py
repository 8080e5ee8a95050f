"""The dice of one fault site (engine.faults, pd_cluster/faults.py): which operations a fault
hits, reproducibly, and how many were hit.

Each kind with a rate has its own RNG (seeded from the config's seed, the site and the kind)
drawn once per operation that can take that kind, so which operations are hit depends only
on their sequence. A site with no rate is None (``fault_site``): the code it would wrap runs
as it does with faults off.
"""
from __future__ import annotations

import random
import threading
import time
from typing import Any, Iterable

from pd_cluster.faults import FAULT_KINDS, FaultsConfig


class InjectedFault(RuntimeError):
    """A failure the fault hook injected (engine.faults), not a real one."""


class FaultSite:
    def __init__(self, name: str, faults: FaultsConfig, counters: dict[str, Any]):
        """``counters``: the owner's stats dict, where each kind's hits are counted as
        ``faults_injected_<name>_<kind>``."""
        rates = faults.site(name)
        self.name, self.delay_s = name, faults.delay_s
        self._rates = {k: getattr(rates, k) for k in FAULT_KINDS if getattr(rates, k)}
        self._rngs = {k: random.Random(f"{faults.seed}:{name}:{k}") for k in self._rates}
        self._lock = threading.Lock()  # several threads send and receive on one pipe
        self.counters = counters
        for kind in FAULT_KINDS:
            counters.setdefault(counter_name(name, kind), 0)

    def has(self, kind: str) -> bool:
        """Whether ``kind`` has a rate here."""
        return kind in self._rates

    def pick(self, kinds: Iterable[str]) -> str | None:
        """The fault that hits this operation: the first of ``kinds`` whose roll hits (each
        one's RNG is drawn, so their sequences stay aligned), counted; None: no fault."""
        with self._lock:
            hits = [k for k in kinds
                    if k in self._rates and self._rngs[k].random() < self._rates[k]]
            if not hits:
                return None
            self.counters[counter_name(self.name, hits[0])] += 1
        return hits[0]

    def wait(self) -> None:
        """A delay fault: hold the operation back (on the calling thread)."""
        time.sleep(self.delay_s)


def fault_site(faults: FaultsConfig | None, name: str, counters: dict[str, Any]
               ) -> FaultSite | None:
    """The site's dice, or None when faults are off or the site has no rate."""
    if faults is None or not faults.site(name).active:
        return None
    return FaultSite(name, faults, counters)


def counter_name(site: str, kind: str) -> str:
    return f"faults_injected_{site}_{kind}"


def flip_bit(data: Any) -> bytes:
    """A copy of ``data``'s bytes with one bit of its middle byte flipped."""
    out = bytearray(memoryview(data).cast("B"))
    out[len(out) // 2] ^= 0x01
    return bytes(out)
