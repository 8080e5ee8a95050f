"""API keys on the proxy (vLLM's ``--api-key`` semantics): every route but ``/health`` (and
the ones ``proxy.open_routes`` names) needs ``Authorization: Bearer KEY``; anything else gets
an OpenAI-shaped 401 before the request is read, routed or run.

A pure ASGI middleware (no BaseHTTPMiddleware: it would wrap every streamed chunk). Keys are
compared as SHA-256 digests with hmac.compare_digest, against every configured key without
stopping early, so neither a key's length nor which key matched shows in the timing.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
from typing import Any, Awaitable, Callable, Iterable, Mapping

logger = logging.getLogger(__name__)

ALWAYS_OPEN = frozenset({"/health"})
_BODY = json.dumps({"error": {
    "message": "Incorrect or missing API key: send it as `Authorization: Bearer <key>`.",
    "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}).encode()
_HEADERS = [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer"),
            (b"content-length", str(len(_BODY)).encode())]


def resolve_api_keys(api_key: str | list[str] | None, api_key_env: str | None,
                     environ: Mapping[str, str] = os.environ) -> list[str]:
    """The keys the proxy accepts: ``api_key`` (one or a list) plus the value of the
    environment variable ``api_key_env`` (comma-separated: several keys). ValueError names
    the field when the variable is named but unset or empty (a proxy that meant to be keyed
    must not come up open)."""
    keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
    if api_key_env:
        value = environ.get(api_key_env, "")
        env_keys = [k.strip() for k in value.split(",") if k.strip()]
        if not env_keys:
            raise ValueError(f"proxy.api_key_env: environment variable {api_key_env!r} is "
                             f"unset or empty")
        keys += env_keys
    return keys


class APIKeyAuth:
    """ASGI middleware: lets a request through only with one of ``keys`` (none: all pass)."""

    def __init__(self, app: Any, keys: Iterable[str], open_paths: Iterable[str] = (),
                 on_reject: Callable[[], None] = lambda: None):
        self.app = app
        self._digests = [hashlib.sha256(k.encode()).digest() for k in keys]
        self._open = ALWAYS_OPEN | frozenset(open_paths)
        self._on_reject = on_reject

    async def __call__(self, scope: dict, receive: Callable[[], Awaitable[dict]],
                       send: Callable[[dict], Awaitable[None]]) -> None:
        if (not self._digests or scope["type"] != "http" or scope["path"] in self._open
                or self._authorized(scope.get("headers", ()))):
            await self.app(scope, receive, send)
            return
        self._on_reject()
        logger.info("%s %s -> 401: no valid API key", scope.get("method"), scope["path"])
        await send({"type": "http.response.start", "status": 401, "headers": _HEADERS})
        await send({"type": "http.response.body", "body": _BODY})

    def _authorized(self, headers: Iterable[tuple[bytes, bytes]]) -> bool:
        token = b""
        for name, value in headers:
            if name == b"authorization":
                scheme, _, rest = value.partition(b" ")
                if scheme.lower() == b"bearer":
                    token = rest.strip()
                break
        got = hashlib.sha256(token).digest()
        ok = False
        for digest in self._digests:  # no early exit: the time does not say which key
            ok |= hmac.compare_digest(got, digest)
        return ok and bool(token)
