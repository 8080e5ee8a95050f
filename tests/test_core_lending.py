"""Core sharing between a decode and a prefill engine of one node (driver/core_lending.py):
the board, the prefill step's borrow that fits the decode engine's TPOT slack, the decode
step's borrow of an idle prefill engine's cores, the revokes that give cores back at once,
and the spare OpenMP thread found on the engine thread."""
from __future__ import annotations

import contextlib
import os
import threading
import time

import pytest

from pd_cluster.driver.core_borrower import Borrower, DecodeSteps, PromptSteps
from pd_cluster.driver.core_lender import IdleSlack, Lender, TpotSlack
from pd_cluster.driver.core_lending import CoreSharing, make_sharing
from pd_cluster.driver.lend_board import Board, cores_of, mask

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs Linux thread affinity and 2 cores")


@pytest.fixture
def cores() -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(the borrower's home cores, the lender's cores)."""
    a, b = sorted(os.sched_getaffinity(0))[:2]
    return (a,), (b,)


class _Thread:
    """A thread standing in for the prefill engine's spare OpenMP thread."""

    def __init__(self, home: tuple[int, ...]) -> None:
        self.stop, self.ready = threading.Event(), threading.Event()
        self.tid = 0
        self._t = threading.Thread(target=self._run, args=(home,), daemon=True)
        self._t.start()
        assert self.ready.wait(10)

    def _run(self, home: tuple[int, ...]) -> None:
        os.sched_setaffinity(0, home)
        self.tid = threading.get_native_id()
        self.ready.set()
        self.stop.wait(60)

    def cores(self) -> set[int]:
        return os.sched_getaffinity(self.tid)

    def close(self) -> None:
        self.stop.set()
        self._t.join(10)


class _Engine:
    """The engine's face a borrower sees: its pending prefill, its scheduler, its step."""

    def __init__(self, step, tokens: int = 512) -> None:
        self._step, self.tokens = step, tokens
        self.scheduler = type("S", (), {"next_step_budget": None})()
        self.budgets: list[int | None] = []

    def prefill_tokens_pending(self) -> int:
        return self.tokens

    def step(self):
        self.budgets.append(self.scheduler.next_step_budget)
        return self._step()


def _pair(tmp_path, cores, target_s: float = 0.05):
    home, lent = cores
    lender = Lender(Board.create(lent, folder=tmp_path), TpotSlack(target_s, 90.0))
    borrower = Borrower(home, 1, "decode", PromptSteps(),
                        find_boards=lambda: Board.find(folder=tmp_path))
    thread = _Thread(home)
    borrower.workers = [thread.tid]
    borrower.steps.rate["home"] = 1000.0  # tokens/s, as if measured: 512 tokens ~ 0.3 s lent
    return lender, borrower, thread


def test_board_fields_roundtrip_and_dead_lenders_are_cleared(tmp_path) -> None:
    board = Board.create((1, 3), folder=tmp_path)
    assert cores_of(int(board.get("cores"))) == {1, 3} and mask({1, 3}) == 0b1010
    board.set("pause_ok_until", 12.5)
    (found,) = Board.find(folder=tmp_path)
    assert found.get("pause_ok_until") == 12.5 and found.get("pid") == os.getpid()
    found.close()
    board.set("pid", 2 ** 22 + 12345)  # no such process: a stale board
    assert Board.find(folder=tmp_path) == [] and not board.path.exists()
    board.close()


def test_idle_lender_lends_and_the_step_runs_on_its_cores(tmp_path, cores) -> None:
    lender, borrower, thread = _pair(tmp_path, cores)
    try:
        lender.publish()  # nothing running: the board says it may pause (up to the cap)
        seen: list[set[int]] = []
        engine = _Engine(lambda: seen.append(thread.cores()) or "outputs")
        assert borrower.run_step(engine) == "outputs"
        assert seen == [set(cores[1])]  # on the lender's cores meanwhile
        assert engine.budgets == [512]  # the whole pending prefill fits the idle slack
        assert thread.cores() == set(cores[0])  # and home after
        assert borrower.counters["lend_borrowed_steps"] == 1
        assert lender.board.get("borrow_until") == 0.0
    finally:
        thread.close()
        borrower.close()
        lender.close()


def test_no_borrow_beyond_the_published_slack(tmp_path, cores) -> None:
    lender, borrower, thread = _pair(tmp_path, cores, target_s=0.02)
    try:
        lender.slack.added("r", 129)
        now = time.monotonic()
        for i in range(65):  # decoding at 19 ms a token against a 20 ms target: no slack
            lender.slack.step_done(0.019, True)
        lender.slack.emitted("r", 65, False, now - 64 * 0.019)
        lender.publish()
        seen: list[set[int]] = []
        engine = _Engine(lambda: seen.append(thread.cores()), tokens=2048)
        borrower.run_step(engine)
        assert seen == [set(cores[0])] and borrower.counters["lend_refused_steps"] == 1
        assert engine.budgets == [512]  # at home, in chunks: the board is looked at again soon
    finally:
        thread.close()
        borrower.close()
        lender.close()


@contextlib.contextmanager
def _held_step(lender, borrower, thread, tokens: int = 512):
    """A borrowed step that lasts until the test sets the event it is given (everything is
    released and closed at the block's end)."""
    in_step, release = threading.Event(), threading.Event()

    def step() -> None:
        in_step.set()
        assert release.wait(30)

    t = threading.Thread(target=borrower.run_step, args=(_Engine(step, tokens=tokens),),
                         daemon=True)
    try:
        t.start()
        assert in_step.wait(10)
        yield release, t
    finally:
        release.set()
        t.join(10)
        thread.close()
        borrower.close()
        lender.close()


def test_lender_with_new_work_takes_its_cores_back_within_one_check(tmp_path, cores) -> None:
    lender, borrower, thread = _pair(tmp_path, cores, target_s=0.02)
    lender.publish()
    with _held_step(lender, borrower, thread) as (release, t):
        assert thread.cores() == set(cores[1])
        # A request arrives whose TPOT cannot absorb the borrow's remaining ~0.3 s.
        lender.slack.added("r", 8)
        lender.slack.step_done(0.019, True)
        t0 = time.monotonic()
        lender.before_step()
        assert time.monotonic() - t0 < 0.05  # no waiting out the borrow
        assert thread.cores() == set(cores[0]) and lender.counters["lend_revokes"] == 1
        release.set()
        t.join(10)
        assert thread.cores() == set(cores[0])  # the step ended at home


def test_lender_waits_out_a_borrow_that_fits_its_slack(tmp_path, cores) -> None:
    lender, borrower, thread = _pair(tmp_path, cores, target_s=1.0)
    lender.publish()
    in_step = threading.Event()

    def step() -> None:
        in_step.set()
        time.sleep(0.2)

    t = threading.Thread(target=borrower.run_step, args=(_Engine(step),), daemon=True)
    try:
        t.start()
        assert in_step.wait(10)
        lender.slack.added("r", 64)  # 1 s a token allowed: the pause fits
        lender.before_step()  # returns when the borrower gives the board back
        assert lender.board.get("borrow_until") == 0.0
        assert lender.counters["lend_pauses"] == 1 and lender.counters["lend_revokes"] == 0
    finally:
        t.join(10)
        thread.close()
        borrower.close()
        lender.close()


def test_a_slack_smaller_than_the_prefill_sizes_the_lent_step(tmp_path, cores) -> None:
    lender, borrower, thread = _pair(tmp_path, cores)
    try:
        borrower.steps.rate["lent"] = 2000.0
        lender.board.set("pause_ok_until", time.monotonic() + 0.25)  # 0.2 s after headroom
        engine = _Engine(lambda: None, tokens=2048)
        borrower.run_step(engine)
        (budget,) = engine.budgets
        assert 300 <= budget <= 400 and borrower.counters["lend_borrowed_steps"] == 1
    finally:
        thread.close()
        borrower.close()
        lender.close()


def test_spare_omp_thread_is_found_and_the_engine_keeps_its_thread_count(cores) -> None:
    import torch
    found: list[tuple[list[int], int]] = []

    def engine_thread() -> None:  # as the engine loop: pin, set the threads, then prepare
        os.sched_setaffinity(0, cores[0])
        torch.set_num_threads(1)
        b = Borrower(cores[0], 1, "decode", PromptSteps(), find_boards=list)
        b.prepare()
        found.append((b.workers, torch.get_num_threads()))

    t = threading.Thread(target=engine_thread)
    t.start()
    t.join(60)
    ((workers, threads),) = found
    assert len(workers) == 1 and os.sched_getaffinity(workers[0]) == set(cores[0])
    assert threads == 1


def _decode_pair(tmp_path, cores):
    """A prefill engine lending its cores (``cores[1]``) to a decode engine (home ``cores[0]``)."""
    home, lent = cores
    lender = Lender(Board.create(lent, "prefill", folder=tmp_path), IdleSlack())
    borrower = Borrower(home, 1, "prefill", DecodeSteps(),
                        find_boards=lambda: Board.find("prefill", folder=tmp_path))
    thread = _Thread(home)
    borrower.workers = [thread.tid]
    return lender, borrower, thread


def test_an_idle_prefill_engine_lends_its_cores_to_a_decode_step(tmp_path, cores) -> None:
    lender, borrower, thread = _decode_pair(tmp_path, cores)
    try:
        lender.publish(_Engine(lambda: None, tokens=0))  # no prompt to compute: all of it
        seen: list[set[int]] = []
        engine = _Engine(lambda: seen.append(thread.cores()) or "outputs", tokens=0)
        assert borrower.run_step(engine) == "outputs"
        assert seen == [set(cores[1])] and thread.cores() == set(cores[0])
        assert engine.budgets == [None]  # a decode step is not resized
        assert borrower.counters["lend_borrowed_steps"] == 1
        assert borrower.steps.seconds["lent"] > 0  # what the next borrow asks for
        # A decode engine with a prompt of its own to compute does not borrow for that step.
        seen.clear()
        borrower.run_step(_Engine(lambda: seen.append(thread.cores()), tokens=300))
        assert seen == [set(cores[0])] and borrower.counters["lend_borrowed_steps"] == 1
        # A prefill engine with a prompt to compute offers nothing.
        lender.publish(_Engine(lambda: None, tokens=300))
        borrower.run_step(_Engine(lambda: seen.append(thread.cores()), tokens=0))
        assert seen[-1] == set(cores[0]) and borrower.counters["lend_refused_steps"] == 1
    finally:
        thread.close()
        borrower.close()
        lender.close()


def test_a_prompt_at_the_prefill_engine_takes_its_cores_back_at_once(tmp_path, cores) -> None:
    lender, borrower, thread = _decode_pair(tmp_path, cores)
    lender.publish(_Engine(lambda: None, tokens=0))
    with _held_step(lender, borrower, thread, tokens=0) as (release, t):
        assert thread.cores() == set(cores[1])
        # Waiting for its sends only (no prompt to compute), the prefill engine's step runs
        # beside the borrow: it neither waits nor revokes.
        t0 = time.monotonic()
        lender.before_step(_Engine(lambda: None, tokens=0))
        assert time.monotonic() - t0 < 0.05 and thread.cores() == set(cores[1])
        assert lender.counters["lend_revokes"] == 0 and lender.counters["lend_pauses"] == 0
        # A prompt arrives: its cores come back now, not when the decode step ends.
        t0 = time.monotonic()
        lender.before_step(_Engine(lambda: None, tokens=300))
        assert time.monotonic() - t0 < 0.05
        assert thread.cores() == set(cores[0]) and lender.counters["lend_revokes"] == 1
        assert lender.board.get("pause_ok_until") <= time.monotonic()  # nothing offered now
        release.set()
        t.join(10)
        assert thread.cores() == set(cores[0])


@pytest.mark.parametrize("lend,borrow", [(True, True), (True, False), (False, True)])
def test_each_role_lends_and_borrows_as_configured(tmp_path, monkeypatch, cores, lend,
                                                   borrow) -> None:
    import pd_cluster.driver.lend_board as lend_board
    monkeypatch.setattr(lend_board, "board_dir", lambda: tmp_path)
    for role, slack, steps, other in (("decode", TpotSlack, DecodeSteps, "prefill"),
                                      ("prefill", IdleSlack, PromptSteps, "decode")):
        sharing = make_sharing(role, cores[0], lend, borrow, 0.05, 90.0)
        assert isinstance(sharing, CoreSharing)
        try:
            assert (sharing.lender is not None) == lend
            assert (sharing.borrower is not None) == borrow
            if lend:
                assert isinstance(sharing.lender.slack, slack)
                assert sharing.lender.board.path.name.startswith(f"{role}-")
            if borrow:
                assert isinstance(sharing.borrower.steps, steps)
                assert sharing.borrower.lender_role == other
        finally:
            sharing.close()
    assert make_sharing("colocated", cores[0], True, True, 0.05, 90.0) is None
    assert make_sharing("decode", (), True, True, 0.05, 90.0) is None  # not pinned
    assert make_sharing("decode", cores[0], False, False, 0.05, 90.0) is None
    assert list(tmp_path.iterdir()) == []  # every board removed on close
