"""Where the legs of one attempt report: the per-request collector of the token path.

Deltas are applied to their leg as they arrive (in order, numbered: a gap or repeat fails the
leg) and the consumer is woken once for any number of them. A client slower than its engines
therefore gets everything new in one event at its next read, and a client that reads nothing
costs the proxy the leg's own output (which it keeps anyway, to resume the request elsewhere),
never a queue that grows with the engine's steps.
"""
from __future__ import annotations

import asyncio
import time

from pd_cluster.driver.messages import ERROR_INVALID_REQUEST, ERROR_TIMEOUT, EngineDelta
from pd_cluster.serving.api.errors import invalid_request, timeout_error
from pd_cluster.serving.routing.legs import EngineFailed, Leg


class AttemptInbox:
    def __init__(self) -> None:
        self._event = asyncio.Event()
        self._changed: dict[int, Leg] = {}  # id(leg) -> leg, in the order they changed

    def deltas(self, leg: Leg, deltas: list[EngineDelta]) -> None:
        """Apply ``deltas`` (one engine's, in order) to ``leg``; a leg that failed or
        finished takes nothing more."""
        if leg.failure is not None or leg.finished:
            return
        for d in deltas:
            if d.error:
                leg.failure = _error(leg, d)
                break
            try:
                leg.apply(d)
            except EngineFailed as e:
                leg.failure = e
                break
        self._mark(leg)

    def fail(self, leg: Leg, error: Exception) -> None:
        """The leg's engine or stream failed (not a delta: a dead actor, a closed session)."""
        if leg.failure is None and not leg.finished:
            leg.failure = error
            self._mark(leg)

    async def changed(self, deadline: float) -> list[Leg]:
        """The legs that changed since the last call, oldest change first; waits until one
        does, up to ``deadline`` (time.monotonic()), then raises asyncio.TimeoutError."""
        if not self._changed:
            self._event.clear()
            if _timeout_at is not None:  # Python 3.11+: a deadline without a task per wait
                async with _timeout_at(deadline):  # loop.time() is time.monotonic()
                    await self._event.wait()
            else:
                await asyncio.wait_for(self._event.wait(),
                                       max(deadline - time.monotonic(), 0.001))
        legs = list(self._changed.values())
        self._changed.clear()
        return legs

    def _mark(self, leg: Leg) -> None:
        self._changed.setdefault(id(leg), leg)
        self._event.set()


_timeout_at = getattr(asyncio, "timeout_at", None)


def _error(leg: Leg, d: EngineDelta) -> Exception:
    if d.error_type == ERROR_INVALID_REQUEST:  # the request's fault: the engine stays healthy
        return invalid_request(d.error or "invalid request")
    if d.error_type == ERROR_TIMEOUT:
        return timeout_error(f"{leg.engine.name}: {d.error}")
    return EngineFailed(leg.engine, d.error or "engine error", dead=False)
