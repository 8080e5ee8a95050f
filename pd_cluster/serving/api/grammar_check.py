"""Whether a request's output constraint compiles, checked before it reaches an engine, never
on the proxy's event loop: a spec over ``proxy.grammar_max_bytes`` is a 400 unread, one that
has not compiled within ``proxy.grammar_check_timeout`` a 400 naming its field, while every
other stream goes on. Results (errors and timeouts too) are remembered per spec, LRU.

A compile cannot be interrupted (xgrammar's C++): one that timed out runs on to its end on its
thread; the same spec again gets the remembered 400 at once rather than another thread."""
from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from pd_cluster.serving.api.errors import APIError, invalid_request
from pd_cluster.serving.api.structured import check_compiles, spec_bytes
from pd_cluster.structured_outputs import StructuredOutputsParams

_CACHE_SIZE = 256  # clients repeat a few schemas; one-off ones must not grow the proxy


def constraint_field(req: Any) -> str | None:
    """The request field its constraint comes from (None: the output is free)."""
    plan = getattr(req, "tool_plan", None)
    if plan is not None and plan.mode in ("required", "named"):
        return "tools"
    if req.structured_outputs is not None:
        return "structured_outputs"
    if req.response_format not in (None, {"type": "text"}):
        return "response_format"
    return None


class GrammarCheck:
    def __init__(self, max_bytes: int, timeout: float, threads: int = 2) -> None:
        self.max_bytes, self.timeout = max_bytes, timeout
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="proxy-grammar")
        # spec key -> Future of its error (None: compiles); touched on the event loop only
        self._cache: OrderedDict[tuple, Future] = OrderedDict()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def check(self, req: Any) -> None:
        """A 400 (APIError) naming the field unless the request's constraint compiles."""
        field = constraint_field(req)
        if field is None:
            return
        deadline = time.monotonic() + self.timeout
        loop = asyncio.get_running_loop()
        # Building the params serialises the schema: O(body), also off the loop.
        params, key = await loop.run_in_executor(None, self._prepare, req, field)
        future = self._cache.get(key)
        if future is None:
            future = self._pool.submit(_compile_error, params, field)
            self._cache[key] = future
            if len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        try:
            error = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)),
                                           max(deadline - time.monotonic(), 0.0))
        except asyncio.TimeoutError:
            error = (f"{field}: {params.kind} did not compile within "
                     f"{self.timeout:g} s (proxy.grammar_check_timeout)")
            if self._cache.get(key) is future:  # remembered: the same spec fails at once
                done: Future = Future()
                done.set_result(error)
                self._cache[key] = done
        if error is not None:
            raise invalid_request(error, field)

    def _prepare(self, req: Any, field: str) -> tuple[StructuredOutputsParams, tuple]:
        params = req.structured_outputs_params()
        size = spec_bytes(params)
        if size > self.max_bytes:
            raise invalid_request(f"{field}: the {params.kind} is {size} bytes, over "
                                  f"proxy.grammar_max_bytes ({self.max_bytes})", field)
        spec = params.spec()
        return params, (params.kind, tuple(spec) if isinstance(spec, list) else spec,
                        bool(params.disable_any_whitespace))


def _compile_error(params: StructuredOutputsParams, field: str) -> str | None:
    try:
        check_compiles(params, field)
    except APIError as e:
        return e.message
    return None
