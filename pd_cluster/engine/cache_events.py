"""The prefix cache's change log for cache-aware routing: hashes that became findable or
stopped being findable, on the device or in the lower tiers, as numbered events. Each reader
(one proxy each) keeps its own cursor; the log is bounded, and a reader further behind than
it keeps gets a reset."""
from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

MAX_PENDING_EVENTS = 65536  # events kept; a reader further behind gets a reset


@dataclass
class CacheEvents:
    """Prefix-cache changes after a reader's cursor: on the device (stored, removed) and in
    the lower tiers (host or disk: findable below the device; a hash may be in both). ``reset``:
    the events it missed are no longer kept (or it has none): it must clear its view and take
    cached_hashes() and lower_cached_hashes() afresh."""
    stored: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)
    reset: bool = False
    stored_lower: list[int] = field(default_factory=list)
    removed_lower: list[int] = field(default_factory=list)


class CacheEventLog:
    """The last ``max_events`` changes, (lower tier?, stored?, hash), the newest numbered
    ``seq - 1``."""

    def __init__(self, max_events: int = MAX_PENDING_EVENTS):
        self._log: deque[tuple[bool, bool, int]] = deque(maxlen=max_events)
        self._seq = 0

    def record(self, stored: bool, h: int, lower: bool = False) -> None:
        self._log.append((lower, stored, h))  # the oldest falls out: its readers get a reset
        self._seq += 1

    def since(self, cursor: int | None) -> tuple[CacheEvents, int]:
        """Changes after ``cursor`` (what a previous call returned; None: nothing seen yet),
        and the cursor to pass next. A cursor older than the kept log (or from another
        incarnation) gets a reset."""
        end, start = self._seq, self._seq - len(self._log)
        if cursor is None or not start <= cursor <= end:
            return CacheEvents(reset=True), end
        events = CacheEvents()
        for lower, stored, h in itertools.islice(self._log, cursor - start, None):
            if lower:
                (events.stored_lower if stored else events.removed_lower).append(h)
            else:
                (events.stored if stored else events.removed).append(h)
        return events, end
