"""Backing off speculation where it fails: a verification that accepted nothing cost a wider
step (and, for a draft model, k draft forwards) for one token. A request whose drafts keep
failing proposes again only after 1, 2, 4 ... 32 steps (a probe; reset by the first accepted
draft), 8x that while most of the engine's recent drafts failed (a large batch of ungrounded
requests would otherwise have one of them verifying in most steps). Text where drafts fail
then runs almost as without speculation; text where they start to succeed is found again by
the next probe."""
from __future__ import annotations

from typing import Protocol

MAX_COOLDOWN = 32
LOW_RATE, LOW_RATE_SCALE = 0.2, 8  # accepted / drafted below which backing off is longer


class BackoffState(Protocol):
    misses: int  # verifications in a row that accepted nothing
    cooldown: int  # steps left without proposing


class Backoff:
    """One engine's: the recent acceptance rate, and each request's misses and cooldown."""

    def __init__(self) -> None:
        self.rate = 0.5  # accepted / drafted, a moving average over recent verifications

    def observe(self, state: BackoffState, num_drafts: int, num_accepted: int) -> None:
        self.rate = 0.9 * self.rate + 0.1 * (num_accepted / num_drafts)
        if num_accepted:
            state.misses = 0
            return
        state.misses += 1
        scale = LOW_RATE_SCALE if self.rate < LOW_RATE else 1
        state.cooldown = min(scale * 2 ** (state.misses - 1), scale * MAX_COOLDOWN)

    @staticmethod
    def resting(state: BackoffState) -> bool:
        """True (and one step of the cooldown spent) while the request should not propose."""
        if state.cooldown:
            state.cooldown -= 1
            return True
        return False
