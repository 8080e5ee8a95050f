"""Backing off speculation where it fails: a verification that accepted nothing cost a wider
step (and, for a draft model, k draft forwards) for one token. A request whose drafts keep
failing proposes again only after 1, 2, 4 ... 32 steps (a probe; reset by the first accepted
draft), 8x that while most of the engine's recent drafts failed (a large batch of ungrounded
requests would otherwise have one of them verifying in most steps). Text where drafts fail
then runs almost as without speculation; text where they start to succeed is found again by
the next probe.

How many drafts a request verifies (``width``): the j-th draft is kept only if the j-1 before it
were, so with a per-position acceptance a it is kept with probability a^j; it is proposed only
while a^j repays what one more token costs the step (step_cost.py's threshold, measured). The
first draft is always proposed (the cooldown above governs it), so a request keeps probing."""
from __future__ import annotations

from typing import Protocol

from pd_cluster.engine.spec.step_cost import StepCost

MAX_COOLDOWN = 32
LOW_RATE, LOW_RATE_SCALE = 0.2, 8  # accepted / drafted below which backing off is longer


class BackoffState(Protocol):
    misses: int  # verifications in a row that accepted nothing
    cooldown: int  # steps left without proposing
    kept: float  # drafts accepted, decayed (the per-position acceptance's successes)
    lost: float  # verifications that rejected one, decayed (its failures)


class Backoff:
    """One engine's: the recent acceptance rate, and each request's misses and cooldown."""

    def __init__(self) -> None:
        self.rate = 0.5  # accepted / drafted, a moving average over recent verifications
        self.cost = StepCost()  # the engine records its decode steps' times

    def observe(self, state: BackoffState, num_drafts: int, num_accepted: int) -> None:
        self.rate = 0.9 * self.rate + 0.1 * (num_accepted / num_drafts)
        # Drafts are kept while they succeed: a geometric count, successes until one failure.
        state.kept = 0.8 * state.kept + num_accepted
        state.lost = 0.8 * state.lost + (num_accepted < num_drafts)
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

    def width(self, state: BackoffState, k: int, batch: int) -> int:
        """Drafts worth verifying for this request in a step of ``batch`` decoding requests:
        1, plus each next one while its chance of being kept repays its cost."""
        threshold = self.cost.threshold(batch)
        if threshold <= 0.0:
            return k
        # Per-position acceptance, the engine's recent rate standing in for 2 verifications.
        accept = (state.kept + 2 * self.rate) / (state.kept + state.lost + 2)
        width, chance = 1, accept
        while width < k and chance * accept >= threshold:
            chance *= accept
            width += 1
        return width
