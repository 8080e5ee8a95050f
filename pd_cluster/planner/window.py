"""What the controller judges the workload from: the looks (arrivals, finished requests) of the
last ``longest`` seconds, and a shift test that restarts the estimate when the traffic changes.

A mixed workload needs many requests for a steady estimate: with 40 requests of a 50/50 mix of
long prompts and long answers the share of long prompts alone swings by +-8% (one standard
deviation) from one look to the next, the per-engine capacities by more than the hysteresis,
and the controller would move engines back and forth on noise. So the estimate takes every
arrival since the last shift (up to ``longest`` seconds, ``max_samples`` requests), and a
shift is declared when the newest looks (``span`` seconds and ``min_arrivals`` arrivals at
least) differ from the ones before them by more than ``SHIFT_Z`` standard errors in mean
prompt length, mean output length or arrival rate: the estimate then restarts from the newest
looks, so a real change is followed as fast as with a short window."""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from pd_cluster.planner.actuator import Observation, RequestSample

SHIFT_Z = 4.0  # standard errors: a false alarm only shortens the window for a while


@dataclass
class WorkloadWindow:
    span: float  # the newest looks tested against the ones before them cover this long
    longest: float  # the estimate covers this long at most
    min_arrivals: int = 40  # ... and at least this many arrivals (the newest looks)
    max_samples: int = 4000  # newest arrivals the estimate takes at most (its cost per look)
    started: float = 0.0  # the time the oldest look kept covers from
    anchor: float = -math.inf  # the last shift of the rate: the rate covers looks after it
    mix_anchor: float = -math.inf  # the last shift of the lengths: they cover looks after it
    shifts: list[float] = field(default_factory=list)  # when each shift was seen
    looks: deque = field(default_factory=deque)  # (time, arrivals, finished samples)

    def add(self, obs: Observation) -> None:
        self.looks.append((obs.now, list(obs.arrived), list(obs.finished)))
        while self.looks and self.looks[0][0] <= obs.now - self.longest:
            self.started = self.looks.popleft()[0]  # the oldest look kept covers from here
        self._check_shift(obs.now)

    # ---- the estimate --------------------------------------------------------------------
    def _since(self, anchor: float | None = None) -> float:
        return max(self.anchor if anchor is None else anchor, self.started)

    def _current(self, anchor: float | None = None) -> list:
        since = self._since(anchor)
        return [look for look in self.looks if look[0] > since]

    def rate(self, now: float) -> float:
        covered = now - self._since()
        return sum(len(t[1]) for t in self._current()) / covered if covered > 0 else 0.0

    def lengths(self, now: float) -> list[tuple[int, int]]:
        """(prompt, output) tokens of the arrivals since the lengths last shifted (a change
        of the rate alone keeps them: the mix is what needs many requests)."""
        out = [a for t in self._current(self.mix_anchor) for a in t[1]]
        return out[-self.max_samples:]

    def settling(self) -> bool:
        """Fewer than ``min_arrivals`` arrivals since the last shift: the estimate is not to
        be acted on yet (a rate that fell may be the first sign of new lengths too)."""
        since = max(self.anchor, self.mix_anchor)
        return since > self.started and sum(
            len(t[1]) for t in self.looks if t[0] > since) < self.min_arrivals

    def samples(self, within: float, now: float) -> list[RequestSample]:
        """Finished requests seen in the last ``within`` seconds."""
        return [x for t in self.looks if t[0] > now - within for x in t[2]]

    # ---- the shift test ------------------------------------------------------------------
    def _split_recent(self, now: float, anchor: float) -> tuple[list, list, float]:
        """(older looks since ``anchor``, the newest looks, the time between them)."""
        current = self._current(anchor)
        taken, count = 0, 0
        for look in reversed(current):
            if look[0] <= now - self.span and count >= self.min_arrivals:
                break
            taken += 1
            count += len(look[1])
        older = current[:len(current) - taken]
        edge = older[-1][0] if older else self._since(anchor)
        return older, current[len(current) - taken:], edge

    def _check_shift(self, now: float) -> None:
        """The rate and the lengths each against their own estimate (a change of rate alone
        keeps the lengths)."""
        mix = self._shifted(now, self.mix_anchor, 1)
        rate = self._shifted(now, self.anchor, 0)
        if mix is not None:
            self.mix_anchor = mix
            self.anchor = max(self.anchor, mix) if rate is None else rate
        elif rate is not None:
            self.anchor = rate
        if mix is not None or rate is not None:
            self.shifts.append(now)

    def _shifted(self, now: float, anchor: float, which: int) -> float | None:
        """The new anchor if the newest looks differ from the older ones since ``anchor``
        (``which``: 0 the rate, 1 the lengths), else None."""
        older, newest, edge = self._split_recent(now, anchor)
        old = [a for t in older for a in t[1]]
        new = [a for t in newest for a in t[1]]
        since = self._since(anchor)
        if len(old) < self.min_arrivals or _z(old, edge - since, new, now - edge)[which] <= SHIFT_Z:
            return None
        # the newest looks may straddle the change: restart from the look boundary that
        # tells the two sides apart best (so no look of the old traffic lingers)
        current = self._current(anchor)
        best, best_z = since, -1.0
        for k in range(1, len(current)):
            before = [a for t in current[:k] for a in t[1]]
            after = [a for t in current[k:] for a in t[1]]
            if len(after) < _MIN_SIDE:
                break
            cut = current[k - 1][0]
            z = _z(before, cut - since, after, now - cut)[which]
            if z > best_z:
                best, best_z = cut, z
        return best


def _z(old: list, t_old: float, new: list, t_new: float) -> tuple[float, float]:
    """How far apart two sets of arrivals are, in standard errors: (in arrival rate, the
    larger in mean prompt and mean output length)."""
    z_mix = 0.0
    if len(old) >= _MIN_SIDE and len(new) >= _MIN_SIDE:
        a, b = np.array(old, dtype=float), np.array(new, dtype=float)
        z_mix = max(_mean_z(a[:, 0], b[:, 0]), _mean_z(a[:, 1], b[:, 1]))
    return _rate_z(len(old), t_old, len(new), t_new), z_mix


_MIN_SIDE = 8  # arrivals on each side for a mean to be compared


def _mean_z(a: np.ndarray, b: np.ndarray) -> float:
    se = math.sqrt(a.var(ddof=1) / len(a) + b.var(ddof=1) / len(b))
    diff = abs(a.mean() - b.mean())
    return diff / se if se > 0 else (math.inf if diff > 0 else 0.0)


def _rate_z(n1: int, t1: float, n2: int, t2: float) -> float:
    """Poisson counts n1 over t1 s and n2 over t2 s: given n1 + n2, n2 is binomial."""
    n = n1 + n2
    if t1 <= 0 or t2 <= 0 or n == 0:
        return 0.0
    p = t2 / (t1 + t2)
    return abs(n2 - n * p) / math.sqrt(n * p * (1 - p))
