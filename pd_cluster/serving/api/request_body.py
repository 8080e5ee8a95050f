"""A request's body, read up to a bound (proxy.max_body_bytes): past it the client gets an
OpenAI-shaped 413, and the proxy holds at most the bound (plus one received chunk) for it; a
declared Content-Length over the bound is refused before anything is read."""
from __future__ import annotations

from fastapi import Request

from pd_cluster.serving.api.errors import body_too_large


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise body_too_large(int(declared), limit)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise body_too_large(len(body), limit)
    return bytes(body)
