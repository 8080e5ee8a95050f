"""The proxy's end of the token path: one stream connection per engine, read on the loop.

The proxy opens one output session on every engine incarnation (``attach``, from the health
check that first sees it) and connects to the socket the engine listens on for it (unix on
the proxy's node, tcp elsewhere). Its FrameReader (frame_reader.py) cuts what arrives into
frames (4-byte length, CRC-32, msgpack: one engine step's numbered deltas of every request of
this session; engine/frame_socket.py) and ``_apply`` hands each delta to the inbox of the leg
it belongs to as it is read, no task hop; a proxy that fell behind applies everything waiting
before the clients' streams run, so each client gets one coalesced chunk.
A frame that cannot be read (a length over the cap, a CRC-32 that does not hold, a payload
msgpack cannot decode) leaves the stream unsynchronised: the link fails as a lost one does. The other way, one ZMQ
PUSH socket per engine carries this session's requests and aborts (``submit``/``abort``; the
engine's end is engine/request_reader.py), so no Ray call is made per request and an abort
never overtakes its request.

A watcher keeps one Ray call open per engine (``watch_output``): it fails the moment the actor
dies, and returns when the engine closed the session; either way, or when the connection
drops, every leg still open on that engine fails with EngineFailed (the dispatcher retries or
migrates it), as it does when the health check finds the engine down or restarted.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

import msgspec
import zmq

from connectors.secret import cluster_secret
from pd_cluster.driver.messages import EngineDelta, EngineRequest
from pd_cluster.serving.engine.output_sender import SHUTTING_DOWN
from pd_cluster.serving.engine.request_reader import abort_message, request_message
from pd_cluster.serving.engine.session_sockets import curve_request_socket, session_proof
from pd_cluster.serving.routing.frame_reader import FrameReader
from pd_cluster.serving.routing.inbox import AttemptInbox
from pd_cluster.serving.routing.legs import EngineDraining, EngineFailed, Leg

logger = logging.getLogger(__name__)

_decoder = msgspec.msgpack.Decoder(list[EngineDelta])
_REQUEST_HWM = 4096  # requests and aborts queued for an engine that is not reading them


@dataclass
class _Link:
    engine: Any  # EngineState
    incarnation: str
    stream: FrameReader | None = None
    requests: zmq.Socket | None = None  # PUSH: requests and aborts
    legs: dict[str, tuple[Leg, AttemptInbox]] = field(default_factory=dict)  # by request id
    tasks: list[asyncio.Task] = field(default_factory=list)


class TokenChannel:
    def __init__(self, timeout: float,
                 on_lost: Callable[[Any, str, bool], None] = lambda e, why, dead: None,
                 node_id: str | None = None):
        """``timeout`` bounds the session handshake; ``on_lost(engine, why, dead)`` is told
        when an engine's token path broke (the pool marks it failed)."""
        self.session = uuid.uuid4().hex[:16]
        self.node_id = _this_node_id() if node_id is None else node_id
        self._timeout, self._on_lost = timeout, on_lost
        self._secret = cluster_secret()  # proven on every session (session_sockets.py)
        self._ctx = zmq.Context.instance()
        self._links: dict[str, _Link] = {}  # by engine name
        self._locks: dict[str, asyncio.Lock] = {}  # one attach at a time per engine
        self.counters = {"messages": 0, "deltas": 0, "malformed": 0, "unrouted": 0}

    # ---- engines ------------------------------------------------------------------------------
    def linked(self, engine: Any, incarnation: str) -> bool:
        link = self._links.get(engine.name)
        return link is not None and link.incarnation == incarnation

    async def attach(self, engine: Any, incarnation: str) -> None:
        """Open this proxy's session on ``engine`` (its ``incarnation``) and start reading;
        a previous link to it is dropped and its legs fail (their engine restarted). Health
        checks run concurrently (the loop, /cluster/status): the second one waits for the
        first and finds the link made."""
        async with self._locks.setdefault(engine.name, asyncio.Lock()):
            if self.linked(engine, incarnation):
                return
            self.detach(engine, "engine restarted", dead=True)
            endpoint = await asyncio.wait_for(
                engine.handle.open_output.remote(self.session, self.node_id), self._timeout)
            requests = await self._request_socket(engine)  # before any socket that could leak
            link = _Link(engine, incarnation, requests=requests)
            try:
                link.stream = await asyncio.wait_for(self._connect(link, endpoint),
                                                     self._timeout)
            except BaseException:
                requests.close(linger=0)
                raise
            self._links[engine.name] = link
            link.tasks = [asyncio.create_task(self._watch(link))]
            if link.stream.lost:  # dropped before it was linked: fail it the usual way
                self._connection_lost(link)
            logger.info("%s: token path %s", engine.name, endpoint)

    async def _connect(self, link: _Link, endpoint: str) -> FrameReader:
        on = functools.partial
        return await FrameReader.connect(endpoint, on(self._apply, link),
                                         on(self._malformed, link),
                                         on(self._connection_lost, link),
                                         on(session_proof, self._secret, self.session))

    def detach(self, engine: Any, why: str, dead: bool) -> None:
        """Stop reading ``engine``; every leg open on it fails."""
        link = self._links.pop(engine.name, None)
        if link is None:
            return
        for t in link.tasks:
            if t is not asyncio.current_task():  # the watcher may be the one detaching
                t.cancel()
        if link.stream is not None:
            link.stream.close()
        if link.requests is not None:
            link.requests.close(linger=0)
        for leg, inbox in link.legs.values():
            inbox.fail(leg, EngineFailed(engine, f"token path: {why}", dead=dead, reported=True))
        link.legs.clear()

    def open_legs(self, engine: Any) -> int:
        """Legs on ``engine`` whose deltas are still awaited."""
        link = self._links.get(engine.name)
        return len(link.legs) if link is not None else 0

    def move_off(self, engine: Any, which: Callable[[Leg], bool]) -> int:
        """Fail the legs on ``engine`` that ``which`` selects with EngineDraining (their
        requests continue on other engines); the link stays, so their aborts still reach it.
        Returns how many were moved."""
        link = self._links.get(engine.name)
        if link is None:
            return 0
        moved = [(rid, leg, inbox) for rid, (leg, inbox) in link.legs.items() if which(leg)]
        for rid, leg, inbox in moved:
            del link.legs[rid]
            inbox.fail(leg, EngineDraining(engine))
        return len(moved)

    async def close(self) -> None:
        """Close every session (the engines abort what this proxy still had running)."""
        links = list(self._links.values())
        for link in links:
            self.detach(link.engine, "proxy closing", dead=False)
        await asyncio.gather(*(asyncio.wait_for(link.engine.handle.close_output.remote(
            self.session), self._timeout) for link in links), return_exceptions=True)

    # ---- legs ---------------------------------------------------------------------------------
    def register(self, leg: Leg, inbox: AttemptInbox) -> bool:
        """Route ``leg``'s deltas to ``inbox`` (before it is submitted). False: no link to its
        engine (not attached yet, or just lost)."""
        link = self._links.get(leg.engine.name)
        if link is None:
            return False
        link.legs[leg.request.request_id] = (leg, inbox)
        return True

    def submit(self, leg: Leg, request: EngineRequest) -> None:
        """Send ``request`` (``leg``'s, tagged with this session) over the engine's request
        socket. Raises EngineFailed when the engine does not take it (its queue is full or
        the link is gone)."""
        link = self._links.get(leg.engine.name)
        if link is None or link.requests is None:
            raise EngineFailed(leg.engine, "token path lost", dead=False)
        try:
            link.requests.send(request_message(request), zmq.NOBLOCK)
        except zmq.ZMQError as e:  # Again: _REQUEST_HWM unread, the engine is not reading
            raise EngineFailed(leg.engine, f"request not taken: {e}", dead=False) from None

    def abort(self, leg: Leg) -> bool:
        """Abort ``leg`` on its engine after its request, over the same socket. False: that
        is not possible (no socket, the link is gone, or it is full): abort over Ray."""
        link = self._links.get(leg.engine.name)
        if link is None or link.requests is None:
            return False
        try:
            link.requests.send(abort_message([leg.request.request_id]), zmq.NOBLOCK)
        except zmq.ZMQError:
            return False
        return True

    async def _request_socket(self, engine: Any) -> zmq.Socket:
        """A PUSH socket to the engine's request reader (engine/request_reader.py)."""
        endpoint = await asyncio.wait_for(
            engine.handle.open_requests.remote(self.session, self.node_id), self._timeout)
        sock = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, _REQUEST_HWM)
        if endpoint.startswith("tcp://"):  # CURVE keys from the cluster secret
            curve_request_socket(sock, self._secret, server=False)
        sock.connect(endpoint)
        return sock

    def unregister(self, leg: Leg) -> None:
        link = self._links.get(leg.engine.name)
        if link is not None:
            entry = link.legs.get(leg.request.request_id)
            if entry is not None and entry[0] is leg:
                del link.legs[leg.request.request_id]

    # ---- reading (the FrameReader's callbacks) ---------------------------------------------------
    def _apply(self, link: _Link, payload: memoryview) -> None:
        """One frame: one engine step's deltas (raises msgspec's errors: malformed)."""
        deltas = _decoder.decode(payload)
        legs, counters = link.legs, self.counters
        counters["messages"] += 1
        counters["deltas"] += len(deltas)
        for d in deltas:
            entry = legs.get(d.request_id)
            if entry is None:  # its leg ended (finished, failed or cancelled)
                counters["unrouted"] += 1
                continue
            leg, inbox = entry
            inbox.delta(leg, d)
            if d.finished or leg.failure is not None:
                legs.pop(d.request_id, None)

    def _malformed(self, link: _Link, error: Exception) -> None:
        # The stream cannot be re-synchronised: its legs fail (and migrate) as on a lost link.
        self.counters["malformed"] += 1
        self._lose(link, f"malformed frame: {error}"[:300], dead=False)

    def _connection_lost(self, link: _Link) -> None:
        """The engine's end closed. The watcher says why at once (the actor died: dead, and
        its legs migrate at once; or the engine closed the session); should it not, the link
        fails after the handshake timeout."""
        if self._links.get(link.engine.name) is link:
            asyncio.get_running_loop().call_later(self._timeout, self._lose, link,
                                                  "connection lost", False)

    def _lose(self, link: _Link, why: str, dead: bool) -> None:
        if self._links.get(link.engine.name) is not link:
            return
        level = logging.INFO if why == SHUTTING_DOWN else logging.WARNING
        logger.log(level, "%s: token path lost: %s", link.engine.name, why)
        self.detach(link.engine, why, dead)
        self._on_lost(link.engine, f"token path: {why}", dead)

    async def _watch(self, link: _Link) -> None:
        try:
            why = await link.engine.handle.watch_output.remote(self.session)
            dead = False
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the actor died (or its call failed)
            why, dead = f"{type(e).__name__}: {e}"[:300], _is_actor_death(e)
        self._lose(link, why, dead)


def _is_actor_death(e: BaseException) -> bool:
    import ray.exceptions
    return isinstance(e, ray.exceptions.RayActorError)


def _this_node_id() -> str:
    """The Ray node this proxy runs on ("" outside Ray: every engine then uses tcp)."""
    try:
        import ray
        if ray.is_initialized():
            return ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001 - outside a Ray worker or driver
        pass
    return ""
