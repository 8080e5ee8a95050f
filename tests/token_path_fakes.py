"""The token path's test doubles (no Ray, no model): an engine actor as it drives its
OutputSender, and the proxy-side helpers the token path tests share."""
from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace
from typing import Any, Callable

import ray.exceptions

from pd_cluster.driver.messages import EngineDelta, EngineInfo, EngineRequest, decode_request
from pd_cluster.sampling_params import SamplingParams
from pd_cluster.serving.cluster.cluster_config import ProxyConfig
from pd_cluster.serving.engine.null_engine import token_id
from pd_cluster.serving.engine.output_sender import OutputSender
from pd_cluster.serving.engine.request_reader import RequestReader
from pd_cluster.serving.observability.metrics import ProxyMetrics
from pd_cluster.serving.routing.dispatch import Dispatcher
from pd_cluster.serving.routing.engine_pool import EnginePool
from pd_cluster.serving.routing.legs import GenerateJob, Leg, LegKind
from pd_cluster.serving.routing.token_channel import TokenChannel

PARAMS = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)


class Remote:
    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn

    def remote(self, *args: Any) -> Any:
        return self.fn(*args)


class FakeEngineActor:
    """What the engine actor does with its OutputSender and RequestReader, minus Ray and the
    model: a request (over the session's request socket, or ``submit``) starts a generator
    thread that emits one token per step for it (an engine step per ``step_seconds``);
    ``emit`` sends hand-made deltas. Bound to the event loop that opens its first session."""

    def __init__(self, name: str = "colocated-0", role: str = "colocated", **sender_kw: Any):
        self.name, self.role, self.aborted = name, role, []
        self.loop: asyncio.AbstractEventLoop | None = None
        self.sessions: dict[str, asyncio.Future] = {}
        self.readers: dict[str, RequestReader] = {}
        self.sender = OutputSender("127.0.0.1", self._abort, self._closed, **sender_kw)
        self.dead: BaseException | None = None
        self.handle = SimpleNamespace(
            open_output=Remote(self.open_output), watch_output=Remote(self.watch_output),
            close_output=Remote(self.close_output), open_requests=Remote(self.open_requests),
            abort=Remote(self.abort), health=Remote(self.health),
            cache_events=Remote(self.cache_events))
        self._stop: set[str] = set()
        self.step_seconds = 0.0

    async def health(self) -> dict[str, Any]:
        return EngineInfo(self.name, self.role, "i0", 1, "127.0.0.1", None, 4096).to_dict()

    async def cache_events(self, full: bool, cursor: int | None = None) -> dict[str, Any]:
        """An empty prefix cache (it computes nothing)."""
        return {"reset": True, "stored": [], "removed": [], "cursor": 0, "incarnation": "i0",
                "block_size": 16, "kv_bytes_per_token": 1.0}

    async def open_output(self, session: str, node_id: str) -> str:
        self.loop = asyncio.get_running_loop()
        endpoint = await asyncio.wrap_future(self.sender.open(session, ipc=node_id == "here"))
        self.sessions.setdefault(session, self.loop.create_future())
        return endpoint

    async def open_requests(self, session: str, node_id: str) -> str:
        reader = self.readers.get(session)
        if reader is None:
            reader = self.readers[session] = RequestReader(
                session, node_id == "here", "127.0.0.1", self.sender.ipc_dir, self.accept,
                self._abort)
        return reader.endpoint

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
            reader = self.readers.pop(session, None)
            if reader is not None:
                reader.close()
            fut = self.sessions.pop(session, None)
            if fut is not None and not fut.done():
                if self.dead is not None:
                    fut.set_exception(self.dead)
                else:
                    fut.set_result(why)
        if self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(done)

    async def submit(self, data: bytes) -> None:
        """A request as the request socket would bring it (some tests send one by hand)."""
        self.accept(decode_request(data))

    def accept(self, req: EngineRequest) -> None:
        self.sender.route(req.request_id, req.output_session)
        threading.Thread(target=self._generate, args=(req, self.step_seconds),
                         daemon=True).start()

    def stop(self) -> None:
        """Close its sockets (the end of a test)."""
        for reader in self.readers.values():
            reader.close()
        self.readers.clear()
        self.sender.stop()

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


def make_leg(engine: Any, rid: str) -> Leg:
    return Leg(SimpleNamespace(name=engine.name), EngineRequest(rid, [1, 2, 3], PARAMS), 1,
               LegKind.WHOLE)


async def until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


async def attached(engine: FakeEngineActor, node_id: str = "here") -> TokenChannel:
    channel = TokenChannel(5.0, node_id=node_id)
    await channel.attach(engine, "i0")
    return channel


def pool_and_dispatcher(engines: list[FakeEngineActor], channel: TokenChannel,
                         stream_interval: int = 1
                         ) -> tuple[EnginePool, Dispatcher, ProxyMetrics]:
    pool = EnginePool([(e.name, e.role, e.handle) for e in engines], ProxyConfig())
    for st in pool.engines:
        st.healthy, st.incarnation = True, "i0"
    pool.token_channel = channel
    metrics = ProxyMetrics(lambda: pool.engines)
    return pool, Dispatcher(pool, "colocated", metrics, channel, 0, 2,
                            stream_interval), metrics


class TwoEngines:
    """Engines ``a`` (picked first) and ``b`` behind one TokenChannel and Dispatcher; ``lost``
    records what the channel told the pool (engine name, dead)."""

    def __init__(self, step_seconds: float = 0.002, stream_interval: int = 1):
        self.a, self.b = FakeEngineActor("colocated-0"), FakeEngineActor("colocated-1")
        self.a.step_seconds = self.b.step_seconds = step_seconds
        self.lost: list[tuple[str, bool]] = []
        self.channel = TokenChannel(5.0, lambda e, why, dead: self.lost.append((e.name, dead)),
                                    node_id="here")
        self.pool, self.disp, self.metrics = pool_and_dispatcher(
            [self.a, self.b], self.channel, stream_interval)
        self.pool.routers["colocated"].pick = lambda candidates, *_: candidates[0]

    async def stream(self, n: int, fault_after: int, fault: Callable[[], None]
                     ) -> list[list[int]]:
        """Stream request "m" of ``n`` tokens; ``fault()`` once the client has
        ``fault_after`` of them. Returns the streamed events' token ids."""
        for st in self.pool.engines:
            await self.channel.attach(st, "i0")
        job = GenerateJob("m", [1], SamplingParams(max_tokens=n, ignore_eos=True), 1e18)
        events: list[list[int]] = []
        got, faulted = 0, False
        async for ev in self.disp.stream(job):
            events.append(ev.token_ids)
            got += len(ev.token_ids)
            if got >= fault_after and not faulted:
                faulted = True
                fault()
        return events

    async def close(self) -> None:
        await self.channel.close()
        self.a.stop()
        self.b.stop()

