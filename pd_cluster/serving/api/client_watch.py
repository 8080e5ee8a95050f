"""One request's watch on its client, and the streamed response that uses it.

A request that streams has one task that waits for the client to hang up (``ClientWatch``);
whatever the request awaits meanwhile (a queue slot, its first token, the stream itself) runs
in a task that the watch cancels then, which aborts the request on every engine. This replaces
a watcher task per await and Starlette's StreamingResponse, whose anyio task group and cancel
scope cost more per request than the rest of the proxy's own work (measured in bench_proxy).
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator, Awaitable, TypeVar

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

T = TypeVar("T")


class ClientDisconnected(Exception):
    pass


class ClientWatch:
    def __init__(self, receive: Receive):
        self.gone = False
        self._current: asyncio.Future | None = None  # what the request awaits now
        self._watcher = asyncio.ensure_future(self._watch(receive))

    async def _watch(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.gone = True
        if self._current is not None:
            self._current.cancel()

    async def guard(self, aw: Awaitable[T]) -> T:
        """``await aw`` unless the client goes away first: then ``aw`` is cancelled and this
        raises ClientDisconnected."""
        if self.gone:
            if asyncio.iscoroutine(aw):
                aw.close()
            raise ClientDisconnected()
        task = self._current = asyncio.ensure_future(aw)
        try:
            return await task
        except asyncio.CancelledError:
            if self.gone and task.cancelled():
                raise ClientDisconnected() from None
            task.cancel()  # this request was cancelled (the server stops): so is its work
            raise
        finally:
            self._current = None

    def close(self) -> None:
        self._watcher.cancel()


class SSEResponse(Response):
    """``text/event-stream`` of the chunks ``body`` yields; the watch ends it (and closes
    ``body``, which aborts the request) when the client goes away."""

    media_type = "text/event-stream"

    def __init__(self, body: AsyncIterator[bytes], watch: ClientWatch,
                 headers: dict[str, str]):
        self.body_iterator, self.watch = body, watch
        self.status_code, self.background = 200, None
        self.init_headers(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.watch.guard(self._stream(send))
        except ClientDisconnected:
            pass
        finally:
            self.watch.close()

    async def _stream(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        body = self.body_iterator
        try:
            async for chunk in body:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await body.aclose()  # type: ignore[attr-defined]


__all__ = ["ClientDisconnected", "ClientWatch", "SSEResponse"]
