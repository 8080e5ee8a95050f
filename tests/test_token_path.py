"""The token path, proxy side (no Ray, no model): the TokenChannel reading the engines'
frames, the inboxes and the Dispatcher over FakeEngineActors (token_path_fakes.py), each with
a real OutputSender. The engine side alone: test_token_path_sender.py; under the Dispatcher
and HTTP: test_token_path_dispatch.py; with Ray actors: test_token_path_ray.py.

Deltas under load over unix and tcp (order, no gaps, one frame per step at most), a gap
failing only its leg, a proxy gone without a word, a malformed frame (bad length, bad
msgpack) failing the link while its leg migrates, concurrent attaches.
"""
from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import msgspec
import pytest

from pd_cluster.driver.messages import EngineDelta
from pd_cluster.serving.engine.frame_socket import frame
from pd_cluster.serving.engine.null_engine import token_id
from pd_cluster.serving.routing.inbox import AttemptInbox
from pd_cluster.serving.routing.legs import EngineFailed
from pd_cluster.serving.routing.token_channel import TokenChannel
from tests.token_path_fakes import (FakeEngineActor, Remote, TwoEngines, attached, make_leg,
                                    until)

__all__ = ["FakeEngineActor"]  # test_admission.py takes it from here


@pytest.mark.parametrize("node_id", ["here", "elsewhere"], ids=["ipc", "tcp"])
def test_deltas_under_load_arrive_in_order_one_message_per_step(node_id: str) -> None:
    async def go() -> None:
        engine = FakeEngineActor()
        channel = await attached(engine, node_id)
        endpoint = next(iter(engine.sender._sessions.values())).endpoint
        assert endpoint.startswith("unix://" if node_id == "here" else "tcp://127.0.0.1:")
        legs = [make_leg(engine, f"r{i}") for i in range(64)]
        inbox = AttemptInbox()
        for leg in legs:
            assert channel.register(leg, inbox)
            engine.sender.route(leg.request.request_id, channel.session)
        steps = 200
        for step in range(steps):  # an engine step: one delta for every request
            engine.emit([EngineDelta(leg.request.request_id, step, [token_id(step)], "x",
                                     step == steps - 1) for leg in legs])
        await until(lambda: all(leg.finished for leg in legs))
        for leg in legs:
            assert leg.failure is None
            assert leg.token_ids == [token_id(i) for i in range(steps)]
            assert leg.text == "x" * steps
        assert channel.counters["deltas"] == 64 * steps
        assert 1 <= channel.counters["messages"] <= steps  # one per step, fewer if behind
        # (the output thread counts a message after sending it: the proxy may count it first)
        await until(lambda: engine.sender.counters["output_messages"]
                     == channel.counters["messages"])
        await channel.close()
        engine.stop()
    asyncio.run(go())


def test_a_gap_or_a_repeat_fails_that_leg_only() -> None:
    async def go() -> None:
        engine = FakeEngineActor()
        channel = await attached(engine)
        gap, repeat, fine = (make_leg(engine, r) for r in ("gap", "repeat", "fine"))
        inbox = AttemptInbox()
        for leg in (gap, repeat, fine):
            channel.register(leg, inbox)
            engine.sender.route(leg.request.request_id, channel.session)
        engine.emit([EngineDelta("gap", 0, [1]), EngineDelta("repeat", 0, [1]),
                     EngineDelta("fine", 0, [1])])
        engine.emit([EngineDelta("gap", 2, [3]), EngineDelta("repeat", 0, [1]),
                     EngineDelta("fine", 1, [2], finished=True, finish_reason="length")])
        await until(lambda: fine.finished and gap.failure and repeat.failure)
        assert isinstance(gap.failure, EngineFailed) and "expected 1" in str(gap.failure)
        assert isinstance(repeat.failure, EngineFailed) and "expected 1" in str(repeat.failure)
        assert fine.failure is None and fine.token_ids == [1, 2]
        assert gap.token_ids == [1] and repeat.token_ids == [1]  # nothing merged past the gap
        await channel.close()
        engine.stop()
    asyncio.run(go())


def test_an_inbox_wakes_for_deltas_and_times_out_at_its_deadline() -> None:
    async def go() -> None:
        inbox = AttemptInbox()
        leg = make_leg(SimpleNamespace(name="e"), "r")
        deadline = time.monotonic() + 0.3
        asyncio.get_running_loop().call_later(0.02, inbox.delta, leg,
                                              EngineDelta("r", 0, [7], "a"))
        assert await inbox.changed(deadline) == [leg] and leg.token_ids == [7]
        with pytest.raises(asyncio.TimeoutError):
            await inbox.changed(deadline)  # nothing more: the one deadline timer ends it
        assert time.monotonic() >= deadline - 0.01
        with pytest.raises(asyncio.TimeoutError):
            await inbox.changed(deadline)  # still past it
        inbox.close()
    asyncio.run(go())


def test_a_proxy_gone_without_a_word_closes_its_session_and_aborts_its_work() -> None:
    """The proxy process dies (no close_output): the kernel closes its connection, and the
    engine closes the session and aborts what it ran at once, not after a timeout."""
    async def go() -> None:
        engine = FakeEngineActor(backlog_seconds=60.0)
        engine.step_seconds = 0.001
        channel = await attached(engine)
        leg = make_leg(engine, "orphan")
        channel.register(leg, AttemptInbox())
        await engine.submit(msgspec.msgpack.encode(msgspec.structs.replace(
            leg.request, output_session=channel.session)))
        await until(lambda: len(leg.token_ids) > 5)
        watch = asyncio.ensure_future(engine.watch_output(channel.session))
        for link in list(channel._links.values()):  # the proxy process is gone: no close
            for t in link.tasks:
                t.cancel()
            link.stream.close()
        why = await asyncio.wait_for(watch, 5)
        assert "closed the connection" in why
        assert engine.aborted == ["orphan"]
        assert engine.sender.counters["output_sessions_dropped"] == 1
        assert not engine.sender._routes and not engine.sender._sessions
        engine.stop()
    asyncio.run(go())


@pytest.mark.parametrize("garbage", [b"\xff\xff\xff\xff", frame(b"\xc1")],
                         ids=["length", "msgpack"])
def test_a_malformed_frame_fails_the_link_and_its_legs_migrate_exactly(garbage: bytes) -> None:
    """A frame length over the cap, or a payload msgpack cannot decode: the stream cannot be
    re-synchronised, so the link fails like a lost one: the request migrates and finishes
    exactly, the engine closes the session and aborts its work, nothing hangs or leaks."""
    async def go() -> None:
        two = TwoEngines()

        def inject() -> None:
            s = two.a.sender._sessions[two.channel.session]
            with s.lock:  # between two frames: what follows cannot be read any more
                s.conn.send(garbage)
        events = await two.stream(60, 10, inject)
        assert [t for ev in events for t in ev] == [token_id(i) for i in range(60)]
        assert two.channel.counters["malformed"] == 1
        assert two.metrics.migrations._value.get() == 1
        assert two.lost == [("colocated-0", False)]
        await until(lambda: not two.a.sender._sessions)  # the engine saw the proxy hang up
        assert set(two.a.aborted) == {"m"}  # by the dispatcher, and by the closed session
        assert not two.a.sender._routes and not two.b.sender._routes  # nothing held on either
        await two.close()
    asyncio.run(go())


def test_concurrent_health_checks_open_one_link() -> None:
    """The health loop and /cluster/status check at once: one attach, not a second one that
    would drop the first link (failing the legs just registered on it)."""
    async def go() -> None:
        engine = FakeEngineActor()
        opened: list[str] = []

        async def slow_open(session: str, node_id: str) -> str:
            opened.append(session)
            await asyncio.sleep(0.05)
            return await engine.open_output(session, node_id)
        engine.handle.open_output = Remote(slow_open)
        channel = TokenChannel(5.0, node_id="here")
        await asyncio.gather(channel.attach(engine, "i0"), channel.attach(engine, "i0"))
        assert len(opened) == 1 and channel.linked(engine, "i0")
        await channel.close()
        engine.stop()
    asyncio.run(go())


def test_a_lost_link_to_a_live_engine_counts_once_and_is_opened_again_at_once() -> None:
    """A malformed frame fails the link: one failure of the engine (not one more per leg
    that was on it), not routable while it has no token path, and the pool checks it again
    at once, which links it again, long before the next health check round."""
    async def go() -> None:
        two = TwoEngines()
        pool = two.pool
        pool.config = pool.config.model_copy(update={"health_check_interval": 60.0})
        two.channel._on_lost = pool.token_path_lost
        calls: list[str] = []
        mark_failed = pool.mark_failed

        def counted(e, error: str, dead: bool) -> None:
            calls.append(e.name)
            mark_failed(e, error, dead)
        pool.mark_failed = counted  # type: ignore[method-assign]

        def inject() -> None:
            s = two.a.sender._sessions[two.channel.session]
            with s.lock:
                s.conn.send(b"\xff\xff\xff\xff")
        a = pool.engines[0]
        unhealthy: list[bool] = []
        lost = pool.token_path_lost

        def seen(e, error: str, dead: bool) -> None:
            lost(e, error, dead)
            unhealthy.append(not e.healthy)  # not routable until linked again
        two.channel._on_lost = seen
        events = await two.stream(60, 10, inject)
        assert [t for ev in events for t in ev] == [token_id(i) for i in range(60)]
        assert calls == ["colocated-0"] and unhealthy == [True]
        await until(lambda: two.channel.linked(a, "i0") and a.healthy, timeout=5.0)
        assert a.failures == 0
        await pool.close()
        await two.close()
    asyncio.run(go())
