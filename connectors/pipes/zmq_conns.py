"""The consumer's authenticated connections: which ROUTER identity completed a handshake on
which socket (file descriptor), with which integrity channel; forgotten when that socket
disconnects.

A ROUTER identity crosses the wire in clear: a process that saw it could reconnect under it
once the producer is gone. So an entry is bound to the connection it was made on (the
frame's source descriptor must be the handshake's), dropped when ZMQ's socket monitor reports
that descriptor disconnected, and the table is bounded. The integrity channel's per-connection
key is the guard that holds even in the window before the monitor's event is read: a frame
under a re-used identity without the key fails its MAC.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

import zmq
from zmq.utils.monitor import parse_monitor_message

from connectors.pipes.integrity import Channel

log = logging.getLogger("connectors.pipes.zmq_pipe")
MAX_CONNECTIONS = 1024  # authenticated producer connections at once (the oldest goes beyond)


@dataclass
class Conn:
    hello: dict
    channel: Channel
    fd: int  # the socket the handshake came on; -1 when ZMQ did not say


def source_fd(frame: Any) -> int:
    """The descriptor a received frame came from (-1 where the transport does not say)."""
    try:
        return int(frame.get(zmq.SRCFD))
    except (zmq.ZMQError, AttributeError, TypeError, ValueError):
        return -1


class Connections:
    """ROUTER identity -> Conn, owned by the pipe's I/O thread."""

    def __init__(self, limit: int = MAX_CONNECTIONS) -> None:
        self._by_ident: dict[bytes, Conn] = {}
        self.limit = limit
        self.dropped = 0  # entries forgotten on disconnect or over the bound

    def __len__(self) -> int:
        return len(self._by_ident)

    def add(self, ident: bytes, conn: Conn) -> None:
        self._by_ident.pop(ident, None)
        self._by_ident[ident] = conn
        while len(self._by_ident) > self.limit:
            self._by_ident.pop(next(iter(self._by_ident)))
            self.dropped += 1

    def pop(self, ident: bytes) -> Optional[Conn]:
        return self._by_ident.pop(ident, None)

    def get(self, ident: bytes) -> Optional[Conn]:
        return self._by_ident.get(ident)

    def on_this_connection(self, ident: bytes, frame: Any) -> Optional[Conn]:
        """The identity's entry if ``frame`` came on the socket its handshake came on."""
        conn = self._by_ident.get(ident)
        if conn is None or (conn.fd != -1 and source_fd(frame) != conn.fd):
            return None
        return conn

    def drop_fd(self, fd: int) -> list[bytes]:
        """Forget every identity bound to a socket that disconnected; returns them."""
        gone = [i for i, c in self._by_ident.items() if c.fd == fd]
        for ident in gone:
            del self._by_ident[ident]
        self.dropped += len(gone)
        return gone


def watch_disconnects(router: zmq.Socket) -> zmq.Socket:
    """A monitor socket that reports the ROUTER's disconnected connections."""
    return router.get_monitor_socket(zmq.EVENT_DISCONNECTED)


def disconnected_fds(monitor: zmq.Socket, limit: int = 256) -> list[int]:
    """Descriptors reported disconnected since the last call (non-blocking)."""
    fds = []
    for _ in range(limit):
        try:
            msg = monitor.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            break
        try:
            event = parse_monitor_message(msg)
        except Exception as e:  # noqa: BLE001 - a monitor message we cannot read: skip it
            log.debug("zmq pipe: unreadable monitor event: %s", e)
            continue
        if event["event"] == zmq.EVENT_DISCONNECTED:
            fds.append(int(event["value"]))
    return fds
