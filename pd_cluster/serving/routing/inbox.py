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
        # One timer for the attempt's deadline, not one per wait (a wait per streamed chunk).
        self._timer: asyncio.TimerHandle | None = None
        self._expired = False

    def deltas(self, leg: Leg, deltas: list[EngineDelta]) -> None:
        """Apply ``deltas`` (one engine's, in order) to ``leg``."""
        for d in deltas:
            self.delta(leg, d)

    def delta(self, leg: Leg, d: EngineDelta) -> None:
        """Apply one delta to ``leg``; a leg that failed or finished takes nothing more."""
        if leg.failure is not None or leg.finished:
            return
        if d.error:
            leg.fail(_error(leg, d))
        else:
            try:
                leg.apply(d)
            except EngineFailed as e:
                leg.fail(e)
        self._changed.setdefault(id(leg), leg)
        self._event.set()

    def fail(self, leg: Leg, error: Exception) -> None:
        """The leg's engine or stream failed (not a delta: a dead actor, a closed session)."""
        if leg.failure is None and not leg.finished:
            leg.fail(error)
            self._mark(leg)

    async def changed(self, deadline: float) -> list[Leg]:
        """The legs that changed since the last call, oldest change first; waits until one
        does, up to ``deadline`` (time.monotonic()), then raises asyncio.TimeoutError."""
        if not self._changed:
            if self._timer is None:
                self._timer = asyncio.get_running_loop().call_later(
                    max(deadline - time.monotonic(), 0.0), self._expire)
            if self._expired:
                raise asyncio.TimeoutError
            self._event.clear()
            await self._event.wait()
            if not self._changed:  # woken by the deadline
                raise asyncio.TimeoutError
        legs = list(self._changed.values())
        self._changed.clear()
        return legs

    def close(self) -> None:
        """The attempt ended: drop its deadline timer (it would hold the legs until then)."""
        if self._timer is not None:
            self._timer.cancel()

    def _expire(self) -> None:
        self._expired = True
        self._event.set()

    def _mark(self, leg: Leg) -> None:
        self._changed.setdefault(id(leg), leg)
        self._event.set()


def _error(leg: Leg, d: EngineDelta) -> Exception:
    if d.error_type == ERROR_INVALID_REQUEST:  # the request's fault: the engine stays healthy
        return invalid_request(d.error or "invalid request")
    if d.error_type == ERROR_TIMEOUT:
        return timeout_error(f"{leg.engine.name}: {d.error}")
    return EngineFailed(leg.engine, d.error or "engine error", dead=False)
