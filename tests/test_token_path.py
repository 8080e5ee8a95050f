"""The token path engine -> proxy over ZMQ (no Ray, no model): the engine side's OutputSender
driven as the engine actor drives it, the proxy side's TokenChannel, inboxes and Dispatcher.

Deltas under load (order, no gaps, one message per step at most), a gap failing only its leg,
a slow client costing its leg's output and not a queue per step (coalescing), a proxy that
goes away (closed, or gone without a word) and a new one that attaches, an engine that dies.
"""
from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace
from typing import Any, Callable

import msgspec
import pytest
import ray.exceptions

from pd_cluster.driver.messages import EngineDelta, EngineInfo, EngineRequest, decode_request
from pd_cluster.sampling_params import SamplingParams
from pd_cluster.serving.cluster.cluster_config import ProxyConfig
from pd_cluster.serving.engine.null_engine import token_id
from pd_cluster.serving.engine.output_sender import OutputSender, sweep_stale_ipc
from pd_cluster.serving.observability.metrics import ProxyMetrics
from pd_cluster.serving.routing.dispatch import Dispatcher
from pd_cluster.serving.routing.engine_pool import EnginePool
from pd_cluster.serving.routing.inbox import AttemptInbox
from pd_cluster.serving.routing.legs import EngineFailed, GenerateJob, Leg, LegKind
from pd_cluster.serving.routing.token_channel import TokenChannel

PARAMS = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)


class _Remote:
    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn

    def remote(self, *args: Any) -> Any:
        return self.fn(*args)


class FakeEngineActor:
    """What the engine actor does with its OutputSender, minus Ray and the model: ``submit``
    starts a generator thread that emits one token per step for its request (an engine step
    per ``step_seconds``); ``emit`` sends hand-made deltas."""

    def __init__(self, name: str = "colocated-0", **sender_kw: Any):
        self.name, self.role, self.aborted = name, "colocated", []
        self.loop = asyncio.get_running_loop()
        self.sessions: dict[str, asyncio.Future] = {}
        self.sender = OutputSender("127.0.0.1", self._abort, lambda d: None, self._closed,
                                   **sender_kw)
        self.dead: BaseException | None = None
        self.handle = SimpleNamespace(
            open_output=_Remote(self.open_output), watch_output=_Remote(self.watch_output),
            close_output=_Remote(self.close_output), submit=_Remote(self.submit),
            abort=_Remote(self.abort), health=_Remote(self.health))
        self._stop: set[str] = set()
        self.step_seconds = 0.0

    async def health(self) -> dict[str, Any]:
        return EngineInfo(self.name, self.role, "i0", 1, "127.0.0.1", None, 4096).to_dict()

    async def open_output(self, session: str, node_id: str) -> str:
        endpoint = await asyncio.wrap_future(self.sender.open(session, ipc=node_id == "here"))
        self.sessions.setdefault(session, self.loop.create_future())
        return endpoint

    async def watch_output(self, session: str) -> str:
        return await asyncio.shield(self.sessions[session])

    async def close_output(self, session: str) -> None:
        self.sender.close(session)

    async def abort(self, ids: list[str]) -> None:
        self._abort(ids)

    def _abort(self, ids: list[str]) -> None:
        self.aborted.extend(ids)
        self._stop.update(ids)

    def _closed(self, session: str, why: str) -> None:
        def done() -> None:
            fut = self.sessions.pop(session, None)
            if fut is not None and not fut.done():
                if self.dead is not None:
                    fut.set_exception(self.dead)
                else:
                    fut.set_result(why)
        self.loop.call_soon_threadsafe(done)

    async def submit(self, data: bytes) -> str | None:
        req = decode_request(data)
        self.sender.route(req.request_id, req.output_session)
        threading.Thread(target=self._generate, args=(req, self.step_seconds),
                         daemon=True).start()
        return None

    def _generate(self, req: EngineRequest, step_seconds: float) -> None:
        rid, start = req.request_id, len(req.resume_token_ids)
        n = req.params.max_tokens
        for seq, i in enumerate(range(start, n)):
            if rid in self._stop:
                return
            time.sleep(step_seconds)
            done = i == n - 1
            self.sender.emit([EngineDelta(rid, seq, [token_id(i)], f"t{i} ", done,
                                          "length" if done else None, emit_time=time.time())])

    def die(self) -> None:
        """The actor is gone: its watch call fails as Ray's does."""
        self.dead = ray.exceptions.ActorDiedError()
        for fut in self.sessions.values():
            if not fut.done():
                fut.set_exception(self.dead)
        self._stop.update(self.sender._routes)  # its engine stops producing

    def emit(self, deltas: list[EngineDelta]) -> None:
        self.sender.emit(deltas)


def _leg(engine: Any, rid: str) -> Leg:
    return Leg(SimpleNamespace(name=engine.name), EngineRequest(rid, [1, 2, 3], PARAMS), 1,
               LegKind.WHOLE)


async def _until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


async def _attached(engine: FakeEngineActor, node_id: str = "here") -> TokenChannel:
    channel = TokenChannel(5.0, node_id=node_id)
    await channel.attach(engine, "i0")
    return channel


@pytest.mark.parametrize("node_id", ["here", "elsewhere"], ids=["ipc", "tcp"])
def test_deltas_under_load_arrive_in_order_one_message_per_step(node_id: str) -> None:
    async def go() -> None:
        engine = FakeEngineActor()
        channel = await _attached(engine, node_id)
        endpoint = next(iter(engine.sender._sessions.values())).endpoint
        assert endpoint.startswith("ipc://" if node_id == "here" else "tcp://127.0.0.1:")
        legs = [_leg(engine, f"r{i}") for i in range(64)]
        inbox = AttemptInbox()
        for leg in legs:
            assert channel.register(leg, inbox)
            engine.sender.route(leg.request.request_id, channel.session)
        steps = 200
        for step in range(steps):  # an engine step: one delta for every request
            engine.emit([EngineDelta(leg.request.request_id, step, [token_id(step)], "x",
                                     step == steps - 1) for leg in legs])
        await _until(lambda: all(leg.finished for leg in legs))
        for leg in legs:
            assert leg.failure is None
            assert leg.token_ids == [token_id(i) for i in range(steps)]
            assert leg.text == "x" * steps
        assert channel.counters["deltas"] == 64 * steps
        assert 1 <= channel.counters["messages"] <= steps  # one per step, fewer if behind
        # (the output thread counts a message after sending it: the proxy may count it first)
        await _until(lambda: engine.sender.counters["output_messages"]
                     == channel.counters["messages"])
        await channel.close()
        engine.sender.stop()
    asyncio.run(go())


def test_a_gap_or_a_repeat_fails_that_leg_only() -> None:
    async def go() -> None:
        engine = FakeEngineActor()
        channel = await _attached(engine)
        gap, repeat, fine = (_leg(engine, r) for r in ("gap", "repeat", "fine"))
        inbox = AttemptInbox()
        for leg in (gap, repeat, fine):
            channel.register(leg, inbox)
            engine.sender.route(leg.request.request_id, channel.session)
        engine.emit([EngineDelta("gap", 0, [1]), EngineDelta("repeat", 0, [1]),
                     EngineDelta("fine", 0, [1])])
        engine.emit([EngineDelta("gap", 2, [3]), EngineDelta("repeat", 0, [1]),
                     EngineDelta("fine", 1, [2], finished=True, finish_reason="length")])
        await _until(lambda: fine.finished and gap.failure and repeat.failure)
        assert isinstance(gap.failure, EngineFailed) and "expected 1" in str(gap.failure)
        assert isinstance(repeat.failure, EngineFailed) and "expected 1" in str(repeat.failure)
        assert fine.failure is None and fine.token_ids == [1, 2]
        assert gap.token_ids == [1] and repeat.token_ids == [1]  # nothing merged past the gap
        await channel.close()
        engine.sender.stop()
    asyncio.run(go())


def test_an_inbox_wakes_for_deltas_and_times_out_at_its_deadline() -> None:
    async def go() -> None:
        inbox = AttemptInbox()
        leg = _leg(SimpleNamespace(name="e"), "r")
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


def _pool_and_dispatcher(engines: list[FakeEngineActor], channel: TokenChannel,
                         stream_interval: int = 1
                         ) -> tuple[EnginePool, Dispatcher, ProxyMetrics]:
    pool = EnginePool([(e.name, e.role, e.handle) for e in engines], ProxyConfig())
    for st in pool.engines:
        st.healthy, st.incarnation = True, "i0"
    pool.token_channel = channel
    metrics = ProxyMetrics(lambda: pool.engines)
    return pool, Dispatcher(pool, "colocated", metrics, 0, 2, channel,
                            stream_interval), metrics


def test_a_slow_client_gets_everything_new_in_one_event() -> None:
    async def go() -> None:
        engine = FakeEngineActor()
        channel = TokenChannel(5.0, node_id="here")
        pool, disp, _ = _pool_and_dispatcher([engine], channel)
        await channel.attach(pool.engines[0], "i0")
        n = 500
        job = GenerateJob("slow", [1, 2, 3], SamplingParams(temperature=0, max_tokens=n,
                                                            ignore_eos=True), 1e18)
        events = disp.stream(job)
        first = await anext(events)
        # The client reads nothing while the engine produces the rest: what the proxy holds
        # for it is the leg's output, not one queued item per engine step.
        await _until(lambda: channel.counters["deltas"] >= n)
        rest = [ev async for ev in events]
        assert len(rest) == 1, [len(ev.token_ids) for ev in rest]
        tokens = first.token_ids + rest[0].token_ids
        assert tokens == [token_id(i) for i in range(n)]
        assert rest[0].finish_reason == "length"
        await channel.close()
        engine.sender.stop()
    asyncio.run(go())


def test_proxy_restart_aborts_the_old_sessions_work_and_the_new_one_streams() -> None:
    async def go() -> None:
        engine = FakeEngineActor()
        engine.step_seconds = 0.002
        old = TokenChannel(5.0, node_id="here")
        _, disp, _ = _pool_and_dispatcher([engine], old)
        await old.attach(disp.pool.engines[0], "i0")
        job = GenerateJob("long", [1], SamplingParams(max_tokens=100_000, ignore_eos=True),
                          1e18)
        events = disp.stream(job)
        await anext(events)  # streaming, then this proxy goes away with it running
        await old.close()
        await _until(lambda: "long" in engine.aborted)
        assert not engine.sender._routes  # nothing routed to the closed session any more
        new = TokenChannel(5.0, node_id="here")
        _, disp2, _ = _pool_and_dispatcher([engine], new)
        await new.attach(disp2.pool.engines[0], "i0")
        assert new.session != old.session
        job2 = GenerateJob("after", [1], SamplingParams(max_tokens=20, ignore_eos=True), 1e18)
        tokens = [t async for ev in disp2.stream(job2) for t in ev.token_ids]
        assert tokens == [token_id(i) for i in range(20)]
        await events.aclose()
        await new.close()
        engine.sender.stop()
    asyncio.run(go())


def test_a_proxy_gone_without_a_word_costs_the_engine_a_bounded_backlog() -> None:
    async def go() -> None:
        engine = FakeEngineActor(backlog_messages=10_000, backlog_seconds=0.3)
        engine.step_seconds = 0.001
        channel = await _attached(engine)
        leg = _leg(engine, "orphan")
        channel.register(leg, AttemptInbox())
        engine.sender.route("orphan", channel.session)
        await engine.submit(msgspec.msgpack.encode(msgspec.structs.replace(
            leg.request, output_session=channel.session)))
        await _until(lambda: len(leg.token_ids) > 5)
        watch = asyncio.ensure_future(engine.watch_output(channel.session))
        for link in list(channel._links.values()):  # the proxy process is gone: no close
            for t in link.tasks:
                t.cancel()
            link.sock.close(linger=0)
        why = await asyncio.wait_for(watch, 10)
        assert "nothing accepted" in why
        assert engine.aborted == ["orphan"]
        assert engine.sender.counters["output_sessions_dropped"] == 1
        engine.sender.stop()
    asyncio.run(go())


def test_an_engine_dying_mid_stream_migrates_its_requests_exactly() -> None:
    async def go() -> None:
        a, b = FakeEngineActor("colocated-0"), FakeEngineActor("colocated-1")
        a.step_seconds = b.step_seconds = 0.002
        lost: list[tuple[str, bool]] = []
        channel = TokenChannel(5.0, lambda e, why, dead: lost.append((e.name, dead)),
                               node_id="here")
        pool, disp, metrics = _pool_and_dispatcher([a, b], channel)
        for st in pool.engines:
            await channel.attach(st, "i0")
        pool.routers["colocated"].pick = lambda candidates, *_: candidates[0]  # a first
        job = GenerateJob("m", [1], SamplingParams(max_tokens=60, ignore_eos=True), 1e18)
        tokens: list[int] = []
        async for ev in disp.stream(job):
            tokens += ev.token_ids
            if len(tokens) >= 10 and a.dead is None:
                a.die()
        assert tokens == [token_id(i) for i in range(60)]  # nothing lost, nothing repeated
        assert metrics.migrations._value.get() == 1
        assert lost == [("colocated-0", True)] and not pool.engines[0].healthy
        assert b.sender._routes == {}  # finished: nothing held for it on the new engine
        await channel.close()
        a.sender.stop()
        b.sender.stop()
    asyncio.run(go())


def test_stream_interval_chunks_and_a_migration_stay_exact() -> None:
    """proxy.stream_interval 4: the first token goes at once, every later event but the last
    carries at least 4 tokens; tokens held in a leg whose engine dies are not lost (the
    request resumes from what the client has) and none is sent twice."""
    async def go() -> None:
        a, b = FakeEngineActor("colocated-0"), FakeEngineActor("colocated-1")
        a.step_seconds = b.step_seconds = 0.001
        channel = TokenChannel(5.0, node_id="here")
        pool, disp, metrics = _pool_and_dispatcher([a, b], channel, stream_interval=4)
        for st in pool.engines:
            await channel.attach(st, "i0")
        pool.routers["colocated"].pick = lambda candidates, *_: candidates[0]  # a first
        job = GenerateJob("si", [1], SamplingParams(max_tokens=61, ignore_eos=True), 1e18)
        sizes: list[int] = []
        tokens: list[int] = []
        async for ev in disp.stream(job):
            sizes.append(len(ev.token_ids))
            tokens += ev.token_ids
            if len(tokens) >= 9 and a.dead is None:
                a.die()
        assert tokens == [token_id(i) for i in range(61)]
        assert sizes[0] == 1 and all(n >= 4 for n in sizes[1:-1]), sizes
        assert metrics.migrations._value.get() == 1
        await channel.close()
        a.sender.stop()
        b.sender.stop()
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
        engine.handle.open_output = _Remote(slow_open)
        channel = TokenChannel(5.0, node_id="here")
        await asyncio.gather(channel.attach(engine, "i0"), channel.attach(engine, "i0"))
        assert len(opened) == 1 and channel.linked(engine, "i0")
        await channel.close()
        engine.sender.stop()
    asyncio.run(go())


def test_a_client_that_stops_reading_gets_the_rest_in_one_chunk() -> None:
    """Over HTTP: a client that reads nothing while its request generates 400 tokens holds
    up its own stream only; the proxy keeps the leg's output (not a chunk per engine step),
    and when the client reads again it gets all of it in one chunk, then [DONE]."""
    import json

    from pd_cluster.serving.api.app import create_app
    from pd_cluster.serving.cluster.cluster_config import parse_config

    cfg = parse_config({"mode": "colocated", "colocated": {"replicas": 1}, "proxy": {"port": 0}})
    n = 400

    async def go() -> None:
        engine = FakeEngineActor()
        engine.step_seconds = 0.001
        app = create_app(cfg, [(engine.name, engine.role, engine.handle)])
        state = app.state.proxy
        await state.pool.start()
        body = json.dumps({"model": cfg.model_name, "prompt": [1, 2, 3], "max_tokens": n,
                           "ignore_eos": True, "stream": True}).encode()
        chunks: list[bytes] = []
        reading = asyncio.Event()
        received = False

        async def receive() -> dict[str, Any]:
            nonlocal received
            if not received:
                received = True
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.Event().wait()  # the client never hangs up
            raise AssertionError

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.body" and message.get("body"):
                chunks.append(message["body"])
                if len(chunks) == 1:
                    await reading.wait()  # the client stops reading after its first chunk

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": "/v1/completions",
                 "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
                 "headers": [(b"content-type", b"application/json")],
                 "server": ("proxy", 80), "client": ("client", 1234)}
        call = asyncio.ensure_future(app(scope, receive, send))
        try:
            await _until(lambda: bool(chunks))
            await _until(lambda: channel_deltas(state) >= n)  # the engine finished meanwhile
            reading.set()
            await asyncio.wait_for(call, 30)
        finally:
            await state.pool.close()
            engine.sender.stop()
        events = [json.loads(c[6:]) for c in chunks if c.startswith(b"data: {")]
        assert len(events) == 2, [len(e["choices"][0]["text"]) for e in events]
        text = "".join(e["choices"][0]["text"] for e in events)
        assert text == "".join(f"t{i} " for i in range(n))
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        assert chunks[-1] == b"data: [DONE]\n\n"
    asyncio.run(go())


def channel_deltas(state: Any) -> int:
    return state.pool.token_channel.counters["deltas"]


def test_ipc_files_of_dead_engines_are_swept_and_a_stopped_sender_leaves_none(tmp_path) -> None:
    import os
    import socket
    import subprocess
    import sys

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    paths = {k: str(tmp_path / f"pd-out-{pid}-{k}")
             for k, pid in (("dead", dead.pid), ("live", os.getpid()))}
    socks = []
    for path in paths.values():
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(path)
        socks.append(sock)
    (tmp_path / f"pd-out-{dead.pid}-notasocket").write_text("")
    assert sweep_stale_ipc(str(tmp_path)) == [paths["dead"]]
    assert sorted(os.listdir(tmp_path)) == sorted(
        [f"pd-out-{os.getpid()}-live", f"pd-out-{dead.pid}-notasocket"])
    for sock in socks:
        sock.close()

    sender = OutputSender("127.0.0.1", lambda ids: None, lambda d: None)
    endpoint = sender.open("s", ipc=True).result(10)
    path = endpoint.removeprefix("ipc://")
    assert os.path.exists(path)
    sender.stop()
    assert not os.path.exists(path)
