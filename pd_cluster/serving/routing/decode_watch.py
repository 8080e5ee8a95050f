"""What the proxy sees of the requests one engine is decoding: each one's progress (first
token's time, tokens so far, max_tokens) and the engine's step times (the gaps between a
request's deltas, one delta a step), for the TPOT slack (tpot_budget.py) of a pause on it.

Legs are held weakly and dropped when they finish, fail or are gone; a leg that has not
produced its first token yet (D waiting for P's KV) counts as a request about to start.
"""
from __future__ import annotations

import time
import weakref
from typing import Any

from pd_cluster.tpot_budget import Decoding, StepTimes, pause_slack


class DecodeWatch:
    def __init__(self, window: int = 256):
        self.steps = StepTimes(window)
        # id(leg) -> [weak ref, first token's time (0: none yet), last delta's time, tokens]
        self._legs: dict[int, list[Any]] = {}

    def watch(self, leg: Any) -> None:
        """Follow ``leg`` (a leg that decodes on this engine) until it ends."""
        key = id(leg)
        self._legs[key] = [weakref.ref(leg, lambda _r: self._legs.pop(key, None)), 0.0, 0.0, 0]
        inner = leg.on_delta

        def on_delta(delta: Any) -> None:
            self.delta(key, len(delta.token_ids), delta.finished)
            if inner is not None:
                inner(delta)
        leg.on_delta = on_delta

    def delta(self, key: int, tokens: int, finished: bool, now: float | None = None) -> None:
        entry = self._legs.get(key)
        if entry is None:
            return
        now = time.monotonic() if now is None else now
        if tokens:
            if entry[1] == 0.0:
                entry[1] = now
            elif entry[3]:
                self.steps.add((now - entry[2]) / tokens)
            entry[2] = now
            entry[3] += tokens
        if finished:
            self._legs.pop(key, None)

    def decoding(self, now: float | None = None) -> list[Decoding]:
        """The requests this engine runs or is about to start, as of ``now``."""
        now = time.monotonic() if now is None else now
        out = []
        for key, (ref, first, _last, tokens) in list(self._legs.items()):
            leg = ref()
            if leg is None or leg.finished or leg.failure is not None:
                self._legs.pop(key, None)
                continue
            max_tokens = leg.request.params.max_tokens or 1
            out.append(Decoding(now - first if first else 0.0, max(tokens, 1), max_tokens))
        return out

    def step_seconds(self, percentile: float, stats: dict[str, Any]) -> float:
        """The engine's decode step time: the ``percentile`` of the recent gaps; before any,
        its mean step from its stats (0 when it has none)."""
        if len(self.steps):
            return self.steps.percentile(percentile)
        steps, seconds = stats.get("output_steps"), stats.get("output_step_seconds")
        if isinstance(steps, (int, float)) and steps and isinstance(seconds, (int, float)):
            return float(seconds) / float(steps)
        return 0.0

    def slack(self, target: float, percentile: float, stats: dict[str, Any],
              newcomer_tokens: int = 0) -> float:
        """Seconds this engine may pause and keep every request within ``target`` TPOT."""
        step = self.step_seconds(percentile, stats)
        return pause_slack(self.decoding(), step, target, newcomer_tokens)
