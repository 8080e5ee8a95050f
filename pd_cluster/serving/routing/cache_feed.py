"""Feeds the proxy's CacheIndex from the engines' prefix-cache reports.

Every ``interval`` seconds each healthy engine is asked for its cache events after this feed's
cursor (``EngineActor.cache_events``: block hashes stored and removed, on the device and in
the engine's lower KV tiers, host or disk; a reset with everything it holds in each). The
cursor is this feed's own, so several proxies reading one engine each see every event.
Pulled rather than pushed on the token path: one small Ray call per engine per interval
(measured: 1.1 ms round trip, the full report of 620 held blocks as cheap as a delta; 4 calls
a second at the default interval) keeps the per-step token messages' format and hot path
unchanged. What a request puts in an engine's cache is recorded by the planner when it
routes, so only blocks written after the prompt (the reply) wait for the next report. A new
engine incarnation (a restart), or a report that failed (events may be lost), is
resynchronised with a full report; meanwhile routing only misses, never errs. A failed
report is counted (``on_failure``: the proxy's pd_cache_report_failures) and logged as a
warning, at most once per engine every _WARN_EVERY seconds while its reports keep failing, so
cache-aware routing never stops silently.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

from pd_cluster.serving.routing.cache_index import CacheIndex
from pd_cluster.serving.routing.engine_load import LinkStats

logger = logging.getLogger(__name__)

_WARN_EVERY = 60.0  # s: the longest an engine's failing reports go without a warning


class CacheFeed:
    def __init__(self, index: CacheIndex, link: LinkStats, interval: float, timeout: float,
                 on_failure: Callable[[str], None] = lambda engine: None):
        self.index, self.link = index, link
        self.interval, self.timeout = interval, timeout
        self.on_failure = on_failure  # told the engine's name at each failed report
        self._synced: dict[str, str] = {}  # engine -> incarnation whose events we follow
        self._cursor: dict[str, int] = {}  # engine -> where its next report starts
        self._task: asyncio.Task | None = None
        self.reports = 0
        self.failing: dict[str, int] = {}  # engine -> reports failed in a row
        self._warned: dict[str, float] = {}  # engine -> when its failures were last logged

    def start(self, engines: list[Any]) -> None:
        self._task = asyncio.create_task(self._loop(engines))

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def forget(self, engine: Any) -> None:
        """``engine`` restarted or went down: it holds nothing we know of until its report."""
        self.index.forget(engine.name)
        self._synced.pop(engine.name, None)
        self._cursor.pop(engine.name, None)

    async def _loop(self, engines: list[Any]) -> None:
        while True:
            await self.poll(engines)
            await asyncio.sleep(self.interval)

    async def poll(self, engines: list[Any]) -> None:
        await asyncio.gather(*(self._one(e) for e in engines if e.healthy))

    async def _one(self, e: Any) -> None:
        full = self._synced.get(e.name) != e.incarnation
        try:
            report = await asyncio.wait_for(e.handle.cache_events.remote(
                full, cursor=self._cursor.get(e.name)), self.timeout)
        except Exception as exc:  # noqa: BLE001 - a missed report: resync at the next one
            self._failed(e.name, exc)
            self.forget(e)
            return
        if self.failing.pop(e.name, 0):
            self._warned.pop(e.name, None)
            logger.info("%s: cache reports resumed", e.name)
        if report["incarnation"] != e.incarnation and not full:
            self.forget(e)  # restarted since the health check: its events start over
            return
        self.index.block_size = int(report["block_size"])
        self.link.bytes_per_token = float(report["kv_bytes_per_token"])
        self.index.apply(e.name, report["stored"], report["removed"], bool(report["reset"]),
                         report.get("stored_lower", ()), report.get("removed_lower", ()))
        self._synced[e.name] = report["incarnation"]
        self._cursor[e.name] = int(report["cursor"])
        self.reports += 1

    def _failed(self, engine: str, exc: BaseException) -> None:
        n = self.failing[engine] = self.failing.get(engine, 0) + 1
        self.on_failure(engine)
        now = time.monotonic()
        last = self._warned.get(engine)
        if last is None or now - last >= _WARN_EVERY:
            self._warned[engine] = now
            logger.warning("%s: cache report failed (%d in a row; routing misses its prefix "
                           "cache until one succeeds): %s: %s", engine, n,
                           type(exc).__name__, str(exc)[:200])
