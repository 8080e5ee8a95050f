"""What a decode step's width costs, measured: seconds = overhead + per_token * tokens, a least
squares fit over the engine's recent decode-only steps (their widths vary with the drafts
verified, so both terms show). Where a token is nearly free (a large model's step reads every
weight whatever it computes) drafts are cheap; where it is not (a small model on a CPU, a large
batch) a draft that is unlikely to be kept costs more than it saves (backoff.py's width)."""
from __future__ import annotations

from collections import deque

_WINDOW = 64  # steps in the fit
_MIN_STEPS = 8


class StepCost:
    def __init__(self) -> None:
        self.samples: deque[tuple[int, float]] = deque(maxlen=_WINDOW)
        self._fit: tuple[float, float] | None = None
        self._stale = False  # samples came since the fit (it is computed once per step)

    def record(self, tokens: int, seconds: float) -> None:
        """One decode-only step: its tokens (decodes and drafts) and its execute time."""
        if tokens > 0 and seconds > 0:
            self.samples.append((tokens, seconds))
            self._stale = True

    def fit(self) -> tuple[float, float] | None:
        """(overhead seconds, seconds per token), or None until the widths varied enough."""
        if self._stale and len(self.samples) >= _MIN_STEPS:
            self._stale, self._fit = False, None
            n = len(self.samples)
            mean_t = sum(t for t, _ in self.samples) / n
            mean_s = sum(s for _, s in self.samples) / n
            var = sum((t - mean_t) ** 2 for t, _ in self.samples)
            if var >= n:  # widths spread by a token or more: the slope means something
                slope = sum((t - mean_t) * (s - mean_s) for t, s in self.samples) / var
                slope = max(slope, 0.0)
                self._fit = (max(mean_s - slope * mean_t, 0.0), slope)
        return self._fit

    def threshold(self, batch: int) -> float:
        """The share of a draft's cost that a kept draft must repay, for ``batch`` decoding
        requests: a step of B tokens costs o + c B for B tokens, so one more token computed
        (cost c) pays when it is kept with probability >= c B / (o + c B). 0 without a fit."""
        fit = self.fit()
        if fit is None:
            return 0.0
        overhead, per_token = fit
        total = overhead + per_token * batch
        return per_token * batch / total if total > 0 else 0.0
