"""The engine actor's previous token path: ``generate`` streams one request's deltas as a Ray
streaming generator, fed from the output thread through ``call_soon_threadsafe`` and one
asyncio queue per request (engine_actor.py; scripts/bench_proxy.py compares it with the
output sessions). Every wait is bounded by the request's timeout."""
from __future__ import annotations

import asyncio
import threading
from typing import AsyncIterator

from pd_cluster.driver.engine_loop import EngineLoop
from pd_cluster.driver.messages import (ERROR_ENGINE, ERROR_INVALID_REQUEST, ERROR_TIMEOUT,
                                        EngineDelta, decode_request, encode)


class RayStreams:
    """Per-request queues of deltas on the actor's event loop."""

    def __init__(self, loop: EngineLoop):
        self.loop = loop
        self._aio: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        self._streams: dict[str, asyncio.Queue[EngineDelta]] = {}
        self._pending: list[EngineDelta] = []  # emitted before the event loop was known

    def bind(self, aio: asyncio.AbstractEventLoop) -> None:
        """The actor's event loop is known: deltas emitted before it are delivered now."""
        with self._lock:
            if self._aio is not None:
                return
            self._aio = aio
            pending, self._pending = self._pending, []
        if pending:
            self._dispatch(pending)

    def emit_threadsafe(self, deltas: list[EngineDelta]) -> None:
        """The output thread's deltas for requests without a session (see OutputSender)."""
        with self._lock:
            if self._aio is None:
                self._pending.extend(deltas)
                return
            aio = self._aio
        aio.call_soon_threadsafe(self._dispatch, deltas)

    def _dispatch(self, deltas: list[EngineDelta]) -> None:
        for delta in deltas:
            q = self._streams.get(delta.request_id)
            if q is not None:
                q.put_nowait(delta)

    async def generate(self, request: bytes) -> AsyncIterator[bytes]:
        """Stream the request's EngineDeltas until it finishes: each item is every delta queued
        since the previous one (in order, never merged), msgpack-encoded."""
        try:
            req = decode_request(request)
        except ValueError as e:  # malformed at the edge: the request's fault, not ours
            yield encode([EngineDelta("?", finished=True, error=f"malformed request: {e}",
                                      error_type=ERROR_INVALID_REQUEST)])
            return
        rid = req.request_id
        if not self.loop.alive:  # fail fast: a restart is coming (see EngineActor._on_fatal)
            yield encode([EngineDelta(rid, finished=True, error_type=ERROR_ENGINE,
                                      error=f"engine loop is down: {self.loop.error!r}")])
            return
        if rid in self._streams:
            yield encode([EngineDelta(rid, finished=True, error_type=ERROR_INVALID_REQUEST,
                                      error=f"request_id {rid!r} is already in use")])
            return
        q: asyncio.Queue[EngineDelta] = asyncio.Queue()
        self._streams[rid] = q
        finished = False
        self.loop.submit(req)
        try:
            while not finished:
                try:
                    batch = [await asyncio.wait_for(q.get(), timeout=req.timeout)]
                except asyncio.TimeoutError:
                    yield encode([EngineDelta(rid, -1, finished=True, finish_reason="abort",
                                              error=f"no output for {req.timeout:.0f}s",
                                              error_type=ERROR_TIMEOUT)])
                    return
                while not q.empty():
                    batch.append(q.get_nowait())
                finished = batch[-1].finished
                yield encode(batch)
        finally:
            self._streams.pop(rid, None)
            if not finished:  # consumer went away (cancelled, disconnected): free the engine
                self.loop.abort([rid])
