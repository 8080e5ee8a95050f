"""The borrowing side of core sharing (core_lending.py has the life cycle): how a step on
another engine's cores is sized (``PromptSteps`` on a prefill engine, ``DecodeSteps`` on a
decode engine), and the spare OpenMP thread moved there for it (``Borrower``)."""
from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable

from pd_cluster.driver.lend_board import Board, cores_of, mask

logger = logging.getLogger(__name__)

_MIN_BORROW_TOKENS = 128  # smaller prompt steps are not worth moving a thread for
_SCAN_S = 2.0  # s between looks for a lender on the node
_HEADROOM = 1.25  # a borrow asks for this much more than its estimate
_HOME_CHUNK = 512  # prompt tokens a step at home takes while a lender is there
_FIRST_DECODE_BORROW_S = 0.05  # a decode step's estimate before one was measured
_EWMA = 0.2  # weight of the newest measure in a borrower's running estimates


class PromptSteps:
    """A prefill engine's borrows: the step's prompt tokens, sized to the lender's pause at
    the rate measured on lent steps (prompt tokens/s)."""

    def __init__(self) -> None:
        self.rate = {"home": 0.0, "lent": 0.0}

    def plan(self, engine: Any, pause_s: float, counters: dict[str, Any]
             ) -> tuple[float | None, int]:
        """(the borrow's length in s, None: at home; the step's prompt tokens), the step's
        budget set on the scheduler."""
        tokens = engine.prefill_tokens_pending()
        if tokens < _MIN_BORROW_TOKENS:
            return None, tokens
        rate = self.rate["lent"] or 1.6 * self.rate["home"]
        fit = int(pause_s / _HEADROOM * rate) if rate else 0
        if fit < _MIN_BORROW_TOKENS:
            counters["lend_refused_steps"] += 1
            engine.scheduler.next_step_budget = _HOME_CHUNK
            return None, min(tokens, _HOME_CHUNK)
        tokens = min(tokens, fit)
        engine.scheduler.next_step_budget = tokens
        return tokens / rate * _HEADROOM, tokens

    def measured(self, tokens: int, seconds: float, kind: str) -> None:
        if tokens >= _MIN_BORROW_TOKENS and seconds > 0:
            self.rate[kind] = _ewma(self.rate[kind], tokens / seconds)


class DecodeSteps:
    """A decode engine's borrows: a whole decode step (no prompt tokens in it), when the
    lender's pause covers the time lent decode steps took."""

    def __init__(self) -> None:
        self.seconds = {"home": 0.0, "lent": 0.0}

    def plan(self, engine: Any, pause_s: float, counters: dict[str, Any]
             ) -> tuple[float | None, int]:
        """(the borrow's length in s, None: at home; the step's prompt tokens)."""
        tokens = engine.prefill_tokens_pending()
        if tokens:
            return None, tokens
        need = (self.seconds["lent"] or self.seconds["home"] or _FIRST_DECODE_BORROW_S)
        need *= _HEADROOM
        if pause_s < need:
            counters["lend_refused_steps"] += 1
            return None, 0
        return need, 0

    def measured(self, tokens: int, seconds: float, kind: str) -> None:
        if not tokens and seconds > 0:
            self.seconds[kind] = _ewma(self.seconds[kind], seconds)


def _ewma(old: float, new: float) -> float:
    return new if not old else old + _EWMA * (new - old)


class Borrower:
    """The side of an engine that borrows another's cores (see the module doc)."""

    def __init__(self, home: tuple[int, ...], spare_threads: int, lender_role: str,
                 steps: PromptSteps | DecodeSteps, find_boards: Any = None):
        self.home, self.spare, self.steps = home, spare_threads, steps
        self.lender_role = lender_role
        self._find_boards = find_boards or (lambda: Board.find(lender_role))
        self.workers: list[int] | None = None  # the spare OpenMP threads (found on first use)
        self._board: Board | None = None
        self._next_scan = 0.0
        self._number = 0
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

    def run_step(self, engine: Any) -> Any:
        """Run ``engine.step()``: on lent cores where the lender can pause for the step (as
        ``steps`` sizes it), else at home."""
        if self.workers is None:
            self.prepare()
        board = self._lender() if self.workers else None
        if board is None:
            return self._timed(engine.step, engine.prefill_tokens_pending(), "home")
        now = time.monotonic()
        length, tokens = self.steps.plan(engine, board.get("pause_ok_until") - now,
                                         self.counters)
        if length is None:
            return self._timed(engine.step, tokens, "home")
        return self._lent(engine, board, tokens, now + length)

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

    def _timed(self, step: Callable[[], Any], tokens: int, kind: str) -> Any:
        t0 = time.perf_counter()
        out = step()
        dt = time.perf_counter() - t0
        if kind == "lent":
            self.counters["lend_borrowed_seconds"] += dt
        self.steps.measured(tokens, dt, kind)
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
                logger.info("lending: borrowing cores %s of %s pid %d", sorted(cores_of(int(
                    board.get("cores")))), self.lender_role, board.get("pid"))
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
