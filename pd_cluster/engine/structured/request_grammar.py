"""One request's matcher. Its state is a function of the grammar and the request's output
tokens: it catches up with ``output_token_ids`` before each mask, so a first token sampled by
the prefill engine, tokens replayed by a migration or kept across a preemption all need nothing
else (the P/D handoff of the grammar state is the tokens themselves)."""
from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import Any

logger = logging.getLogger(__name__)


class RequestGrammar:
    def __init__(self, pool: Any, compiled: Future) -> None:
        self._pool = pool
        self._compiled = compiled
        self._matcher: Any = None
        self.num_accepted = 0
        # The output left the grammar (a token it does not accept): no more masks, logged.
        self.broken = False

    @property
    def backend(self) -> Any:
        return self._pool.backend

    @property
    def ready(self) -> bool:
        return self._compiled.done()

    @property
    def future(self) -> Future:
        return self._compiled

    def error(self) -> str | None:
        """Why the grammar did not compile (once ``ready``), else None."""
        exc = self._compiled.exception() if self.ready else None
        return None if exc is None else str(exc)

    def matcher(self, output_token_ids: list[int]) -> Any:
        """The matcher after every output token (None when it cannot constrain any more)."""
        if self.broken:
            return None
        backend = self._pool.backend
        if self._matcher is None:
            self._matcher = backend.matcher(self._compiled.result())
        while self.num_accepted < len(output_token_ids):
            token = output_token_ids[self.num_accepted]
            if not backend.accepts(self._matcher, token):
                logger.warning("token %d (output #%d) is not in the request's grammar: no "
                               "more masks for it", token, self.num_accepted)
                self.broken = True
                return None
            self.num_accepted += 1
        return None if backend.is_terminated(self._matcher) else self._matcher
