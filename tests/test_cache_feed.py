"""A failed prefix-cache report is never silent: it is counted (pd_cache_report_failures) and
logged as a warning, at most once per engine per interval while the reports keep failing, and
the recovery is logged too."""
from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace
from typing import Any

import pytest

from pd_cluster.serving.observability.metrics import ProxyMetrics
from pd_cluster.serving.routing import cache_feed as cache_feed_module
from pd_cluster.serving.routing.cache_feed import CacheFeed
from pd_cluster.serving.routing.cache_index import CacheIndex
from pd_cluster.serving.routing.engine_load import LinkStats


class _Engine:
    """An engine state whose cache_events call fails while ``failing``."""

    def __init__(self) -> None:
        self.name, self.healthy, self.incarnation, self.failing = "decode-0", True, "i0", True
        self.handle = SimpleNamespace(cache_events=SimpleNamespace(remote=self._events))

    async def _events(self, full: bool, cursor: int | None = None) -> dict[str, Any]:
        if self.failing:
            raise RuntimeError("actor busy")
        return {"reset": True, "stored": [], "removed": [], "cursor": 0,
                "incarnation": self.incarnation, "block_size": 16, "kv_bytes_per_token": 8.0}


def test_failed_reports_are_counted_and_warned_about_rate_limited(
        caplog: pytest.LogCaptureFixture) -> None:
    metrics = ProxyMetrics(lambda: [])
    failures = metrics.cache_report_failures
    feed = CacheFeed(CacheIndex(64), LinkStats(), 0.01, 1.0,
                     lambda engine: failures.labels(engine).inc())
    engine = _Engine()

    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]

    async def go() -> None:
        with caplog.at_level(logging.INFO, logger=cache_feed_module.__name__):
            for _ in range(3):
                await feed.poll([engine])
            assert feed.failing == {"decode-0": 3}
            assert len(warnings()) == 1 and "actor busy" in warnings()[0]
            feed._warned["decode-0"] -= cache_feed_module._WARN_EVERY  # that long ago: again
            await feed.poll([engine])
            assert len(warnings()) == 2 and "4 in a row" in warnings()[1]
            engine.failing = False
            await feed.poll([engine])
            assert feed.failing == {} and feed.reports == 1
            assert any("resumed" in r.getMessage() for r in caplog.records)
            engine.failing = True  # a new outage is warned about at once
            await feed.poll([engine])
            assert len(warnings()) == 3 and "1 in a row" in warnings()[2]
    asyncio.run(go())
    text = metrics.render().decode()
    assert 'pd_cache_report_failures_total{engine="decode-0"} 5.0' in text
