"""What a step costs by its width, as this engine measured it: seconds ~= fixed + per_token x
tokens, a least-squares line over the recent steps (tokens scheduled, wall time).

The scheduler of an engine that mixes prefill chunks into its decode steps sizes each chunk
with it: a step that carries a prefill chunk takes longer than a decode step by what the
decoding requests' TPOT slack allows (Sarathi-Serve's token budget, sized from measured step
times and the requests' progress instead of a fixed number). Until the window holds steps of
different widths the line is unknown and no budget is given. The same line gives the chunk
width that keeps up with a rate of prompt tokens (the queued prompts' TTFT, ttft_budget.py).
"""
from __future__ import annotations

import math
from collections import deque

WINDOW = 128  # recent steps fitted
MIN_SPREAD = 8  # tokens between the narrowest and the widest step before the slope is trusted


class StepTimeModel:
    def __init__(self, window: int = WINDOW) -> None:
        self._steps: deque[tuple[int, float]] = deque(maxlen=window)

    def add(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            self._steps.append((tokens, seconds))

    def line(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token), or None while the widths are too alike."""
        if len(self._steps) < 4:
            return None
        ns = [n for n, _ in self._steps]
        if max(ns) - min(ns) < MIN_SPREAD:
            return None
        mean_n = sum(ns) / len(ns)
        mean_t = sum(t for _, t in self._steps) / len(self._steps)
        var = sum((n - mean_n) ** 2 for n in ns)
        slope = sum((n - mean_n) * (t - mean_t) for n, t in self._steps) / var
        slope = max(slope, 1e-7)  # noise can tilt it flat or negative: wider is never free
        return max(mean_t - slope * mean_n, 0.0), slope

    def seconds_for(self, tokens: int) -> float | None:
        """What a step of ``tokens`` is expected to take; None: unknown."""
        line = self.line()
        if line is None:
            return None
        fixed, per_token = line
        return fixed + per_token * tokens

    def prompt_rate(self, width: int, others: int) -> float | None:
        """Prompt tokens a second moved by steps of a ``width``-token chunk beside
        ``others`` tokens; None: unknown."""
        seconds = self.seconds_for(width + others)
        return None if seconds is None else width / seconds

    def tokens_for_rate(self, rate: float, others: int) -> int | None:
        """The narrowest prompt chunk that moves ``rate`` prompt tokens a second in steps
        that also carry ``others`` tokens (the decodes): c / (fixed + per_token (c + others))
        >= rate. None: unknown, or no width reaches it (each token alone costs 1/rate)."""
        line = self.line()
        if line is None:
            return None
        fixed, per_token = line
        if rate * per_token >= 1:
            return None
        width = rate * (fixed + per_token * others) / (1 - rate * per_token)
        return max(math.ceil(width - 1e-9), 1)  # the float error of an exact fit

    def tokens_within(self, seconds: float) -> int | None:
        """The widest step (tokens) expected to take at most ``seconds``; None: unknown."""
        line = self.line()
        if line is None:
            return None
        fixed, per_token = line
        return max(int((seconds - fixed) / per_token), 0)
