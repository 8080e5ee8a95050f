"""What a decode step's width costs, measured: seconds = overhead + per_token * tokens, a least
squares fit over the engine's recent decode-only steps (their widths vary with the drafts
verified, so both terms show). Where a token is nearly free (a large model's step reads every
weight whatever it computes) drafts are cheap; where it is not (a small model on a CPU, a large
batch) a draft that is unlikely to be kept costs more than it saves (backoff.py's width and
its gate).

The fit keeps running sums (added as a step comes, taken off as it leaves the window), so it
costs a few float operations per step: at batch 1 a tiny model's step is ~1 ms, and a fit
recomputed over 64 samples in Python each step was 3% of it."""
from __future__ import annotations

from collections import deque

_WINDOW = 64  # steps in the fit
_MIN_STEPS = 8


class StepCost:
    def __init__(self) -> None:
        self.samples: deque[tuple[int, float]] = deque()
        # Sums over ``samples``: tokens, seconds, tokens^2, tokens * seconds.
        self._t = self._s = self._tt = self._ts = 0.0
        self._fit: tuple[float, float] | None = None
        self._stale = False  # samples came since the fit (it is computed once per step)

    def record(self, tokens: int, seconds: float) -> None:
        """One decode-only step: its tokens (decodes and drafts) and its execute time."""
        if tokens > 0 and seconds > 0:
            self._add(tokens, seconds, 1.0)
            self.samples.append((tokens, seconds))
            if len(self.samples) > _WINDOW:
                self._add(*self.samples.popleft(), -1.0)
            self._stale = True

    def _add(self, tokens: int, seconds: float, sign: float) -> None:
        self._t += sign * tokens
        self._s += sign * seconds
        self._tt += sign * tokens * tokens
        self._ts += sign * tokens * seconds

    def fit(self) -> tuple[float, float] | None:
        """(overhead seconds, seconds per token), or None until the widths varied enough."""
        if self._stale and len(self.samples) >= _MIN_STEPS:
            self._stale, self._fit = False, None
            n = len(self.samples)
            mean_t, mean_s = self._t / n, self._s / n
            var = self._tt - n * mean_t * mean_t
            if var >= n:  # widths spread by a token or more: the slope means something
                slope = max((self._ts - n * mean_t * mean_s) / var, 0.0)
                self._fit = (max(mean_s - slope * mean_t, 0.0), slope)
        return self._fit

    def threshold(self, batch: int, extra: float = 0.0) -> float:
        """The share of a draft's cost that a kept draft must repay, for ``batch`` decoding
        requests: a step of B tokens costs o + c B for B tokens, so one more token computed
        (cost c, plus ``extra`` seconds spent outside the step to make it) pays when it is kept
        with probability >= (c + extra) B / (o + c B). 0 without a fit."""
        fit = self.fit()
        if fit is None:
            return 0.0
        overhead, per_token = fit
        total = overhead + per_token * batch
        return (per_token + extra) * batch / total if total > 0 else 0.0
