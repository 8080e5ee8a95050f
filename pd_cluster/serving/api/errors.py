"""OpenAI-style API errors: ``{"error": {"message", "type", "param", "code"}}`` with a status."""
from __future__ import annotations

import re
from typing import Any


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status, message, type_, param, code)
        self.headers = headers or {}  # sent with the response (e.g. Retry-After)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    @property
    def is_client_error(self) -> bool:
        return 400 <= self.status < 500


def invalid_request(message: str, param: str | None = None, code: str | None = None
                    ) -> APIError:
    return APIError(400, message, "invalid_request_error", param or param_of(message), code)


def model_not_found(model: str, served: list[str]) -> APIError:
    names = ", ".join(f"`{n}`" for n in served)
    return APIError(404, f"The model `{model}` does not exist; this server serves {names}.",
                    "invalid_request_error", "model", "model_not_found")


def too_many_requests(running: int, queued: int, retry_after: int) -> APIError:
    return APIError(429, f"Too many requests: {running} running and {queued} queued (the "
                         f"limits); retry after {retry_after}s.", "rate_limit_error", None,
                    "rate_limit_exceeded", headers={"Retry-After": str(retry_after)})


def body_too_large(size: int, limit: int) -> APIError:
    return APIError(413, f"The request body ({size} bytes or more) exceeds this server's limit "
                         f"of {limit} bytes (proxy.max_body_bytes).", "invalid_request_error",
                    None, "request_too_large")


def timeout_error(message: str) -> APIError:
    return APIError(504, message, "timeout_error", None, "timeout")


def internal_error(message: str, status: int = 500) -> APIError:
    return APIError(status, message, "server_error", None, "engine_error")


_PARAM_RE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)(?: \+ [A-Za-z_]+)?(?::| must\b)")


def param_of(message: str) -> str | None:
    """The parameter a validation message is about ("max_tokens must be >= 1" -> max_tokens)."""
    m = _PARAM_RE.match(message)
    return m.group(1) if m else None
