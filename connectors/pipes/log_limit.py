"""Warnings a peer can cause at will (failed proofs, refused or forged messages), logged so
that no peer can fill the logs: the first of each kind in full, then at most one summary line
per interval with the count since the last line. The counts themselves are the pipe's
metrics (stats()), which never lose one."""
from __future__ import annotations

import logging
import time
from typing import Callable


class LimitedLog:
    def __init__(self, logger: logging.Logger, interval: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._log, self.interval, self._clock = logger, interval, clock
        self._next: dict[str, float] = {}   # kind -> when its next summary may be logged
        self._pending: dict[str, int] = {}  # kind -> occurrences not logged yet

    def warn(self, kind: str, msg: str, *args: object) -> None:
        """Log ``msg % args`` if it is the first ``kind`` seen; else count it, and log one
        summary of the counted ones once ``interval`` passed since the last line."""
        now = self._clock()
        if kind not in self._next:
            self._next[kind] = now + self.interval
            self._log.warning(msg, *args)
            return
        self._pending[kind] = self._pending.get(kind, 0) + 1
        if now >= self._next[kind]:
            self._summary(kind, now, msg % args if args else msg)

    def _summary(self, kind: str, now: float, latest: str) -> None:
        n = self._pending.pop(kind, 0)
        self._next[kind] = now + self.interval
        if n:
            self._log.warning("%d more %s in the last %.0fs (latest: %s)", n, kind,
                              self.interval, latest[:300])
