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

``CoreSharing`` (here) is one engine's part: its lender (core_lender.py), its borrower
(core_borrower.py), or both; the engine loop calls it around every step. Outputs do not change (greedy-exact tests): a lent step computes the same
tokens with one more thread. The compiled step is compiled for the engine's own thread count
(its guards check it): a lent step runs eagerly, counted in the engine's eager steps. Linux
only (sched_setaffinity on thread ids); elsewhere nothing is lent.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any

from pd_cluster.driver.core_borrower import Borrower, DecodeSteps, PromptSteps
from pd_cluster.driver.core_lender import IdleSlack, Lender, TpotSlack
from pd_cluster.driver.lend_board import Board

logger = logging.getLogger(__name__)


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
