"""Admission: up to ``max_inflight`` requests run; up to ``max_queue`` more wait, first come
first served; beyond both, 429 with a ``Retry-After`` (as vLLM and SGLang queue rather than
refuse). A queued request's wait is part of its TTFT (its clock started when it arrived) and
is bounded by its deadline; the queue holds one future per waiting request, nothing more.
"""
from __future__ import annotations

import asyncio
import collections
import math
import time

from pd_cluster.serving.api.errors import too_many_requests, timeout_error
from pd_cluster.serving.observability.metrics import ProxyMetrics

_LATENCY_WEIGHT = 0.1  # weight of the newest request in the running mean of request latency


class Admission:
    def __init__(self, max_inflight: int, max_queue: int, metrics: ProxyMetrics):
        self.max_inflight, self.max_queue, self.metrics = max_inflight, max_queue, metrics
        self.running = 0
        self._waiting: collections.deque[asyncio.Future[None]] = collections.deque()
        self._mean_latency = 1.0  # s, until requests finished tell better

    @property
    def queued(self) -> int:
        return len(self._waiting)

    async def enter(self, deadline: float) -> float:
        """Take a running slot, waiting in the queue if none is free (until ``deadline``,
        time.monotonic()); returns the seconds waited. Raises a 429 APIError when the queue
        is full, a 504 one when the deadline passes first."""
        start = time.monotonic()
        if self.running < self.max_inflight and not self._waiting:
            self.running += 1
            self.metrics.queue_time.observe(0.0)
            return 0.0
        if len(self._waiting) >= self.max_queue:
            raise too_many_requests(self.running, len(self._waiting), self.retry_after())
        slot: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append(slot)
        self.metrics.queued.inc()
        try:
            await asyncio.wait_for(asyncio.shield(slot), max(deadline - start, 0.001))
        except BaseException as e:  # timed out or cancelled (the client went away)
            if slot.done() and not slot.cancelled():
                self.leave()  # the slot was handed over just now: pass it on
            else:
                slot.cancel()
                self._waiting.remove(slot)
            if isinstance(e, asyncio.TimeoutError):
                raise timeout_error("request timed out waiting in the queue") from None
            raise
        finally:
            self.metrics.queued.dec()
        waited = time.monotonic() - start
        self.metrics.queue_time.observe(waited)
        return waited

    def leave(self, latency: float | None = None) -> None:
        """A running request ended (after ``latency`` seconds): its slot goes to the longest
        waiting request, if any."""
        if latency is not None:
            self._mean_latency += _LATENCY_WEIGHT * (latency - self._mean_latency)
        while self._waiting:
            slot = self._waiting.popleft()
            if not slot.done():
                slot.set_result(None)  # handed over: ``running`` stays the same
                return
        self.running -= 1

    def retry_after(self) -> int:
        """Seconds until the queue has likely moved by one place per waiting request: the
        queue drains max_inflight requests per mean request latency."""
        drain = self._mean_latency * (len(self._waiting) + 1) / self.max_inflight
        return min(60, max(1, math.ceil(drain)))
