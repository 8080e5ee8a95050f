"""A request's deadline (``proxy.request_timeout`` from its arrival, queue time included) as a
bound on every wait for its events, whatever that wait is on.

The dispatcher bounds its own waits by the deadline and ends the request with its own 504;
this bound, a moment later, ends it where some other wait did not (a call into an engine that
was paused mid-call, a cleanup that hangs): the client gets a 504 (or, mid-stream, the error
in-band) instead of no answer. Cleaning up the events after that is bounded too.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import AsyncIterator, TypeVar

from pd_cluster.serving.api.errors import timeout_error

logger = logging.getLogger(__name__)

GRACE = 5.0  # s past the deadline: the dispatcher's own timeout, and its message, come first
CLEANUP_BOUND = 10.0  # s for the events' cleanup (aborts on the engines) once ended here

T = TypeVar("T")


async def within_deadline(events: AsyncIterator[T], deadline: float, request_id: str
                          ) -> AsyncIterator[T]:
    """``events`` until ``deadline`` (time.monotonic()) + GRACE; then a 504. Each wait runs
    as a task this generator can walk away from: a wait that does not end when cancelled (its
    cleanup hangs) cannot hold the answer back."""
    pending: asyncio.Future[T] | None = None
    try:
        while True:
            pending = asyncio.ensure_future(anext(events))
            left = max(deadline + GRACE - time.monotonic(), 0.0)
            done, _ = await asyncio.wait({pending}, timeout=left)
            if not done:
                logger.warning("%s: no event from the engines %.0f s past its deadline; "
                               "ended with a timeout", request_id, GRACE)
                raise timeout_error("request timed out")
            finished, pending = pending, None
            try:
                item = finished.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if pending is not None:  # a wait still running: cancelled, and waited for a while
            pending.cancel()
            done, _ = await asyncio.wait({pending}, timeout=CLEANUP_BOUND)
            if done and not pending.cancelled():
                pending.exception()  # retrieved: it ended the wait it was cancelled in
        else:
            done = await _closed(events)
        if not done:
            logger.warning("%s: its engine streams did not close within %.0f s", request_id,
                           CLEANUP_BOUND)


async def _closed(events: AsyncIterator[T]) -> bool:
    task = asyncio.ensure_future(events.aclose())
    done, _ = await asyncio.wait({task}, timeout=CLEANUP_BOUND)
    if not done:
        task.cancel()
        return False
    task.exception()
    return True
