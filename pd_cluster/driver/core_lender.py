"""The lending side of core sharing (core_lending.py has the life cycle): what an engine can
spare of its cores (``TpotSlack`` on a decode engine, ``IdleSlack`` on a prefill engine),
published on its lending board, and the borrows it waits out or revokes (``Lender``)."""
from __future__ import annotations

import os
import statistics
import time
from collections import deque
from typing import Any

from pd_cluster.driver.lend_board import Board, cores_of
from pd_cluster.tpot_budget import Decoding, StepTimes, pause_slack

_POLL_S = 0.0005  # a pausing lender re-checks the board this often
_MAX_PUBLISHED_SLACK = 60.0  # s: a lender with nothing to run promises no more than this


class TpotSlack:
    """What a decode engine can spare: the pause its running requests (and one that would
    arrive meanwhile) absorb within the TPOT target, from its own decode step times."""

    def __init__(self, target_s: float, percentile: float):
        self.target, self.percentile = target_s, percentile
        self.steps = StepTimes()
        self._progress: dict[str, list[float]] = {}  # rid -> [first token's time, tokens, max]
        self._recent_max: deque[int] = deque(maxlen=32)

    def added(self, request_id: str, max_tokens: int) -> None:
        self._progress[request_id] = [0.0, 0, max_tokens]
        self._recent_max.append(max_tokens)

    def emitted(self, request_id: str, tokens: int, finished: bool, now: float) -> None:
        entry = self._progress.get(request_id)
        if entry is None:
            return
        if tokens and not entry[0]:
            entry[0] = now
        entry[1] += tokens
        if finished:
            del self._progress[request_id]

    def step_done(self, seconds: float, produced: bool) -> None:
        if produced:
            self.steps.add(seconds)

    def __call__(self, now: float, engine: Any) -> float:
        running = [Decoding(now - first if first else 0.0, max(int(n), 1), int(mx))
                   for first, n, mx in self._progress.values()]
        newcomer = int(statistics.median(self._recent_max)) if self._recent_max else 0
        return pause_slack(running, self.steps.percentile(self.percentile), self.target,
                           newcomer)


class IdleSlack:
    """What a prefill engine can spare: everything while it has no prompt tokens to compute,
    nothing once it has (its queue's TTFT comes first)."""

    def added(self, request_id: str, max_tokens: int) -> None:
        pass

    def emitted(self, request_id: str, tokens: int, finished: bool, now: float) -> None:
        pass

    def step_done(self, seconds: float, produced: bool) -> None:
        pass

    def __call__(self, now: float, engine: Any) -> float:
        busy = engine is not None and engine.prefill_tokens_pending() > 0
        return 0.0 if busy else float("inf")


class Lender:
    """The side of an engine whose cores are lent (see the module doc)."""

    def __init__(self, board: Board, slack: TpotSlack | IdleSlack):
        self.board, self.slack = board, slack
        self.counters = {"lend_pauses": 0, "lend_pause_seconds": 0.0, "lend_revokes": 0}

    def publish(self, engine: Any = None, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        slack = min(max(self.slack(now, engine), 0.0), _MAX_PUBLISHED_SLACK)
        self.board.set("pause_ok_until", now + slack)

    def before_step(self, engine: Any = None) -> None:
        """Wait out a borrow that fits the slack; revoke one that does not (or overran)."""
        paused_at = None
        while True:
            now = time.monotonic()
            until, number = self.board.get("borrow_until"), self.board.get("borrow_no")
            if not until or self.board.get("revoked") == number:
                break
            slack = self.slack(now, engine)
            if slack == float("inf"):  # this step needs none of the cores: run beside it
                break
            if now >= until or until - now > slack:
                self._revoke(number)
                break
            if paused_at is None:
                paused_at = now
                self.counters["lend_pauses"] += 1
            time.sleep(min(_POLL_S, until - now))
        if paused_at is not None:
            self.counters["lend_pause_seconds"] += time.monotonic() - paused_at
        self.publish(engine)

    def _revoke(self, number: int) -> None:
        try:
            os.sched_setaffinity(int(self.board.get("tid")), cores_of(int(self.board.get("home"))))
        except (ProcessLookupError, OSError):
            pass  # the thread is gone: nothing runs on our cores
        self.board.set("revoked", number)
        self.counters["lend_revokes"] += 1

    def close(self) -> None:
        self.board.set("pause_ok_until", 0.0)
        self.board.close(remove=True)
