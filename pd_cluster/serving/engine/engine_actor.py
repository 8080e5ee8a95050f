"""A prefill, decode or colocated engine as a Ray actor.

The actor is async: its event loop serves submissions, control calls and health checks, while
the engine itself runs on the EngineLoop thread (the same driver a stand-alone engine process
uses). Tokens do not travel as Ray calls: the proxy opens an output session (``open_output``)
and sends requests tagged with it over the session's request socket (``open_requests``,
request_reader.py); each engine step's deltas go out to it as one length-prefixed frame on
a stream socket, written by the engine thread itself (output_sender.py). ``watch_output`` is
the one call the proxy keeps open per engine: it fails at once when the actor dies, and
returns when the session closes. There is no other token path.
"""
from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
import uuid
from typing import Any

import msgspec

from pd_cluster import start_trace
from pd_cluster.driver.core_lending import make_sharing
from pd_cluster.driver.cpu_setup import CoreClaim, claim_cores
from pd_cluster.driver.engine_loop import EngineLoop, build_engine
from pd_cluster.driver.messages import (ERROR_ENGINE, ROLE_PREFILL, EngineDelta, EngineInfo,
                                        EngineRequest, EngineSpec)
from pd_cluster.serving.engine.output_sender import OutputSender
from pd_cluster.serving.engine.request_reader import RequestReader

logger = logging.getLogger(__name__)

_SWITCH_INTERVAL = 0.0005  # s
_FATAL_EXIT_DELAY = 1.0  # s: let the error deltas reach the proxy before the process exits


class EngineActor:
    def __init__(self, spec: dict[str, Any], secret: str | None = None):
        """``secret``: the cluster secret (handed through Ray by the launcher; its channels
        prove it). Without one, this process's own (tests: inherited) is used."""
        start_trace.mark_process_start("engine")
        start_trace.mark("engine", "actor init")
        import ray
        import torch

        from connectors.secret import install
        start_trace.mark("engine", "torch imported")
        if secret:
            install(secret)  # before the engine: its connector and subprocesses read it
        self.spec = EngineSpec.from_dict(spec)
        start_trace.mark("engine", f"is {self.spec.name}")
        # The engine thread holds the GIL for most of a (small-model) step; a short switch
        # interval bounds how long the event loop waits to stream outputs (default: 5 ms).
        sys.setswitchinterval(_SWITCH_INTERVAL)
        threads = max(1, int(self.spec.num_cpus))
        self.cores = claim_engine_cores(self.spec, threads)
        # An engine that may borrow the other role's cores keeps a spare thread for its lent
        # steps (driver/core_lending.py); its own steps use its own cores' count.
        lending = make_sharing(self.spec.role, self.cores.cores, self.spec.lend_cores,
                               self.spec.borrow_cores, self.spec.tpot_target_s,
                               self.spec.slo_percentile)
        torch.set_num_threads(threads)  # tiny models on a shared CPU: more threads = slower
        self.node_ip = ray.util.get_node_ip_address()
        self.node_id = ray.get_runtime_context().get_node_id()
        args = dict(self.spec.engine_args)
        if args.get("kv_transfer"):
            args["kv_transfer"] = on_this_node(args["kv_transfer"], self.node_ip)
        self.engine = build_engine(lambda: self._make_engine(args), threads)
        self.incarnation = uuid.uuid4().hex[:12]
        self.kv_endpoint: str | None = getattr(self.engine, "kv_endpoint", lambda: None)()
        self._aio: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        self._sessions: dict[str, asyncio.Future[str]] = {}  # open output session -> closed
        self._readers: dict[str, RequestReader] = {}  # session -> its requests' socket
        self.loop = EngineLoop(self.engine, self._emit, self._on_fatal, threads,
                               self.cores.cores, lending)
        self.output = OutputSender(self.node_ip, self.loop.abort,
                                   self._session_closed_threadsafe,
                                   faults=getattr(getattr(self.engine, "config", None),
                                                  "faults", None))
        self.loop.start()
        start_trace.mark("engine", "engine ready")
        logger.info("%s ready (kv endpoint %s)", self.spec.name, self.kv_endpoint)

    def _make_engine(self, args: dict[str, Any]) -> Any:
        """The engine this actor hosts (a benchmark's subclass hosts one without a model)."""
        from pd_cluster.config import EngineConfig
        from pd_cluster.engine.llm_engine import LLMEngine
        from pd_cluster.serving.cluster.cluster_config import resolve_model
        start_trace.mark("engine", "engine modules imported")

        model = resolve_model(self.spec.model, node=self.node_ip)
        return LLMEngine(EngineConfig.from_kwargs(model, **args))

    # ---- info / health -------------------------------------------------------------------
    def _info(self) -> EngineInfo:
        return EngineInfo(name=self.spec.name, role=self.spec.role, incarnation=self.incarnation,
                          pid=os.getpid(), node_ip=self.node_ip, node_id=self.node_id,
                          kv_endpoint=self.kv_endpoint, kv_peers=self.engine.kv_peers(),
                          max_model_len=self.engine.max_model_len,
                          stats={**self.loop.snapshot, **self.output.counters})

    async def ready(self) -> dict[str, Any]:
        self._bind_loop()
        return self._info().to_dict()

    async def health(self) -> dict[str, Any]:
        self._bind_loop()
        if not self.loop.alive:
            raise RuntimeError(f"{self.spec.name}: engine loop is down ({self.loop.error!r})")
        return self._info().to_dict()

    async def cpu_setup(self) -> dict[str, Any]:
        """Where the engine's compute runs: this process, its engine thread (OS ids, to read
        their affinity from outside), the cores claimed (empty: not pinned, and why), torch's
        thread count on the engine thread, and what LD_PRELOAD held at start."""
        import torch
        threads = await asyncio.wrap_future(self.loop.call(lambda _: torch.get_num_threads()))
        return {"pid": os.getpid(), "engine_thread_id": self.loop.thread_id,
                "cores": list(self.cores.cores), "why_not_pinned": self.cores.why_not,
                "torch_threads": threads, "ld_preload": os.environ.get("LD_PRELOAD", "")}

    async def stats(self) -> dict[str, Any]:
        return {**self.loop.snapshot, **self.output.counters, **self._reader_counters()}

    def _reader_counters(self) -> dict[str, int]:
        """Messages the request sockets took, over every session (request_reader.py)."""
        return {f"session_{k}": sum(r.counters[k] for r in self._readers.values())
                for k in ("requests", "aborts", "malformed")}

    async def cache_events(self, full: bool = False, timeout: float = 10.0,
                           cursor: int | None = None) -> dict[str, Any]:
        """The prefix cache's changes after ``cursor`` (block hashes stored, removed, on the
        device and in the lower KV tiers; each reader passes the ``cursor`` its previous report
        returned), for the proxy's cache-aware routing; ``full``, no cursor, or one too old
        sends every hash held in each, with ``reset`` set. Taken between engine steps, on the
        engine thread."""
        def take(engine: Any) -> dict[str, Any]:
            return cache_report(engine.block_manager, None if full else cursor)
        out = await asyncio.wait_for(asyncio.wrap_future(self.loop.call(take)), timeout)
        spec = self.engine.runner.kv_spec
        return {**out, "incarnation": self.incarnation, "block_size": spec.block_size,
                "kv_bytes_per_token": spec.token_bytes}

    async def check_no_leaks(self, timeout: float = 10.0) -> None:
        """AssertionError unless no request and no KV block is held (LLMEngine's contract;
        over Ray the caller's ``ray.get`` raises it too)."""
        fut = self.loop.call(lambda engine: engine.check_no_leaks())
        await asyncio.wait_for(asyncio.wrap_future(fut), timeout)

    async def connect_peers(self, peers: dict[str, str], timeout: float = 30.0,
                            stale: list[str] | None = None) -> dict[str, str | None]:
        """Producer: handshake with consumers (endpoint -> incarnation tag), in parallel and
        off the engine thread, after forgetting ``stale`` endpoints (consumers gone for
        good); returns endpoint -> None or why it failed."""
        for endpoint in stale or []:
            await asyncio.to_thread(self.engine.disconnect_kv_peer, endpoint)
        async def one(endpoint: str, tag: str) -> tuple[str, str | None]:
            try:
                await asyncio.wait_for(asyncio.to_thread(self.engine.connect_kv_peer, endpoint,
                                                         tag), timeout)
            except Exception as e:  # noqa: BLE001 - reported to the caller, who retries
                return endpoint, f"{type(e).__name__}: {e}"[:500]
            return endpoint, None
        return dict(await asyncio.gather(*(one(ep, tag) for ep, tag in peers.items())))

    async def switch_role(self, role: str, kv_role: str, prefill_cap: int | None = None,
                          timeout: float = 60.0) -> dict[str, Any]:
        """Become a ``role`` engine in place (weights and cache kept): the connector turns
        ``kv_role`` (on every rank), the scheduler takes the role's prefill cap, core lending
        ends. The caller drained the engine first (a request in flight: ValueError)."""
        fut = self.loop.call(lambda engine: engine.set_kv_role(kv_role, prefill_cap))
        self.kv_endpoint = await asyncio.wait_for(asyncio.wrap_future(fut), timeout)
        await asyncio.wait_for(asyncio.wrap_future(self.loop.end_lending()), timeout)
        self.spec = msgspec.structs.replace(self.spec, role=role)
        logger.info("%s is now a %s engine (kv endpoint %s)", self.spec.name, role,
                    self.kv_endpoint)
        return self._info().to_dict()

    async def kv_holds(self) -> dict[str, int]:
        """What the KV connector still holds (all zero on a drained engine)."""
        return self.engine.kv_holds()

    # ---- the token path: output sessions ---------------------------------------------------
    async def open_output(self, session: str, proxy_node_id: str) -> str:
        """Listen (or find the listener) for ``session``'s token stream: a unix socket if the
        proxy runs on this node, tcp on this node's address otherwise. Returns the endpoint
        the proxy connects to (``unix://<path>`` or ``tcp://<host>:<port>``)."""
        self._bind_loop()
        endpoint = await asyncio.wrap_future(
            self.output.open(session, ipc=proxy_node_id == self.node_id))
        if session not in self._sessions:
            self._sessions[session] = asyncio.get_running_loop().create_future()
        return endpoint

    async def watch_output(self, session: str) -> str:
        """Returns why ``session`` closed, when it does; fails when this actor dies."""
        closed = self._sessions.get(session)
        if closed is None:
            return f"no output session {session!r} here (engine restarted?)"
        return await asyncio.shield(closed)

    async def close_output(self, session: str) -> None:
        """The proxy is going away: its session closes and its requests are aborted."""
        self.output.close(session)

    async def open_requests(self, session: str, proxy_node_id: str) -> str:
        """Bind (or find) the socket ``session``'s requests and aborts come in on (after
        ``open_output``; ipc or tcp as it); returns its endpoint (request_reader.py)."""
        reader = self._readers.get(session)
        if reader is None:
            reader = self._readers[session] = RequestReader(
                session, proxy_node_id == self.node_id, self.node_ip, self.output.ipc_dir,
                self._accept_from_session, self.loop.abort)
        return reader.endpoint

    def _accept_from_session(self, req: EngineRequest) -> None:
        refused = self._start(req)
        if refused is not None and req.output_session in self._sessions:
            # Answered where the proxy waits for the request's output: its token path.
            self.output.route(req.request_id, req.output_session)
            self.output.emit([EngineDelta(req.request_id, finished=True,
                                          finish_reason="abort", error_type=ERROR_ENGINE,
                                          error=f"submit refused: {refused}")])

    def _start(self, req: EngineRequest) -> str | None:
        closed = self._sessions.get(req.output_session)
        if closed is None or closed.done():
            return f"no open output session {req.output_session!r}"
        if not self.loop.alive:
            return f"engine loop is down: {self.loop.error!r}"
        self.output.route(req.request_id, req.output_session)
        self.loop.submit(req)
        return None

    async def abort(self, request_ids: list[str]) -> None:
        self.loop.abort(request_ids)

    async def shutdown(self) -> None:
        """Stop the engine thread and close the connector (before the actor is killed)."""
        self.loop.stop(timeout=5.0)
        self.output.stop(timeout=5.0)
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()
        self.cores.release()

    # ---- engine thread -> event loop -------------------------------------------------------
    def _bind_loop(self) -> None:
        if self._aio is None:
            with self._lock:
                self._aio = asyncio.get_running_loop()

    def _emit(self, deltas: list[EngineDelta]) -> None:
        self.output.emit(deltas)  # the engine thread writes the frames itself, non-blocking

    def _session_closed_threadsafe(self, session: str, why: str) -> None:
        with self._lock:
            aio = self._aio
        if aio is not None:
            try:
                aio.call_soon_threadsafe(self._session_closed, session, why)
            except RuntimeError:  # the event loop is closed: the actor is shutting down
                pass

    def _session_closed(self, session: str, why: str) -> None:
        reader = self._readers.pop(session, None)
        if reader is not None:
            reader.close()
        closed = self._sessions.pop(session, None)
        if closed is not None and not closed.done():
            closed.set_result(why)

    def _on_fatal(self, exc: BaseException) -> None:
        # The engine's state is unknown: exit so Ray restarts the actor with a fresh engine.
        logger.error("%s: fatal engine error, exiting for a restart: %r", self.spec.name, exc)
        timer = threading.Timer(_FATAL_EXIT_DELAY, lambda: os._exit(1))
        timer.daemon = True
        timer.start()


def cache_report(block_manager: Any, cursor: int | None) -> dict[str, Any]:
    """The block manager's cache events after ``cursor`` as the proxy's CacheFeed reads them
    (plain lists: msgpack-able), or, after a reset, everything it holds on the device and in
    its lower tiers."""
    events, nxt = block_manager.events_since(cursor)
    if events.reset:
        return {"reset": True, "stored": list(block_manager.cached_hashes()), "removed": [],
                "stored_lower": list(block_manager.lower_cached_hashes()),
                "removed_lower": [], "cursor": nxt}
    return {"reset": False, "stored": list(events.stored), "removed": list(events.removed),
            "stored_lower": list(events.stored_lower),
            "removed_lower": list(events.removed_lower), "cursor": nxt}


def on_this_node(kv_transfer: dict[str, Any], node_ip: str) -> dict[str, Any]:
    """The KV endpoint listens on this node's own address unless the config names a rule
    (host, interface or cidr) that the pipe applies here."""
    if any(kv_transfer.get(k) for k in ("host", "interface", "cidr")):
        return kv_transfer
    return {**kv_transfer, "host": node_ip}


def claim_engine_cores(spec: EngineSpec, threads: int) -> CoreClaim:
    """The cores this engine's compute threads are pinned to (none when its spec says not
    to, it runs on a GPU, or its node has no free cores; the log says which). A prefill
    engine takes the serving path's cores first (driver/cpu_setup.py)."""
    if not spec.pin_threads or spec.num_gpus > 0:
        return CoreClaim(why_not="pinning is off" if not spec.pin_threads else "GPU engine")
    claim = claim_cores(threads, spec.reserve_cores, serving_first=spec.role == ROLE_PREFILL)
    if claim.cores:
        logger.info("%s: compute threads pinned to cores %s", spec.name, list(claim.cores))
    else:
        logger.warning("%s: compute threads not pinned: %s", spec.name, claim.why_not)
    return claim


def engine_actor_class() -> Any:
    """The Ray remote class (created lazily so importing this module does not need Ray)."""
    import ray
    return ray.remote(EngineActor)
