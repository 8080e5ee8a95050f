"""Idle decode cores lent to prefill, on one machine (issue: serve to the SLO at equal compute).

In 1P1D on one node each engine has its own cores, and the decode engine's sit partly idle
while prompts queue at the prefill engine. So the prefill engine runs one more intra-op
thread than it has cores: that thread lives on the prefill engine's cores, and for a prefill
step moves onto the decode engine's cores when the decode engine can pause that long.

- The decode engine (Lender) publishes, on its lending board (lend_board.py), until when it
  may pause: its TPOT slack (tpot_budget.py) over the requests it runs, from its own step
  times. Before every step it looks at the board: a borrow that fits its slack is waited out
  (it sleeps while the prefill step runs on its cores); one that does not, or that overran,
  is revoked at once: it moves the borrowed thread back to the borrower's cores itself
  (sched_setaffinity on the thread), so it never waits more than one check for its cores.
- The prefill engine (Borrower), before a prefill step, sizes the step to what the board's
  slack covers at the rate it measured on lent steps, moves its spare OpenMP thread onto the
  lender's cores and runs the step with one more thread; back home after. With too little
  slack it runs at home, one thread, in chunks of _HOME_CHUNK tokens (so it looks at the board
  again soon). A spare thread left on its home core would halve every parallel region there.

Outputs do not change (greedy-exact tests): a lent step computes the same tokens with one
more thread. The compiled step is compiled for the engine's own thread count (its guards
check it): a lent step runs eagerly, counted in the engine's eager steps. Linux only
(sched_setaffinity on thread ids); elsewhere nothing is lent.
"""
from __future__ import annotations

import logging
import os
import statistics
import time
from collections import deque
from typing import Any

from pd_cluster.driver.lend_board import Board, cores_of, mask
from pd_cluster.tpot_budget import Decoding, StepTimes, pause_slack

logger = logging.getLogger(__name__)

_POLL_S = 0.0005  # a pausing lender re-checks the board this often
_MAX_PUBLISHED_SLACK = 60.0  # s: a lender with nothing to run promises no more than this
_MIN_BORROW_TOKENS = 128  # smaller steps are not worth moving a thread for
_SCAN_S = 2.0  # s between looks for a lender on the node
_HEADROOM = 1.25  # a borrow asks for this much more than its estimate
_HOME_CHUNK = 512  # prompt tokens a step at home takes while a lender is there


class Lender:
    """The decode engine's side (see the module doc)."""

    def __init__(self, board: Board, target_s: float, percentile: float):
        self.board, self.target, self.percentile = board, target_s, percentile
        self.steps = StepTimes()
        self._progress: dict[str, list[float]] = {}  # rid -> [first token's time, tokens, max]
        self._recent_max: deque[int] = deque(maxlen=32)
        self.counters = {"lend_pauses": 0, "lend_pause_seconds": 0.0, "lend_revokes": 0}

    def prepare(self) -> None:
        """On the engine thread, before its first step: nothing to find on this side."""

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

    def slack(self, now: float) -> float:
        running = [Decoding(now - first if first else 0.0, max(int(n), 1), int(mx))
                   for first, n, mx in self._progress.values()]
        newcomer = int(statistics.median(self._recent_max)) if self._recent_max else 0
        return pause_slack(running, self.steps.percentile(self.percentile), self.target,
                           newcomer)

    def publish(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        slack = min(max(self.slack(now), 0.0), _MAX_PUBLISHED_SLACK)
        self.board.set("pause_ok_until", now + slack)

    def before_step(self) -> None:
        """Wait out a borrow that fits the slack; revoke one that does not (or overran)."""
        paused_at = None
        while True:
            now = time.monotonic()
            until, number = self.board.get("borrow_until"), self.board.get("borrow_no")
            if not until or self.board.get("revoked") == number:
                break
            if now >= until or until - now > self.slack(now):
                self._revoke(number)
                break
            if paused_at is None:
                paused_at = now
                self.counters["lend_pauses"] += 1
            time.sleep(min(_POLL_S, until - now))
        if paused_at is not None:
            self.counters["lend_pause_seconds"] += time.monotonic() - paused_at
        self.publish()

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


class Borrower:
    """The prefill engine's side (see the module doc)."""

    def __init__(self, home: tuple[int, ...], spare_threads: int, find_boards: Any = None):
        self.home, self.spare = home, spare_threads
        self._find_boards = find_boards or Board.find
        self.workers: list[int] | None = None  # the spare OpenMP threads (found on first use)
        self._board: Board | None = None
        self._next_scan = 0.0
        self._number = 0
        self.rate = {"home": 0.0, "lent": 0.0}  # prefill tokens/s measured on each kind
        self.counters = {"lend_borrowed_steps": 0, "lend_borrowed_seconds": 0.0,
                         "lend_refused_steps": 0}

    def prepare(self) -> None:
        """On the engine thread, pinned, before its first step: start the OpenMP pool's
        spare threads (a parallel region at the lent thread count) and find them."""
        import torch
        threads = torch.get_num_threads()
        torch.set_num_threads(threads + self.spare)
        try:
            self.workers = omp_workers(self.home, self.spare)
        finally:
            torch.set_num_threads(threads)

    def added(self, request_id: str, max_tokens: int) -> None:
        pass

    def emitted(self, request_id: str, tokens: int, finished: bool, now: float) -> None:
        pass

    def run_step(self, engine: Any) -> Any:
        """Run ``engine.step()``: on lent cores, sized to the lender's slack, where a lender
        can pause for at least a small step; else at home, in chunks small enough that the
        next look at the board comes soon."""
        if self.workers is None:
            self.prepare()
        tokens = engine.prefill_tokens_pending()
        board = self._lender() if tokens >= _MIN_BORROW_TOKENS and self.workers else None
        if board is None:
            return self._timed(engine.step, tokens, "home")
        now = time.monotonic()
        rate = self.rate["lent"] or 1.6 * self.rate["home"]
        fit = int((board.get("pause_ok_until") - now) / _HEADROOM * rate) if rate else 0
        if fit < _MIN_BORROW_TOKENS:
            self.counters["lend_refused_steps"] += 1
            engine.scheduler.next_step_budget = _HOME_CHUNK
            return self._timed(engine.step, min(tokens, _HOME_CHUNK), "home")
        tokens = min(tokens, fit)
        engine.scheduler.next_step_budget = tokens
        return self._lent(engine, board, tokens, now + tokens / rate * _HEADROOM)

    def _lent(self, engine: Any, board: Board, tokens: int, until: float) -> Any:
        import torch
        self._number = (self._number + 1) & 0xFFFFFFFF
        board.set("tid", self.workers[0])
        board.set("home", mask(self.home))
        board.set("borrow_no", self._number)
        board.set("borrow_until", until)
        lent = cores_of(int(board.get("cores")))
        threads = torch.get_num_threads()
        try:
            for tid in self.workers:
                os.sched_setaffinity(tid, lent)
            if board.get("revoked") == self._number:  # revoked before the move: undo it
                self._home()
            torch.set_num_threads(threads + self.spare)
            self.counters["lend_borrowed_steps"] += 1
            return self._timed(engine.step, tokens, "lent")
        finally:
            torch.set_num_threads(threads)
            self._home()
            board.set("borrow_until", 0.0)

    def _home(self) -> None:
        for tid in self.workers or ():
            try:
                os.sched_setaffinity(tid, set(self.home))
            except OSError:
                pass

    def _timed(self, step: Any, tokens: int, kind: str) -> Any:
        t0 = time.perf_counter()
        out = step()
        dt = time.perf_counter() - t0
        if kind == "lent":
            self.counters["lend_borrowed_seconds"] += dt
        if tokens >= _MIN_BORROW_TOKENS and dt > 0:
            old = self.rate[kind]
            self.rate[kind] = tokens / dt if not old else old + 0.2 * (tokens / dt - old)
        return out

    def _lender(self) -> Board | None:
        if self._board is not None and self._board.get("pid") and _alive(self._board):
            return self._board
        if self._board is not None:
            self._board.close()
            self._board = None
        now = time.monotonic()
        if now < self._next_scan:
            return None
        self._next_scan = now + _SCAN_S
        for board in self._find_boards():
            if self._board is None and board.try_lock():
                self._board = board
                logger.info("lending: borrowing cores %s of decode pid %d for prefill steps",
                            sorted(cores_of(int(board.get("cores")))), board.get("pid"))
            else:
                board.close()
        return self._board

    def close(self) -> None:
        if self._board is not None:
            self._home()
            self._board.set("borrow_until", 0.0)
            self._board.close()
            self._board = None


def _alive(board: Board) -> bool:
    try:
        os.kill(int(board.get("pid")), 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def omp_workers(cores: tuple[int, ...], expected: int) -> list[int]:
    """The OpenMP worker threads of the calling thread's pool (call it on the engine thread,
    pinned to ``cores``, torch's thread count set): threads that its first parallel region
    starts, pinned like it. Empty (and logged) when they cannot be told apart."""
    import torch
    before = set(os.listdir("/proc/self/task"))
    x = torch.ones(1 << 21)
    for _ in range(3):  # parallel regions with torch's thread count: the pool starts
        x.add_(1.0)
    after = set(os.listdir("/proc/self/task"))
    found = []
    for tid in sorted(after - before, key=int):
        try:
            if os.sched_getaffinity(int(tid)) == set(cores):
                found.append(int(tid))
        except OSError:
            continue
    if len(found) != expected:
        logger.warning("lending: found %d spare OpenMP threads, expected %d; not borrowing",
                       len(found), expected)
        return []
    return found


def make_lending(role: str, cores: tuple[int, ...], spare: int, target_s: float,
                 percentile: float) -> Lender | Borrower | None:
    """This engine's side of core lending: a decode engine pinned to ``cores`` lends them, a
    prefill engine with ``spare`` threads borrows; None where nothing is lent (not pinned,
    another role, no sched_setaffinity, or the board cannot be made: logged)."""
    if not cores or not hasattr(os, "sched_setaffinity"):
        return None
    if role == "decode":
        try:
            return Lender(Board.create(cores), target_s, percentile)
        except OSError as e:
            logger.warning("lending: cannot publish a lending board (%s); not lending", e)
            return None
    if role == "prefill" and spare > 0:
        return Borrower(cores, spare)
    return None
