"""EngineLoad.backlog's running sum against the naive count over its legs."""
from __future__ import annotations

import gc
import random

from pd_cluster.serving.routing.engine_load import EngineLoad
from pd_cluster.serving.routing.legs import Leg, LegKind


def _naive(legs: dict[int, tuple[Leg, int]]) -> int:
    """What the load queues: the tokens of its live legs still waiting for a first output."""
    return sum(tokens for leg, tokens in legs.values()
               if leg.next_seq == 0 and leg.failure is None and not leg.finished)


def _step(rng: random.Random, load: EngineLoad, legs: dict[int, tuple[Leg, int]]) -> None:
    """One random event: a leg added, answered, failed, dropped or added again."""
    op = rng.random()
    if op < 0.45 or not legs:
        leg = Leg(None, None, 0, LegKind.WHOLE)  # type: ignore[arg-type]
        tokens = rng.randint(1, 500)
        load.add(leg, tokens)
        legs[id(leg)] = (leg, tokens)
        return
    key = rng.choice(list(legs))
    leg, tokens = legs[key]
    if op < 0.6:  # its first output (maybe a later one: it counts once)
        load.first_output(key, tokens, 0)
        leg.next_seq += 1
    elif op < 0.7:  # fails, maybe after its first output
        leg.fail(RuntimeError("engine died"))
    elif op < 0.8:  # gone: the test drops its last reference
        del legs[key]
    elif op < 0.85:  # added again (a retry on the same engine)
        load.add(leg, tokens + 1)
        legs[key] = (leg, tokens + 1)


def test_backlog_matches_the_naive_count_on_random_adds_and_ends() -> None:
    rng = random.Random(7)
    load = EngineLoad()
    legs: dict[int, tuple[Leg, int]] = {}  # the legs still alive
    for step in range(2000):
        _step(rng, load, legs)
        assert load.backlog() == _naive(legs), step
    legs.clear()
    gc.collect()
    assert load.backlog() == 0 and not load._pending
