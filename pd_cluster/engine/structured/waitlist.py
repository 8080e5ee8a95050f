"""Requests whose grammar is still compiling: held out of the scheduler (which never sees a
request it could not sample), released as their grammars become ready."""
from __future__ import annotations

import concurrent.futures
import logging
from typing import Any

logger = logging.getLogger(__name__)


class GrammarWaitlist:
    def __init__(self) -> None:
        self._held: dict[str, Any] = {}  # request id -> Request, in arrival order

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._held

    def hold(self, request: Any) -> None:
        self._held[request.request_id] = request

    def pop(self, request_id: str) -> Any:
        return self._held.pop(request_id, None)

    def released(self, wait: float = 0.0) -> tuple[list[Any], list[Any]]:
        """(requests whose grammar compiled, requests whose grammar failed), in arrival order;
        with ``wait`` > 0 and nothing ready, waits up to that long for the first one."""
        if wait > 0 and self._held and not any(r.grammar.ready for r in self._held.values()):
            concurrent.futures.wait([r.grammar.future for r in self._held.values()],
                                    timeout=wait, return_when=concurrent.futures.FIRST_COMPLETED)
        ready, failed = [], []
        for rid, request in list(self._held.items()):
            if not request.grammar.ready:
                continue
            del self._held[rid]
            error = request.grammar.error()
            if error is None:
                ready.append(request)
            else:
                logger.warning("grammar of %s did not compile: %s", rid, error)
                failed.append(request)
        return ready, failed
