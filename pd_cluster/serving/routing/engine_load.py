"""What the proxy measures online about each engine and the KV link, for the TTFT model.

Per engine: the prefill work queued on it (prompt tokens of legs it has not answered yet, a
running sum: a leg stops counting at its first output, when it fails (Leg.fail) or when it is
gone, e.g. cancelled: legs are held weakly, no release call) and its prefill rate, measured as a service rate: each leg's computed tokens
over the time since the later of its submission and the previous leg's first output (the
engine was working on prefills, or decodes between them, all that time), accumulated until
enough tokens make one sample. Prefills batched into one step finish together and merge into
one sample; chunked ones count when they finish. So the rate is what a newcomer actually gets,
decode steps and the decode engines' per-step prefill cap included.
Per cluster: the link's bandwidth (from P's kv_bytes_sent / kv_send_seconds, its engine stats)
and latency (D's first output after P's, for remote prefills shipping few tokens).
"""
from __future__ import annotations

import time
import weakref
from typing import Any

DEFAULT_PREFILL_RATE = 4000.0  # tokens/s before the first measurement (a small model on CPU)
DEFAULT_BANDWIDTH = 1e9  # bytes/s
DEFAULT_LINK_LATENCY = 0.002  # s
_MIN_SAMPLE_TOKENS = 128  # fewer tokens per sample measure the step overhead, not the rate
_ALPHA = 0.2
_SAME_STEP = 0.001  # s: first outputs this close together came from one engine step
STALE_RATE_S = 2.0  # s without a sample before an engine's rate is stale
_WARMUP_SAMPLES = 2  # an engine's first prefills (first forward, allocations) are not its rate


class Ewma:
    """An exponentially weighted mean that drops its first ``skip`` samples (a fresh engine's
    first requests pay one-time costs) and takes each later one within [value/4, value*4], so
    one outlier moves it a step, not all the way. A sample after ``stale`` s without one starts
    it afresh: what it held describes a past state of the engine."""

    def __init__(self, default: float, alpha: float = _ALPHA, skip: int = 0,
                 stale: float = float("inf")):
        self.default, self.alpha, self.skip, self.stale = default, alpha, skip, stale
        self.value: float | None = None
        self.samples = 0
        self.updated = 0.0  # time.monotonic() of the last sample taken

    def is_stale(self) -> bool:
        return self.value is not None and time.monotonic() - self.updated > self.stale

    def add(self, x: float) -> None:
        self.samples += 1
        if self.samples <= self.skip:
            return
        if self.value is None or self.is_stale():
            self.value = x
        else:
            x = min(max(x, self.value / 4), self.value * 4)
            self.value += self.alpha * (x - self.value)
        self.updated = time.monotonic()

    def get(self) -> float:
        return self.default if self.value is None else self.value


class EngineLoad:
    def __init__(self, default_rate: float = DEFAULT_PREFILL_RATE):
        self.prefill_rate = Ewma(default_rate, skip=_WARMUP_SAMPLES, stale=STALE_RATE_S)
        # id(leg) -> (weak ref to it, tokens it computes, submitted at)
        self._pending: dict[int, tuple[Any, int, float]] = {}
        self._backlog = 0  # sum of _pending's tokens, kept as legs come and go (read per plan)
        self._last_done = 0.0  # time.monotonic() of the last first output
        self._acc = [0, 0.0]  # tokens and seconds not yet in a sample

    def backlog(self) -> int:
        """Prompt tokens queued here: legs started and not answered yet."""
        return self._backlog

    def add(self, leg: Any, tokens: int) -> None:
        """``leg`` (its engine is this one) will compute ``tokens`` prompt tokens. It stops
        counting at its first output, when it fails (``leg.on_fail``) or when it is gone."""
        key = id(leg)
        self._drop(key)  # the same leg added again replaces its entry
        if not _waiting(leg):
            return
        self._pending[key] = (weakref.ref(leg, lambda _r: self._drop(key)),
                              tokens, time.monotonic())
        self._backlog += tokens
        leg.on_fail = lambda: self._drop(key)  # holds the leg's id: no cycle keeps it alive

    def _drop(self, key: int) -> tuple[Any, int, float] | None:
        entry = self._pending.pop(key, None)
        if entry is not None:
            self._backlog -= entry[1]
        return entry

    def first_output(self, leg_id: int, n_prompt: int, num_cached: int) -> None:
        """The first output of the leg ``id(leg) == leg_id`` arrived: it no longer queues;
        a long enough prefill is a rate sample."""
        entry = self._drop(leg_id)
        if entry is None:
            return
        _, _, t0 = entry
        now = time.monotonic()
        interval = max(now - max(t0, self._last_done), 0.0)
        # A departure with time of its own closes the previous step's batch: sample it whole.
        if interval > _SAME_STEP and self._acc[0] >= _MIN_SAMPLE_TOKENS and self._acc[1] > 0:
            self.prefill_rate.add(self._acc[0] / self._acc[1])
            self._acc = [0, 0.0]
        self._acc[0] += max(n_prompt - num_cached, 1)
        self._acc[1] += interval
        self._last_done = now


class LinkStats:
    """The KV link, measured from P's send counters and from remote prefills' timings."""

    def __init__(self) -> None:
        self.bandwidth = Ewma(DEFAULT_BANDWIDTH)
        self.latency = Ewma(DEFAULT_LINK_LATENCY)
        self.bytes_per_token: float | None = None  # reported by the engines
        self._last: dict[str, tuple[float, float]] = {}  # engine -> (bytes sent, send seconds)

    def engine_stats(self, engine: str, stats: dict[str, Any]) -> None:
        """A producer's latest stats (health check): the bytes/seconds since the last ones."""
        sent, secs = stats.get("kv_bytes_sent"), stats.get("kv_send_seconds")
        if not isinstance(sent, (int, float)) or not isinstance(secs, (int, float)):
            return
        prev = self._last.get(engine)
        self._last[engine] = (float(sent), float(secs))
        if prev is None:
            return
        d_bytes, d_secs = sent - prev[0], secs - prev[1]
        if d_bytes > 0 and d_secs > 0:  # a restart resets the counters: negative, skipped
            self.bandwidth.add(d_bytes / d_secs)


def _waiting(leg: Any) -> bool:
    return leg.next_seq == 0 and leg.failure is None and not leg.finished
