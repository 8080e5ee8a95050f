"""A shutdown that finishes what it started (SIGINT/SIGTERM to `serve`, `pd-cluster stop`).

``Drain.begin()``: new requests get 503 with Retry-After (``DrainGate``), requests in flight
(queued ones included) run on. When they are done, or ``proxy.shutdown_timeout`` has passed,
the drain expires: what is still running ends with a "server shutting down" error (in-band on
a stream, a 503 otherwise), logged as such, never a 500 or a failed migration (the engines are
stopped only after the drain).
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, AsyncIterator, Callable

from pd_cluster.serving.api.errors import APIError

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 5  # what a refused client is told: another replica (or this one) restarts
_END_GRACE_S = 5.0  # after expiry: time for the ended requests to send their error


def shutting_down() -> APIError:
    return APIError(503, "server shutting down", "service_unavailable_error", None,
                    "server_shutting_down", headers={"Retry-After": str(RETRY_AFTER_S)})


class Drain:
    def __init__(self, inflight: Callable[[], int]):
        self._inflight = inflight
        self.active = False  # no new requests
        self.expired = False  # the grace period is over: running requests end

    def begin(self) -> None:
        self.active = True

    async def run(self, timeout: float, poll: float = 0.05) -> dict[str, Any]:
        """Stop admitting, wait for in-flight requests up to ``timeout`` s, then end the rest
        (bounded by _END_GRACE_S more). Returns what happened, for the launcher's log."""
        self.begin()
        start = time.monotonic()
        at_start = self._inflight()
        if at_start:
            logger.info("shutting down: %d request(s) in flight get up to %.0fs to finish",
                        at_start, timeout)
        while self._inflight() and time.monotonic() - start < timeout:
            await asyncio.sleep(poll)
        left = self._inflight()
        self.expired = True
        if left:
            logger.warning("shutting down: ending %d request(s) still running after %.0fs "
                           "(proxy.shutdown_timeout) with 'server shutting down'", left, timeout)
        end = time.monotonic() + _END_GRACE_S
        while self._inflight() and time.monotonic() < end:
            await asyncio.sleep(poll)
        return {"in_flight": at_start, "ended": left, "left": self._inflight(),
                "seconds": round(time.monotonic() - start, 2)}


async def until_shutdown(events: AsyncIterator[Any], drain: Drain) -> AsyncIterator[Any]:
    """``events`` until the drain expires; then (and for any failure once shutting down, such
    as engines stopping) the shutdown error instead."""
    try:
        async for item in events:
            if drain.expired:
                raise shutting_down()
            yield item
    except APIError as e:
        if drain.active and e.code != "server_shutting_down":
            logger.info("request ended by the shutdown (was: %s)", e.message[:120])
            raise shutting_down() from None
        raise
    finally:
        await events.aclose()


class DrainGate:
    """ASGI middleware: while draining, generation requests get the 503 (OpenAI-style body)
    and /health says so; everything else (metrics, status) still answers."""

    def __init__(self, app: Any, drain: Drain):
        self.app, self.drain = app, drain

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if (scope["type"] != "http" or not self.drain.active
                or not (scope["path"].startswith("/v1/") and scope["method"] == "POST"
                        or scope["path"] == "/health")):
            await self.app(scope, receive, send)
            return
        import json
        err = shutting_down()
        body = json.dumps(err.body()).encode()
        await send({"type": "http.response.start", "status": 503, "headers": [
            (b"content-type", b"application/json"), (b"retry-after", str(RETRY_AFTER_S).encode()),
            (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
