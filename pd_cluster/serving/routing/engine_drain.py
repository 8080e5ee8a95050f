"""Draining an engine without losing anything: before it is removed or switches role.

1. It is marked DRAINING: the router stops choosing it (EnginePool.available).
2. Its prefill legs (P: prompt in, first token out, KV shipped) run to their end; every other
   leg (a decode, or a whole request) is moved off (TokenChannel.move_off): the dispatcher
   resumes it on a serving engine from what the client already has, as it does after an
   engine failure, but uncounted (legs.EngineDraining) - the outputs are those of an
   unbroken run.
3. It is idle when the proxy has no open leg on it and the engine itself reports no request,
   no KV block and no KV hold (staging bytes, receives, send leases) - a P's blocks are freed
   once its consumers ACKed the KV. Every wait is bounded; on a timeout the engine is put
   back to SERVING and the caller is told what was left.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any

from pd_cluster.serving.routing.engine_pool import DRAINING, SERVING, EnginePool, EngineState
from pd_cluster.serving.routing.legs import Leg, LegKind

_POLL = 0.05  # s


class DrainTimeout(RuntimeError):
    pass


async def drain(pool: EnginePool, e: EngineState, timeout: float) -> int:
    """Drain ``e`` (see above); returns how many requests were moved off it. On DrainTimeout
    the engine serves again."""
    e.state = DRAINING
    channel = pool.token_channel
    moved = channel.move_off(e, _moved) if channel is not None else 0
    deadline = time.monotonic() + timeout
    try:
        await _until(lambda: channel is None or channel.open_legs(e) == 0, deadline,
                     lambda: f"{channel.open_legs(e)} prefill(s) still running")
        await engine_idle(e.handle, deadline)
    except DrainTimeout as err:
        e.state = SERVING
        raise DrainTimeout(f"{e.name}: not drained within {timeout:.0f}s: {err}") from None
    return moved


def _moved(leg: Leg) -> bool:
    return leg.kind is not LegKind.PREFILL  # a prefill finishes soon and ships its KV


async def engine_idle(handle: Any, deadline: float) -> None:
    """Until the engine holds no request, no KV block and no KV hold (bounded)."""
    why = ""
    while True:
        left = deadline - time.monotonic()
        try:
            await asyncio.wait_for(handle.check_no_leaks.remote(), max(left, 0.5))
            holds = await asyncio.wait_for(handle.kv_holds.remote(), max(left, 0.5))
            held = {k: v for k, v in holds.items() if v}
            if not held:
                return
            why = f"KV held: {held}"
        except AssertionError as e:
            why = str(e).strip().splitlines()[-1][:200]
        except asyncio.TimeoutError:
            why = "the engine did not answer"
        if time.monotonic() >= deadline:
            raise DrainTimeout(why)
        await asyncio.sleep(_POLL)


async def _until(pred: Any, deadline: float, why: Any) -> None:
    while not pred():
        if time.monotonic() >= deadline:
            raise DrainTimeout(why())
        await asyncio.sleep(_POLL)
