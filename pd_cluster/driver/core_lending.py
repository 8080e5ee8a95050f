"""Cores shared both ways between a prefill and a decode engine on one machine.

In 1P1D on one node each engine has its own cores, and each sits partly idle while the other
has work: the decode engine's while prompts queue at the prefill engine, the prefill engine's
between prompts. So each engine runs one more intra-op thread than it has cores (its spare
thread, on its own cores), and for a step moves it onto the other engine's cores when that
engine can spare them that long:

- A lender publishes, on its lending board (lend_board.py), until when it may pause, from its
  own measure of what it can spare (``TpotSlack`` for a decode engine: its TPOT slack over the
  requests it runs, from its own step times; ``IdleSlack`` for a prefill engine: for as long
  as it has no prompt tokens to compute, and not at all once it has). Before every step it
  looks at the board: a borrow that fits what it can spare is waited out (it sleeps while the
  borrowed step runs on its cores; a step that needs none of them, as a prefill engine's with
  no prompt to compute, runs beside it); one that does not, or that overran, is revoked: it
  moves the borrowed thread back to the borrower's cores itself (sched_setaffinity on the
  thread), so it never waits more than one check for its cores.
- A borrower, before a step, sizes it to what the board's pause covers (``PromptSteps`` on a
  prefill engine: the step's prompt tokens at the rate it measured on lent steps;
  ``DecodeSteps`` on a decode engine: a whole decode step, when the pause covers the time its
  lent steps took), moves its spare thread onto the lender's cores and runs the step with one
  more thread; back home after. A prefill engine with too little pause runs at home in chunks
  of _HOME_CHUNK tokens (so it looks at the board again soon). A spare thread left on its home
  core would halve every parallel region there, so a step at home runs without it.

``CoreSharing`` is one engine's part: its lender, its borrower, or both; the engine loop calls
it around every step. Outputs do not change (greedy-exact tests): a lent step computes the same
tokens with one more thread. The compiled step is compiled for the engine's own thread count
(its guards check it): a lent step runs eagerly, counted in the engine's eager steps. Linux
only (sched_setaffinity on thread ids); elsewhere nothing is lent.
"""
from __future__ import annotations

import logging
import os
import statistics
import time
from collections import deque
from typing import Any, Callable

from pd_cluster.driver.lend_board import Board, cores_of, mask
from pd_cluster.tpot_budget import Decoding, StepTimes, pause_slack

logger = logging.getLogger(__name__)

_POLL_S = 0.0005  # a pausing lender re-checks the board this often
_MAX_PUBLISHED_SLACK = 60.0  # s: a lender with nothing to run promises no more than this
_MIN_BORROW_TOKENS = 128  # smaller prompt steps are not worth moving a thread for
_SCAN_S = 2.0  # s between looks for a lender on the node
_HEADROOM = 1.25  # a borrow asks for this much more than its estimate
_HOME_CHUNK = 512  # prompt tokens a step at home takes while a lender is there
_FIRST_DECODE_BORROW_S = 0.05  # a decode step's estimate before one was measured
_EWMA = 0.2  # weight of the newest measure in a borrower's running estimates


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


class CoreSharing:
    """One engine's part in core sharing: the lender of its cores, the borrower of another's,
    or both. The engine loop calls it around every step, on the engine thread."""

    def __init__(self, lender: Lender | None, borrower: Borrower | None):
        self.lender, self.borrower = lender, borrower

    @property
    def counters(self) -> dict[str, Any]:
        return {**(self.lender.counters if self.lender else {}),
                **(self.borrower.counters if self.borrower else {})}

    def prepare(self) -> None:
        """On the engine thread, pinned, before its first step."""
        if self.borrower is not None:
            self.borrower.prepare()

    def idle(self, engine: Any) -> None:
        """The engine has nothing to run: renew what it offers (a newcomer's share)."""
        if self.lender is not None:
            self.lender.publish(engine)

    def step(self, engine: Any) -> Any:
        """``engine.step()``, after the lender's look at its board, on lent cores where the
        borrower may."""
        if self.lender is not None:
            self.lender.before_step(engine)
        t0 = time.perf_counter()
        out = self.borrower.run_step(engine) if self.borrower is not None else engine.step()
        if self.lender is not None:
            self.lender.slack.step_done(time.perf_counter() - t0, bool(out))
        return out

    def added(self, request_id: str, max_tokens: int) -> None:
        if self.lender is not None:
            self.lender.slack.added(request_id, max_tokens)

    def emitted(self, request_id: str, tokens: int, finished: bool, now: float) -> None:
        if self.lender is not None:
            self.lender.slack.emitted(request_id, tokens, finished, now)

    def close(self) -> None:
        if self.borrower is not None:
            self.borrower.close()
        if self.lender is not None:
            self.lender.close()


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


_OTHER = {"prefill": "decode", "decode": "prefill"}


def make_sharing(role: str, cores: tuple[int, ...], lend: bool, borrow: bool,
                 target_s: float, percentile: float) -> CoreSharing | None:
    """This engine's part in core sharing: a pinned prefill or decode engine lends its cores
    (``lend``) and borrows the other role's with one spare thread (``borrow``); None where
    nothing is shared (not pinned, another role, no sched_setaffinity; a board that cannot be
    made is logged and that side left out)."""
    if not cores or role not in _OTHER or not hasattr(os, "sched_setaffinity"):
        return None
    lender = borrower = None
    if lend:
        slack = TpotSlack(target_s, percentile) if role == "decode" else IdleSlack()
        try:
            lender = Lender(Board.create(cores, role), slack)
        except OSError as e:
            logger.warning("lending: cannot publish a lending board (%s); not lending", e)
    if borrow:
        steps = PromptSteps() if role == "prefill" else DecodeSteps()
        borrower = Borrower(cores, 1, _OTHER[role], steps)
    return CoreSharing(lender, borrower) if lender or borrower else None
