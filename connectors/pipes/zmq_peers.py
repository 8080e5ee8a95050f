"""The ZMQ pipe's peer side, run on its I/O thread: the listening socket (bound to this node's
address), one socket per consumer it connects to, the handshake, and checking what arrives.

Split from zmq_pipe.py (the public API, backpressure and the I/O loop); both halves are one
object (ZmqPipe), and only the I/O thread calls these methods.
"""
from __future__ import annotations

import logging
import os
import tempfile
import uuid
from concurrent.futures import Future
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import zmq

from connectors.pipes import auth, integrity, wire
from connectors.pipes.addressing import route_address
from connectors.pipes.base import PipeError
from connectors.pipes.zmq_conns import Conn, disconnected_fds, source_fd, watch_disconnects
from pd_cluster.futures import settle
from pd_cluster.ipc_files import sweep_stale

log = logging.getLogger("connectors.pipes.zmq_pipe")
IPC_PREFIX = "pd-pipe-"  # ipc endpoint files: pd-pipe-<pid>-<random>.sock (ipc_files.py)
_MAX_CHALLENGES = 1024  # handshakes half done at once (the oldest is forgotten beyond it)
_READ_BURST = 64   # messages read per socket per loop turn, so one peer cannot starve the rest


@dataclass(eq=False)
class Outgoing:
    peer: str
    head: bytes
    payload: list                  # memoryview chunks of `keep`
    future: Optional[Future]       # None for internal control messages (hello/ack)
    charge: int = 0                # bytes counted against the in-flight cap
    keep: Any = None               # owns the payload memory until zmq releases it
    tracker: Any = None            # one MessageTracker over all payload frames, once sent
    started: bool = False
    queued: float = field(default_factory=time.monotonic)  # for the send_timeout bound


class _NotAPeer(wire.Malformed):
    """Data from a connection that has not completed a handshake."""


def peer_name(ident: bytes) -> str:
    """ROUTER identity -> peer name; reversible (raw zmq peers get random binary identities)."""
    try:
        name = ident.decode()
        if not name.startswith("hex:"):
            return name
    except UnicodeDecodeError:
        pass
    return "hex:" + ident.hex()


def identity(peer: str) -> bytes:
    return bytes.fromhex(peer[4:]) if peer.startswith("hex:") else peer.encode()


class ZmqPeers:
    """Socket and handshake methods of ZmqPipe (see its __init__ for the attributes)."""

    def _bind(self) -> str:
        if self._router is not None:
            return self._addr
        s = self._new_socket(zmq.ROUTER)
        s.setsockopt(zmq.ROUTER_MANDATORY, 1)   # a reply to an unknown peer fails, not vanishes
        c = self.config
        if c.security == "curve":
            auth.curve_server(s, self._secret)
        if c.transport == "tcp":
            host = c.bind_host()
            if ":" in host:
                s.setsockopt(zmq.IPV6, 1)
            url_host = f"[{host}]" if ":" in host else host
            if c.port_range and not c.port:
                lo, hi = c.port_range
                port = s.bind_to_random_port(f"tcp://{url_host}", lo, hi + 1,
                                             max_tries=4 * (hi - lo + 1))
            else:
                s.bind(f"tcp://{url_host}:{c.port or '*'}")
                port = int(s.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
            if host in ("0.0.0.0", "::"):  # every interface: advertise the routable one
                host = route_address()
            addr = f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
        else:
            ipc_dir = c.ipc_dir or tempfile.gettempdir()
            sweep_stale(ipc_dir, IPC_PREFIX)  # left by engines that were killed (no close ran)
            self._ipc_path = os.path.join(ipc_dir, f"{IPC_PREFIX}{os.getpid()}-"
                                                   f"{uuid.uuid4().hex[:12]}.sock")
            addr = f"ipc://{self._ipc_path}"
            s.bind(addr)
        self._router, self._addr = s, addr
        self._watch(s, None)  # producers' connections that end are forgotten
        return addr

    def take_lost_peers(self) -> list[str]:
        """Producers whose authenticated connection closed since the last call."""
        lost = []
        while self._lost_peers:
            lost.append(self._lost_peers.popleft())
        return lost

    def _watch(self, s: zmq.Socket, peer: Optional[str]) -> None:
        m = watch_disconnects(s)
        self._monitors[m], self._watched[s] = peer, m

    def _unwatch(self, s: zmq.Socket) -> None:
        m = self._watched.pop(s, None)
        if m is not None:
            s.disable_monitor()
            del self._monitors[m]
            m.close(linger=0)

    def _on_disconnects(self, m: zmq.Socket) -> None:
        """The ROUTER's: forget the producers bound to those sockets. A producer's socket to
        a consumer: after its handshake, a lost connection ends the link (ZMQ would reconnect
        under the same identity, which the consumer no longer accepts): sends fail from
        now, and the connector re-links (a new handshake, new keys)."""
        fds = disconnected_fds(m)
        peer = self._monitors.get(m)
        if peer is None:
            for fd in fds:
                self._lost_peers.extend(peer_name(i) for i in self._conns.drop_fd(fd))
        elif fds and peer in self._channels:
            self._close_dealer(peer, PipeError(f"connection to {peer!r} lost"))

    def _open_dealer(self, peer: str, ident: bytes, hs: Future, hello: Outgoing) -> None:
        self._close_dealer(peer, PipeError("reconnected"))
        s = self._new_socket(zmq.DEALER)
        s.setsockopt(zmq.ROUTING_ID, ident)
        if self.config.security == "curve":
            auth.curve_client(s, self._secret)
        s.connect(peer)
        self._watch(s, peer)
        self._dealers[peer], self._sock_peer[s] = s, peer
        self._pending_hs[peer] = hs
        self._outq[s].append(hello)

    def _send_hello(self, peer: str, hs: Future, hello: Outgoing) -> None:
        """A further handshake round on the open socket to ``peer``."""
        s = self._dealers.get(peer)
        if s is None:
            settle(hs, PipeError(f"not connected to {peer!r}"))
            return
        self._pending_hs[peer] = hs
        self._outq[s].append(hello)

    def _close_dealer(self, peer: str, exc: BaseException, linger: float = 0.0) -> None:
        """Close the socket to ``peer``; with ``linger``, what is already queued (a FIN) is
        handed to zmq first and may still be delivered for that long."""
        s = self._dealers.pop(peer, None)
        if s is not None:
            if linger:
                self._flush(s)  # under the channel's keys: it goes after
            del self._sock_peer[s]
            for out in self._outq.pop(s):
                self._finish(out, exc)
            settle(self._pending_hs.pop(peer, None), exc)
            self._unwatch(s)
            s.close(linger=int(linger * 1000))
        self._channels.pop(peer, None)

    def _read(self, s: zmq.Socket) -> None:
        for _ in range(_READ_BURST):
            if self._rq.full:
                return
            try:
                frames = s.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            ident = None
            if s is self._router:
                ident, frames = frames[0].bytes, frames[1:]
                peer = peer_name(ident)
            else:
                peer = self._sock_peer[s]
            try:
                self._handle(ident, peer, frames)
            except _NotAPeer:  # counted; logged rate-limited: floods stay quiet
                self._n["refused"] += 1
                self._limited.warn("refused messages", "zmq pipe: refused messages from %r: "
                                   "no handshake on this connection", peer[:120])
            except Exception as e:   # whatever a peer sends, the I/O thread keeps serving
                self._n["dropped"] += 1
                self._limited.warn("dropped messages", "zmq pipe: dropped a message from "
                                   "%r: %s", peer[:120], f"{type(e).__name__}: {e}"[:300])

    def _handle(self, ident: Optional[bytes], peer: str, frames: list) -> None:
        if not frames:
            raise wire.Malformed("empty message")
        head = frames[0].bytes
        kind, body, meta = wire.unpack(head)
        if kind == "hello" and ident is not None:
            return self._on_hello(ident, peer, body, source_fd(frames[0]))
        if kind == "ack" and ident is None:
            hs = self._pending_hs.pop(peer, None)
            if hs is not None and not hs.done():   # a late ack after a timeout is ignored
                hs.set_result(body)
            return None
        if kind != "d":
            raise wire.Malformed(f"unexpected {kind!r} message")
        if ident is not None:  # a producer: only on the connection its handshake came on
            conn = self._conns.on_this_connection(ident, frames[0])
            if conn is None:
                raise _NotAPeer()
            channel = conn.channel
        else:                  # the consumer's reply on our own socket
            channel = self._channels.get(peer)
            if channel is None:
                raise wire.Malformed("a reply from a peer without a handshake")
        tag, payload = None, frames[1:]
        if channel.mode != "none":  # the tag frame is the last (integrity.py)
            if not payload:
                raise wire.Malformed(f"no {channel.mode} tag")
            tag, payload = payload[-1].bytes, payload[:-1]
        tensor = wire.tensor_from_buffers(meta, payload)
        # Checked by recv_tensor's caller, not here: this thread serves every socket.
        self._rq.put((peer, body, tensor, (channel, head, tag)),
                     len(head) + (tensor.nbytes if tensor is not None else 0))
        self._n["received"] += 1
        return None

    def _on_hello(self, ident: bytes, peer: str, hello: dict, fd: int) -> None:
        keys = (b"", b"")
        if self._secret is not None:
            proven = self._proven(ident, peer, hello)
            if proven is None:
                return
            hello, keys = proven
        err = integrity.mismatch(self.config.integrity, hello)
        hello.pop(integrity.HELLO_KEY, None)
        try:
            if err is None and self._validator is not None:
                err = self._validator(hello)
            if err is None and self._peer_hook is not None:
                self._peer_hook(peer, hello)
        except Exception as e:
            log.warning("zmq pipe: handshake check of %r raised %r", peer, e)
            err = "handshake check failed"
        if err is None:  # the consumer receives with the producer's sending key
            p2c, c2p = keys
            self._conns.add(ident, Conn(hello, self._channel(send_key=c2p, recv_key=p2c), fd))
            reply = {"ok": True, "identity": peer, "info": self._handshake_info(hello)}
        else:
            self._conns.pop(ident)
            reply = {"ok": False, "error": str(err)}
            log.warning("zmq pipe: rejected the handshake of %r: %s", peer[:120], err)
        self._reply(peer, reply)

    def _handshake_info(self, hello: dict) -> dict:
        """What an accepted producer learns (the auto pipe answers per producer)."""
        return self._info

    def _proven(self, ident: bytes, peer: str, hello: dict
                ) -> Optional[tuple[dict, tuple[bytes, bytes]]]:
        """auth.py's exchange, consumer side: answers a first round with our proof and a
        challenge (None: nothing more to do now); returns the producer's model hello and the
        connection's integrity keys once its proof held. A failed proof: counted, logged
        rate-limited, one fixed answer."""
        self._conns.pop(ident)  # a new handshake: not a peer until it succeeds
        proof = hello.pop(auth.KEY, None)
        if isinstance(proof, dict) and auth.is_nonce(proof.get("n")):
            mine = auth.new_nonce()
            self._challenges.pop(ident, None)
            self._challenges[ident] = (proof["n"], mine, time.monotonic())
            while len(self._challenges) > _MAX_CHALLENGES:
                self._challenges.pop(next(iter(self._challenges)))
            self._reply(peer, {"challenge": mine, "proof": auth.proof(
                self._secret, "consumer", proof["n"], mine)})
            return None
        pending = self._challenges.pop(ident, None)
        if (isinstance(proof, dict) and pending is not None
                and time.monotonic() - pending[2] <= self.config.handshake_timeout
                and auth.check(auth.proof(self._secret, "producer", pending[0], pending[1]),
                               proof.get("proof"))):
            return hello, integrity.session_keys(self._secret, pending[0], pending[1])
        self._n["auth_failures"] += 1
        self._limited.warn("failed KV proofs", "zmq pipe: refused peer %r: %s", peer[:120],
                           auth.REFUSED)
        self._reply(peer, {"ok": False, "error": auth.REFUSED})
        return None

    def _reply(self, peer: str, body: dict) -> None:
        self._outq[self._router].append(Outgoing(peer, wire.pack("ack", body), [], None))
