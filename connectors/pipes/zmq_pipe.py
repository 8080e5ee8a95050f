"""ZMQ pipe: consumer ROUTER (tcp/ipc), one producer DEALER per peer, zero-copy payload frames.

Frame 0 is the msgpack envelope (connectors.pipes.wire), frames 1.. the tensor's raw bytes in
chunks of at most max_frame_bytes. One I/O thread owns every socket (zmq sockets are not thread
safe); callers enqueue commands and wake it through an os.pipe. A send's future resolves only
when zmq has released *every* payload frame (a tracker covers one frame: vLLM #24655).
This file holds the public API and the I/O loop; the sockets' peer side (bind, connect,
handshake, checking what arrives) is in zmq_peers.py, the sending side in zmq_sends.py, the
consumer's authenticated connections in zmq_conns.py.
"""
from __future__ import annotations

import logging
import os
import queue
import socket as pysocket
import threading
import time
import uuid
from collections import deque
from concurrent.futures import Future, TimeoutError as FutureTimeout
from typing import Any, Callable, Optional

import msgpack
import torch
import zmq

from connectors.pipes import auth, integrity, wire
from connectors.pipes.base import (HandshakeError, KVPipe, Message, PipeClosed, PipeConfig,
                                   PipeError, PipeTimeout, register_pipe)
from connectors.pipes.log_limit import LimitedLog
from connectors.pipes.sync import InflightGate, RecvQueue, ReleaseReaper
from pd_cluster.futures import settle
from connectors.pipes.zmq_conns import Connections
from connectors.pipes.zmq_peers import Outgoing as _Out
from connectors.pipes.zmq_peers import ZmqPeers
from connectors.pipes.zmq_sends import ZmqSends

log = logging.getLogger(__name__)


@register_pipe("zmq")
class ZmqPipe(ZmqSends, ZmqPeers, KVPipe):
    def __init__(self, config: PipeConfig) -> None:
        super().__init__(config)
        from connectors.secret import cluster_secret
        # Before any thread or socket: no secret with a security mode that needs one is a
        # configuration error, raised here.
        self._secret = None if config.security == "none" else cluster_secret()
        self._ctx = zmq.Context(io_threads=int(config.extra.get("io_threads", 1)))
        self._gate = InflightGate(config.max_inflight_bytes)
        self._rq = RecvQueue(config.max_recv_bytes, self._wake)
        self._reaper = ReleaseReaper(self._finish, zmq.NotDone)
        self._cmds: queue.Queue = queue.Queue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._lock = threading.Lock()          # orders close() against enqueues
        self._closed = False
        self._stop = threading.Event()
        self._sleeping = True
        # 128 random bits: a ROUTER routes by identity, so one must not be guessable.
        self._id_base = f"{pysocket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex}"
        self._n_connects = 0
        self._n = {"sent": 0, "received": 0, "dropped": 0, "auth_failures": 0,
                   "refused": 0, "integrity_failures": 0}
        self._limited = LimitedLog(log)  # what peers can cause at will: rate-limited
        self._validator: Optional[Callable[[dict], Optional[str]]] = None
        self._info: dict = {}
        self._peer_hook: Optional[Callable[[str, dict], None]] = None  # the nccl pipe's hook
        # Test-only (faulty_pipe.py): wraps each connection's integrity channel; None: off.
        self.wrap_channel: Optional[Callable[[integrity.Channel], Any]] = None
        # Owned by the I/O thread:
        self._router: Optional[zmq.Socket] = None
        self._addr: Optional[str] = None
        self._ipc_path: Optional[str] = None
        self._dealers: dict[str, zmq.Socket] = {}     # peer address -> socket
        self._sock_peer: dict[zmq.Socket, str] = {}
        self._outq: dict[zmq.Socket, deque] = {}     # every socket, with its unsent messages
        self._pending_hs: dict[str, Future] = {}
        self._monitors: dict[zmq.Socket, Optional[str]] = {}  # -> dealer's peer; None: ROUTER
        self._watched: dict[zmq.Socket, zmq.Socket] = {}  # socket -> its monitor
        self._conns = Connections()                   # authenticated producer connections
        self._lost_peers: deque[str] = deque(maxlen=1024)  # their peers once disconnected
        self._channels: dict[str, integrity.Channel] = {}  # consumer address -> ours to it
        self._challenges: dict[bytes, tuple[bytes, bytes, float]] = {}  # auth.py, round 1
        self._io = threading.Thread(target=self._io_loop, name="zmq-pipe-io", daemon=True)
        self._io.start()

    # ------------------------------------------------------------------ public API
    def listen(self) -> str:
        return self._run_in_io(self._bind)

    def set_handshake_validator(self, fn: Optional[Callable[[dict], Optional[str]]],
                                info: Optional[dict] = None) -> None:
        msgpack.packb(info or {}, use_bin_type=True)  # fail here, not in the I/O thread
        self._validator, self._info = fn, dict(info or {})

    def connect(self, peer_addr: str, hello: dict) -> dict:
        if not isinstance(hello, dict):
            raise TypeError("hello must be a dict")
        with self._lock:
            self._n_connects += 1
            ident = f"{self._id_base}-{self._n_connects}".encode()
        hello = {**hello, integrity.HELLO_KEY: integrity.hello_value(self.config.integrity)}
        keys = (b"", b"")
        if self._secret is None:
            reply = self._hello_round(peer_addr, hello, ident)
        else:  # auth.py: the consumer proves the secret first, then we do, with our hello
            mine = auth.new_nonce()
            first = self._hello_round(peer_addr, {auth.KEY: {"n": mine}}, ident)
            theirs = first.get("challenge")
            if not (auth.is_nonce(theirs) and auth.check(
                    auth.proof(self._secret, "consumer", mine, theirs), first.get("proof"))):
                self._run_in_io(lambda: self._close_dealer(peer_addr, PipeError("refused")))
                raise HandshakeError(
                    f"{peer_addr} did not prove the cluster secret (another cluster, another "
                    f"kv_transfer.security, or not a pd-cluster consumer)")
            reply = self._hello_round(peer_addr, {**hello, auth.KEY: {
                "proof": auth.proof(self._secret, "producer", mine, theirs)}})
            keys = integrity.session_keys(self._secret, mine, theirs)
        if not reply.get("ok"):
            self._run_in_io(lambda: self._close_dealer(peer_addr, PipeError("handshake rejected")))
            raise HandshakeError(f"{peer_addr} rejected the handshake: {reply.get('error')}")
        channel = self._channel(send_key=keys[0], recv_key=keys[1])
        self._run_in_io(lambda: self._channels.__setitem__(peer_addr, channel))
        return reply

    def _channel(self, send_key: bytes, recv_key: bytes) -> integrity.Channel:
        """A connection's integrity channel (wrapped by the fault hook when it is on)."""
        channel = integrity.Channel(self.config.integrity, send_key=send_key, recv_key=recv_key)
        return channel if self.wrap_channel is None else self.wrap_channel(channel)

    def _hello_round(self, peer_addr: str, hello: dict, ident: Optional[bytes] = None) -> dict:
        """Send a hello (on a new socket with ``ident``, else on the open one) and wait for
        the consumer's answer."""
        out, hs = _Out(peer_addr, wire.pack("hello", hello), [], None), Future()
        if ident is not None:
            self._run_in_io(lambda: self._open_dealer(peer_addr, ident, hs, out))
        else:
            self._run_in_io(lambda: self._send_hello(peer_addr, hs, out))
        try:
            return hs.result(timeout=self.config.handshake_timeout)
        except FutureTimeout:
            self._run_in_io(lambda: self._close_dealer(peer_addr, PipeError("handshake timed out")))
            raise PipeTimeout(f"no handshake reply from {peer_addr} within "
                              f"{self.config.handshake_timeout}s") from None

    def disconnect(self, peer_addr: str) -> None:
        self._run_in_io(lambda: self._close_dealer(peer_addr, PipeError("peer disconnected"),
                                                   linger=self.config.linger))

    def send_tensor(self, peer: str, header: dict, tensor: Optional[torch.Tensor]) -> Future:
        if not isinstance(header, dict):
            raise TypeError("header must be a dict")
        meta, payload, t = None, [], None
        if tensor is not None:
            t, meta, payload = wire.cpu_payload(tensor, self.config.max_frame_bytes)
        head = wire.pack("d", header, meta)   # a non-msgpack header raises TypeError here
        out = _Out(peer, head, payload, Future(), len(head) + (t.nbytes if t is not None else 0), t)
        self._gate.acquire(out.charge, self.config.send_timeout)
        with self._lock:
            if self._closed:
                self._gate.release(out.charge)
                raise PipeClosed("pipe is closed")
            self._cmds.put(("send", out))
        self._wake()
        return out.future

    def recv_tensor(self, timeout: float) -> Optional[Message]:
        """The next message whose integrity tag holds (integrity.py); the others are dropped
        and counted (a layer that never comes fails its transfer closed at the FIN)."""
        deadline = time.monotonic() + timeout
        while True:
            item = self._rq.get(max(0.0, deadline - time.monotonic()))
            if item is None:
                return None
            peer, body, tensor, (channel, head, tag) = item
            bad = channel.check(head, [wire.tensor_bytes(tensor)] if tensor is not None
                                else [], tag)
            if bad is None:
                return peer, body, tensor
            self._n["integrity_failures"] += 1
            self._limited.warn("integrity failures", "zmq pipe: dropped a message from %r: %s",
                               peer[:120], bad)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._gate.close()
        self._stop.set()
        self._wake()
        self._io.join(self.config.linger + 10)
        self._reaper.stop()
        if not self._io.is_alive():   # it closed every socket with a bounded linger
            self._ctx.term()          # returns once zmq has released every message
            os.close(self._wake_r)
            os.close(self._wake_w)
        while not self._cmds.empty():
            cmd = self._cmds.get_nowait()
            exc = PipeClosed("pipe closed before the message was sent")
            self._finish(cmd[1], exc) if cmd[0] == "send" else settle(cmd[2], exc)
        self._reaper.fail_all(PipeClosed("pipe closed before the message was released"))
        self._rq.close()
        if self._ipc_path and os.path.exists(self._ipc_path):
            os.unlink(self._ipc_path)

    def stats(self) -> dict[str, int]:
        return {"inflight_bytes": self._gate.inflight, "peak_inflight_bytes": self._gate.peak,
                "recv_queued_bytes": self._rq.nbytes, **self._n}

    # ------------------------------------------------------------ caller -> I/O thread
    def _wake(self) -> None:
        if not self._sleeping:
            return             # the I/O thread is busy and will look at the queues again
        try:
            os.write(self._wake_w, b"\0")
        except OSError:
            pass               # pipe full (it is awake anyway) or closed

    def _run_in_io(self, fn: Callable[[], Any]) -> Any:
        fut: Future = Future()
        with self._lock:
            if self._closed:
                raise PipeClosed("pipe is closed")
            self._cmds.put(("call", fn, fut))
        self._wake()
        try:
            return fut.result(timeout=self.config.handshake_timeout)
        except FutureTimeout:
            fut.cancel()  # not run late, for nobody
            raise PipeTimeout("the pipe's I/O thread did not answer") from None

    def _finish(self, out: _Out, exc: Optional[BaseException]) -> None:
        self._gate.release(out.charge)
        out.keep = out.payload = None
        settle(out.future, exc)

    # ---------------------------------------------------------------- I/O thread
    def _new_socket(self, kind: int) -> zmq.Socket:
        s = self._ctx.socket(kind)
        s.setsockopt(zmq.SNDHWM, self.config.hwm)
        s.setsockopt(zmq.RCVHWM, self.config.hwm)
        s.setsockopt(zmq.LINGER, int(self.config.linger * 1000))
        s.setsockopt(zmq.SNDTIMEO, int(self.config.send_timeout * 1000))  # bounds any blocking
        self._outq[s] = deque()
        return s

    def _io_loop(self) -> None:
        poller, polled = zmq.Poller(), set()
        poller.register(self._wake_r, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                # Callers write to the wake pipe only while this is set; `full` and the command
                # queue are read after setting it, so no wake-up can be missed.
                self._sleeping = True
                want = set() if self._rq.full else set(self._outq)  # full: stop reading
                want |= set(self._monitors)
                for s in polled - want:
                    poller.unregister(s)
                for s in want - polled:
                    poller.register(s, zmq.POLLIN)
                polled = want
                # Sends refused at HWM are retried on a short timer (ROUTER is always POLLOUT).
                timeout = 0 if not self._cmds.empty() else 1 if any(self._outq.values()) else 100
                events = dict(poller.poll(timeout))
                self._sleeping = False
                if self._wake_r in events:
                    try:
                        while os.read(self._wake_r, 4096):
                            pass
                    except BlockingIOError:
                        pass
                self._drain_cmds()
                for m in [m for m in events if m in self._monitors]:
                    if self._monitors[m] is None:
                        # The ROUTER's: what a producer sent before it left (its FIN saying
                        # the transfer failed) is read while its connection is still known;
                        # each frame is checked against that connection's keys as ever.
                        self._read(self._router)
                    self._on_disconnects(m)  # before any further read: a gone peer is no peer
                for s in events:
                    if s in self._outq:
                        self._read(s)
                for s in list(self._outq):
                    self._flush(s)
        except Exception:
            log.exception("zmq pipe I/O thread crashed")
        finally:
            self._stop.set()
            for s in list(self._watched):
                self._unwatch(s)
            for s, q in self._outq.items():
                for out in q:
                    self._finish(out, PipeClosed("pipe closed before the message was sent"))
                s.close(linger=int(self.config.linger * 1000))
            self._outq.clear()
            for hs in self._pending_hs.values():
                settle(hs, PipeClosed("pipe is closed"))
