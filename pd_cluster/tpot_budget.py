"""How long a decode engine may stop decoding before a request it runs misses its TPOT target.

TPOT as clients and vLLM's benchmark measure it: (last token's time - first token's time) /
(output tokens - 1), per request. A request that has been decoding for ``elapsed`` s with
``tokens`` out of ``max_tokens`` and goes on at ``step`` s a token ends at
    TPOT = (elapsed + pause + (max_tokens - tokens) * step) / (max_tokens - 1),
so the pause it can absorb within ``target`` is
    target * (max_tokens - 1) - elapsed - (max_tokens - tokens) * step.
The engine's slack is the least over its requests, and over a request that would arrive
during the pause (``newcomer``: it has not started, so it absorbs (target - step) * (n - 1)).
Two users: the proxy, before letting a decode engine prefill a prompt itself (the pause is
that prefill), and the decode engine lending its cores to a prefill engine on its node (the
pause is the prefill step it lends them for). Both measure ``step`` where they stand.
"""
from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass
from typing import Iterable

# A request's length is unknown until it ends; max_tokens bounds it (EOS ends it sooner,
# which leaves fewer tokens to spread a pause over: the target is kept with this headroom).
SAFETY = 0.9


@dataclass(frozen=True)
class Decoding:
    """One request being decoded, as the slack needs it."""
    elapsed: float  # s since its first token
    tokens: int  # output tokens so far (the first included)
    max_tokens: int


def request_slack(r: Decoding, step: float, target: float) -> float:
    """Seconds of pause ``r`` absorbs and still ends within ``target`` TPOT."""
    n = max(r.max_tokens, 2)
    return SAFETY * target * (n - 1) - r.elapsed - max(n - r.tokens, 0) * step


def pause_slack(running: Iterable[Decoding], step: float, target: float,
                newcomer_tokens: int = 0) -> float:
    """The pause every request in ``running`` (and a newcomer of ``newcomer_tokens`` output
    tokens, when > 1) absorbs within ``target``: may be negative (already late)."""
    slacks = [request_slack(r, step, target) for r in running]
    if newcomer_tokens > 1:
        slacks.append(request_slack(Decoding(0.0, 1, newcomer_tokens), step, target))
    return min(slacks, default=float("inf"))


class StepTimes:
    """The last ``window`` decode step times (s) of one engine, and their percentiles."""

    def __init__(self, window: int = 256, default: float = 0.0):
        self.default = default
        self._order: deque[float] = deque(maxlen=window)
        self._sorted: list[float] = []

    def add(self, seconds: float) -> None:
        if len(self._order) == self._order.maxlen:
            old = self._order[0]
            del self._sorted[bisect.bisect_left(self._sorted, old)]
        self._order.append(seconds)
        bisect.insort(self._sorted, seconds)

    def __len__(self) -> int:
        return len(self._order)

    def percentile(self, p: float) -> float:
        """The ``p``-th percentile (0-100) of the window; ``default`` while it is empty."""
        if not self._sorted:
            return self.default
        i = min(int(round(p / 100 * (len(self._sorted) - 1))), len(self._sorted) - 1)
        return self._sorted[max(i, 0)]
