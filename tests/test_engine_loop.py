"""The engine loop outlives its callers: a control call whose caller gave up (a cancelled or
timed-out future) is dropped and counted, never raised into the loop, and the engine serves on."""
from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future
from typing import Any

import pytest

from pd_cluster.driver.engine_loop import EngineLoop
from pd_cluster.futures import run_into, settle, settle_with
from pd_cluster.llm import LLM
from pd_cluster.sampling_params import SamplingParams
from pd_cluster.driver.messages import EngineRequest

WAIT_S = 30.0


def test_run_into_skips_a_cancelled_future_and_lands_the_rest() -> None:
    cancelled: Future = Future()
    cancelled.cancel()
    ran: list[int] = []
    assert not run_into(cancelled, lambda: ran.append(1))
    assert ran == []
    ok: Future = Future()
    assert run_into(ok, lambda: 7) and ok.result() == 7
    failed: Future = Future()
    assert run_into(failed, lambda: 1 / 0)
    assert isinstance(failed.exception(), ZeroDivisionError)
    late: Future = Future()
    late.cancel()
    settle(late, RuntimeError("x"))  # neither raises on a cancelled future
    settle_with(late, 3)
    assert late.cancelled()


def test_a_call_cancelled_while_the_engine_is_busy_is_dropped_not_fatal() -> None:
    """The cold-start crash: a call waited with a bound while the engine thread was stuck (a
    step waiting on its KV sends); the bound ran out and cancelled the future; the loop then
    ran the call and set its result on the cancelled future, and died."""
    with LLM(num_kv_blocks=64) as llm:
        deltas: list[Any] = []
        got = threading.Event()

        def emit(batch: list[Any]) -> None:
            deltas.extend(batch)
            if any(d.finished for d in batch):
                got.set()

        fatal: list[BaseException] = []
        loop = EngineLoop(llm.engine, emit, on_fatal=fatal.append)
        loop.start()
        try:
            gate = threading.Event()
            blocker = loop.call(lambda _e: gate.wait(WAIT_S))  # the engine thread is stuck

            async def bounded() -> None:
                with pytest.raises(asyncio.TimeoutError):
                    await asyncio.wait_for(asyncio.wrap_future(loop.call(lambda e: e.stats())),
                                           0.05)
            asyncio.run(bounded())  # as the proxy's cache report and health calls wait
            stale = loop.call(lambda e: e.stats())
            assert stale.cancel()
            gate.set()
            assert blocker.result(WAIT_S) is True
            deadline = time.monotonic() + WAIT_S
            while loop.counters["calls_dropped"] < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert loop.counters["calls_dropped"] == 2
            assert loop.alive and not fatal
            # ... and it still serves.
            loop.submit(EngineRequest("after", [1, 2, 3], SamplingParams(max_tokens=4,
                                                                         temperature=0.0)))
            assert got.wait(WAIT_S)
            done = [d for d in deltas if d.request_id == "after" and d.finished]
            assert done and done[0].error is None
            assert loop.call(lambda e: e.stats()).result(WAIT_S)["num_running"] == 0
        finally:
            loop.stop()
        llm.engine.check_no_leaks()
