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
first draft is always proposed (the cooldown above governs it), so a request keeps probing.

Whether the first draft pays at this batch size (the gate): a verification that kept drafts,
but whose request's acceptance no longer repays even one draft at the current batch size
(a < c B / (o + c B), the same threshold), backs off as a miss does. At batch 16 of a small
model a token costs about half a step's share per request, so text whose drafts are kept ~30%
of the time (a model looping on ungrounded text) stops paying for the verifies; at batch 1 the
same acceptance pays and the request keeps speculating.

And the engine as a whole (``skip``): while its recent acceptance is below that threshold at
the current batch size, the proposer runs on one step in ``ENGINE_PROBE_EVERY`` only (those
steps' probes keep the rate current; a smaller batch or better text opens it again at once).
At batch 16 on ungrounded text the per-request proposing itself, a few microseconds a request,
was measurable against a ~2.5 ms step.

The gate (not the width) also charges each draft what proposing it cost (``proposed``: the
proposer's time over the drafts it made, a moving average): the step's fit sees only the
forward. Near break-even that time decides it: at batch 16 of tiny-llama a token costs ~34 us
in the step and a lookup ~10 us, and ungrounded text kept ~25% of drafts against a 29% gate,
so the engine hovered open and ran 0.92-0.95x of no speculation.

While the gate is closed a probing step looks up only a rotating share of the requests
(``probes``: 1 in ENGINE_PROBE_EVERY, at least one): a lookup over a whole batch of 16 was
~190 us, and its drafts mostly failed. Every request is still probed in turn, and the probes'
outcomes keep the engine's rate current."""
from __future__ import annotations

from typing import Protocol

from pd_cluster.engine.spec.step_cost import StepCost

MAX_COOLDOWN = 32
LOW_RATE, LOW_RATE_SCALE = 0.2, 8  # accepted / drafted below which backing off is longer
ENGINE_PROBE_EVERY = 8  # steps per proposing step while the engine's drafts do not pay


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
        self.batch = 1  # decoding requests at the last proposal (the gate's batch size)
        self._skipped = 0  # steps skipped in a row by ``skip``
        self.propose_cost = 0.0  # seconds of proposing per draft made, a moving average
        self._unpaid = 0.0  # proposing seconds that made no draft yet (charged to the next)
        self._window: tuple[int, int] | None = None  # a closed engine's probes: (start, count)
        self._next_probe = 0

    def observe(self, state: BackoffState, num_drafts: int, num_accepted: int) -> None:
        self.rate = 0.9 * self.rate + 0.1 * (num_accepted / num_drafts)
        # Drafts are kept while they succeed: a geometric count, successes until one failure.
        state.kept = 0.8 * state.kept + num_accepted
        state.lost = 0.8 * state.lost + (num_accepted < num_drafts)
        if num_accepted:
            if self.accept(state) >= self.gate(self.batch):
                state.misses = 0
                return
            # Kept some, but too few to repay a draft at this batch size: rest as a miss.
        state.misses += 1
        scale = LOW_RATE_SCALE if self.rate < LOW_RATE else 1
        state.cooldown = min(scale * 2 ** (state.misses - 1), scale * MAX_COOLDOWN)

    def skip(self, batch: int) -> bool:
        """Whether the proposer skips this step entirely (``batch`` decoding requests): while
        the engine's recent acceptance does not repay a draft at this batch size, all but one
        step in ENGINE_PROBE_EVERY."""
        self.batch = batch
        if self.rate >= self.gate(batch):
            self._skipped, self._window = 0, None
            return False
        if self._skipped >= ENGINE_PROBE_EVERY - 1:  # a probe: the next share of requests
            count = max(1, batch // ENGINE_PROBE_EVERY)
            self._window = (self._next_probe % max(batch, 1), count)
            self._next_probe += count
            self._skipped = 0
            return False
        self._skipped += 1
        return True

    def probes(self, index: int, batch: int) -> bool:
        """Whether the ``index``-th of ``batch`` requests proposes in a step ``skip`` let
        through: all while the gate is open, a probing step's share while it is closed."""
        if self._window is None:
            return True
        start, count = self._window
        return (index - start) % batch < count

    def gate(self, batch: int) -> float:
        """The acceptance a request's first draft must reach to pay at this batch size."""
        return self.cost.threshold(batch, self.propose_cost)

    def proposed(self, seconds: float, drafts: int) -> None:
        """A proposing pass: its time, and the requests it gave drafts to."""
        self._unpaid += seconds
        if drafts:
            self.propose_cost = 0.9 * self.propose_cost + 0.1 * self._unpaid / drafts
            self._unpaid = 0.0

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
        accept = self.accept(state)
        width, chance = 1, accept
        while width < k and chance * accept >= threshold:
            chance *= accept
            width += 1
        return width

    def accept(self, state: BackoffState) -> float:
        """The request's per-position acceptance, the engine's recent rate standing in for
        2 verifications."""
        return (state.kept + 2 * self.rate) / (state.kept + state.lost + 2)
