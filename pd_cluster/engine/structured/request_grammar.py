"""One request's matcher. Its state is a function of the grammar and the request's output
tokens: it catches up with ``output_token_ids`` before each mask, so a first token sampled by
the prefill engine, tokens replayed by a migration or kept across a preemption all need nothing
else (the P/D handoff of the grammar state is the tokens themselves).

A grammar that breaks (a token it does not accept, the backend raising) never lets the request
go on unconstrained: ``failure`` says why, and the engine ends the request with that error,
dropping the token sampled in that step (llm_engine.py)."""
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
        self.failure: str | None = None  # why the grammar stopped constraining (then: end)

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

    def fail(self, why: str) -> None:
        if self.failure is None:
            self.failure = f"structured_outputs: the grammar broke at output token " \
                           f"#{self.num_accepted}: {why}; the request ends rather than go on " \
                           f"unconstrained"
            logger.warning("%s", self.failure)

    def matcher(self, output_token_ids: list[int]) -> Any:
        """The matcher after every output token (None when it cannot constrain any more:
        terminated, or ``failure`` set)."""
        if self.failure is not None:
            return None
        try:
            if self._matcher is None:
                self._matcher = self.backend.matcher(self._compiled.result())
            while self.num_accepted < len(output_token_ids):
                if not self._accept(output_token_ids[self.num_accepted]):
                    return None
            return None if self.backend.is_terminated(self._matcher) else self._matcher
        except Exception as e:  # noqa: BLE001 - the backend's error ends this request only
            self.fail(f"{type(e).__name__}: {e}")
            return None

    def advance(self, token: int) -> None:
        """Follow a token just sampled under this grammar's mask (a token it does not
        accept: ``failure``, before the token is emitted)."""
        if self.failure is not None or self._matcher is None:
            return
        try:
            self._accept(token)
        except Exception as e:  # noqa: BLE001 - as in matcher()
            self.fail(f"{type(e).__name__}: {e}")

    def _accept(self, token: int) -> bool:
        if self.backend.is_terminated(self._matcher):
            # Complete: only ignore_eos (or a stop token the checker does not stop on) writes
            # on, as the request asked; there is nothing left to constrain.
            self.num_accepted += 1
            return True
        if not self.backend.accepts(self._matcher, token):
            self.fail(f"token {token} is not in the grammar")
            return False
        self.num_accepted += 1
        return True
