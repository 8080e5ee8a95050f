"""How fast an engine that mixes prompt chunks into its decode steps must move prompt tokens
for its queued prompts to meet their TTFT target.

Prompts are prefilled in arrival order, so prompt j's first token comes once every prompt
token queued up to and including its own is computed: at ``rate`` prompt tokens a second,
``queued_j / rate`` from now. It meets a target ``ttft`` when that lands before its deadline
``arrival_j + ttft``, so the rate every prompt that can still meet it needs is the highest
``queued_j / (deadline_j - now)``. A prompt past its deadline, or one that the engine's
fastest rate cannot bring in before it, is lost to the target; it is brought in within one
more target from now instead. Without that a queue past its deadlines would ask for nothing,
its prompts would move a block a step, every prompt arriving behind them would be late too
and the queue would never drain (an overload that feeds itself); with it a backlog is
drained as fast as one target's worth of time needs, at the widest step when it is deep.

The scheduler turns the rate into a chunk width through the step times it measured
(engine/step_time_model.py) and takes the wider of that and what the decoding requests'
TPOT slack allows (tpot_budget.py): a queue the TPOT bound alone would let grow past every
prompt's TTFT is drained as fast as its deadlines need, no faster.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable


@dataclass(frozen=True)
class Queued:
    """One prompt waiting for (the rest of) its prefill, in arrival order."""
    tokens: int  # prompt tokens still to compute
    arrival: float  # s, on the scheduler's clock


def rate_needed(queued: Iterable[Queued], now: float, target: float,
                fastest: float) -> float:
    """Prompt tokens a second that bring every prompt of ``queued`` still able to meet
    ``target`` TTFT in within it, and every one already lost within one more ``target``;
    0.0 when none waits. ``fastest``: the engine's highest prompt rate (tokens/s) at its
    widest step."""
    total, rate = 0, 0.0
    for q in queued:
        total += q.tokens
        left = q.arrival + target - now
        if left <= 0 or total > fastest * left:
            left = target  # lost to the target whatever the width: drain it within one more
        rate = max(rate, total / left)
    return rate
