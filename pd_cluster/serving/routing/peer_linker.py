"""Keeps every prefill engine linked (handshaken) with every decode engine, off the request path.

A link is (producer, consumer endpoint, consumer incarnation): a restarted consumer is a new
incarnation, so its producers link again even if it reuses its address. The proxy learns the
consumers' endpoints and the producers' links from health checks; for each missing link it asks
the producer to handshake (bounded, in the background) and retries a failed link with
exponential backoff, so a restarted engine or a rejoining node becomes usable again by itself.
Requests are only sent P -> D over a link that exists (see Dispatcher).
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from pd_cluster.driver.messages import ROLE_DECODE, ROLE_PREFILL

logger = logging.getLogger(__name__)

_BACKOFF_FIRST = 0.5  # s
_BACKOFF_MAX = 30.0  # s


class PeerLinker:
    def __init__(self, engines: list[Any], timeout: float):
        self.engines = engines  # EngineState rows, updated in place by the pool
        self.timeout = timeout
        self._retry_at: dict[tuple[str, str, str], float] = {}  # link -> earliest next try
        self._delay: dict[tuple[str, str, str], float] = {}
        self._busy: set[str] = set()  # producers with a handshake call in flight
        self._tasks: set[asyncio.Task] = set()
        self.last_errors: dict[tuple[str, str], str] = {}  # (producer, endpoint) -> why

    @staticmethod
    def linked(p: Any, d: Any) -> bool:
        """Can P ship KV to D right now (P holds a handshake with D's current incarnation)?"""
        return bool(d.kv_endpoint) and p.kv_peers.get(d.kv_endpoint) == d.incarnation

    def sync(self) -> None:
        """Start a handshake for every missing link that is due (never blocks)."""
        # A draining consumer gets no new links (but keeps its old ones until it is gone).
        consumers = [d for d in self.engines if d.role == ROLE_DECODE and d.healthy
                     and d.kv_endpoint and d.incarnation
                     and getattr(d, "state", "serving") != "draining"]
        live = {(d.kv_endpoint, d.incarnation) for d in consumers}
        for key in [k for k in self._retry_at if (k[1], k[2]) not in live]:
            self._retry_at.pop(key, None), self._delay.pop(key, None)  # gone: forget it
        known = {d.kv_endpoint for d in self.engines if d.role == ROLE_DECODE and d.kv_endpoint}
        now = time.monotonic()
        for p in self.engines:
            if p.role != ROLE_PREFILL or not p.healthy or p.name in self._busy:
                continue
            due = {d.kv_endpoint: d.incarnation for d in consumers if not self.linked(p, d)
                   and self._retry_at.get((p.name, d.kv_endpoint, d.incarnation), 0.0) <= now}
            # An endpoint no consumer has any more belongs to an engine that restarted.
            stale = [ep for ep in p.kv_peers if ep not in known]
            if due or stale:
                self._busy.add(p.name)
                task = asyncio.get_running_loop().create_task(self._link(p, due, stale))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _link(self, p: Any, peers: dict[str, str], stale: list[str]) -> None:
        try:
            results = await asyncio.wait_for(
                p.handle.connect_peers.remote(peers, self.timeout, stale), self.timeout + 5.0)
            p.kv_peers = {ep: tag for ep, tag in p.kv_peers.items() if ep not in stale}
        except Exception as e:  # noqa: BLE001 - the producer itself failed: retry every link
            results = {ep: f"{type(e).__name__}: {e}"[:300] for ep in peers}
        finally:
            self._busy.discard(p.name)
        for endpoint, error in results.items():
            key = (p.name, endpoint, peers[endpoint])
            if error is None:
                p.kv_peers = {**p.kv_peers, endpoint: peers[endpoint]}
                self._retry_at.pop(key, None), self._delay.pop(key, None)
                self.last_errors.pop((p.name, endpoint), None)
                logger.info("%s linked to KV consumer %s", p.name, endpoint)
                continue
            delay = min(self._delay.get(key, _BACKOFF_FIRST / 2) * 2, _BACKOFF_MAX)
            self._delay[key], self._retry_at[key] = delay, time.monotonic() + delay
            self.last_errors[(p.name, endpoint)] = error
            logger.warning("%s cannot link to KV consumer %s (retry in %.1fs): %s", p.name,
                           endpoint, delay, error)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
