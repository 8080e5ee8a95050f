"""The engine's end of the request path: a proxy session's requests and aborts over ZMQ.

A Ray actor call costs both processes a few hundred microseconds of CPU (measured in
bench_proxy: as much per request as streaming a hundred tokens); so, like the tokens, a
session's requests come over one socket: the proxy PUSHes, the engine's event loop reads
(a callback on the socket's descriptor, as the proxy reads tokens). One message is a kind
byte and its msgpack body. Requests and aborts share the socket, so an abort never overtakes
the request it aborts. A request the engine refuses is answered on the token path (an error
delta), where the proxy waits for it anyway.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Callable

import msgspec
import zmq

from pd_cluster.driver.messages import EngineRequest, decode_request, encode
from pd_cluster.serving.engine.session_sockets import bind_session_socket, unlink_quietly

logger = logging.getLogger(__name__)

REQUEST = b"R"  # body: an EngineRequest
ABORT = b"A"  # body: a list of request ids
_abort_decoder = msgspec.msgpack.Decoder(list[str])
_DRAIN = 256  # messages taken per turn of the event loop


def request_message(request: EngineRequest) -> bytes:
    return REQUEST + encode(request)


def abort_message(request_ids: list[str]) -> bytes:
    return ABORT + encode(request_ids)


class RequestReader:
    """One session's PULL socket, read on the running event loop. ``accept(request)`` starts
    a request (or answers it with an error delta); ``abort(ids)`` aborts requests."""

    def __init__(self, session: str, ipc: bool, host: str, ipc_dir: str,
                 accept: Callable[[EngineRequest], None],
                 abort: Callable[[list[str]], None]):
        self.session, self._accept, self._abort = session, accept, abort
        from connectors.secret import cluster_secret
        self.sock, self.endpoint, self._ipc_path = bind_session_socket(
            zmq.Context.instance(), zmq.PULL, ipc, host, ipc_dir, cluster_secret())
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self.sock.FD, self._read)
        self._loop.call_soon(self._read)  # edge-triggered: drain what is already there
        self.counters = {"requests": 0, "aborts": 0, "malformed": 0}

    def _read(self) -> None:
        if self.sock.closed:
            return
        for _ in range(_DRAIN):
            try:
                data = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._handle(data)
        self._loop.call_soon(self._read)  # more: after the rest of the loop ran

    def _handle(self, data: bytes) -> None:
        kind, body = data[:1], data[1:]
        try:
            if kind == REQUEST:
                request = decode_request(body)
                self.counters["requests"] += 1
                self._accept(request)
            elif kind == ABORT:
                ids = _abort_decoder.decode(body)
                self.counters["aborts"] += 1
                self._abort(ids)
            else:
                raise ValueError(f"unknown message kind {kind!r}")
        except (ValueError, msgspec.DecodeError) as e:  # a bad message, not a bad engine
            self.counters["malformed"] += 1
            logger.warning("session %s: malformed request message dropped: %s",
                           self.session, e)

    def close(self) -> None:
        if not self.sock.closed:
            self._loop.remove_reader(self.sock.FD)
            self.sock.close(linger=0)
        unlink_quietly(self._ipc_path)
