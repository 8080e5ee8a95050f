"""The collective pipe: headers, the handshake and the group id travel over a ZmqPipe; tensor
bytes travel producer -> consumer over a 2-rank communicator per peer (communicators.py: NCCL
between GPUs, Gloo between CPUs, same protocol).

- The producer (connect) is rank 0 and puts a fresh group id in its hello; the consumer
  (listen) accepts it, replies, and joins as rank 1. Joining is bounded by handshake_timeout
  and runs off the I/O thread, at handshake time: never inside save_kv_layer.
- A transfer is reported done only after the communicator completed it; each wait is bounded
  (extra["transfer_timeout"], default send_timeout). A timeout aborts that peer's communicator;
  the connector then drops the peer and re-links it, which creates a fresh one.
- Tensors the backend does not handle, None payloads and consumer -> producer replies go over
  ZMQ: the ops on one communicator must be posted in the same order on both ranks, so only one
  direction uses it.
- Integrity (integrity.py): every ZMQ message is tagged by the control pipe; a collective
  payload's code (SHA-256 for mac, CRC-32 for crc32; payload_digest.py, off the forward path)
  travels in its header, so the MAC over the header covers the payload. A payload whose code
  does not hold is dropped and counted (its transfer then fails closed at the FIN).
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from connectors.pipes import wire
from connectors.pipes.base import KVPipe, Message, PipeClosed, PipeConfig, PipeError, PipeTimeout
from connectors.pipes.communicators import CommBackend, Communicator
from connectors.pipes.payload_digest import payload_digest
from connectors.pipes.sync import InflightGate
from pd_cluster.futures import settle
from connectors.pipes.zmq_pipe import ZmqPipe

log = logging.getLogger(__name__)
_GROUP_KEY = "_group_id"
_GEN_KEY = "_group_gen"


@dataclass
class _Peer:
    rank: int
    gen: str  # this channel's generation: headers of an older channel are dropped unposted
    ready: threading.Event = field(default_factory=threading.Event)
    comm: Optional[Communicator] = None
    error: Optional[str] = None

    def usable(self) -> bool:
        return self.comm is not None and self.error is None


class CollectivePipe(KVPipe):
    def __init__(self, config: PipeConfig, backend: CommBackend) -> None:
        super().__init__(config)
        self.backend = backend
        self._host = config.bind_host()
        self._xfer_timeout = float(config.extra.get("transfer_timeout", config.send_timeout))
        self._peers: dict[str, _Peer] = {}
        self._gate = InflightGate(config.max_inflight_bytes)
        self._validator: Optional[Callable[[dict], Optional[str]]] = None
        self.integrity_failures = 0
        self._recv_lock = threading.Lock()
        self._lock = threading.Lock()            # orders close() against enqueues
        self._closed = False
        self._ctrl = ZmqPipe(config)
        self._ctrl.set_handshake_validator(self._validate)
        self._ctrl._peer_hook = self._on_peer_accepted   # consumer: join the peer's group
        self._sendq: queue.Queue = queue.Queue()
        self._sender = threading.Thread(target=self._send_loop,
                                        name=f"{backend.name}-pipe-send", daemon=True)
        self._sender.start()

    # ------------------------------------------------------------------ public API
    def listen(self) -> str:
        return self._ctrl.listen()

    def set_handshake_validator(self, fn: Optional[Callable[[dict], Optional[str]]],
                                info: Optional[dict] = None) -> None:
        self._validator = fn
        self._ctrl.set_handshake_validator(self._validate, info)

    def connect(self, peer_addr: str, hello: dict) -> dict:
        group_id, handle = self.backend.new_group(self._host)
        gen = os.urandom(8).hex()
        reply = self._ctrl.connect(peer_addr, {**hello, _GROUP_KEY: group_id, _GEN_KEY: gen})
        p = _Peer(rank=0, gen=gen)
        self._replace(peer_addr, p)
        self._join(p, group_id, handle)
        if not p.ready.wait(self.config.handshake_timeout):
            raise PipeTimeout(f"{self.backend.name} init with {peer_addr} timed out "
                              f"after {self.config.handshake_timeout}s")
        if p.error:
            raise PipeError(f"{self.backend.name} init with {peer_addr} failed: {p.error}")
        return reply

    def carries(self, device: torch.device) -> bool:
        return device.type in ("cpu", self.backend.device_type)

    def disconnect(self, peer_addr: str) -> None:
        self._replace(peer_addr, None)
        self._ctrl.disconnect(peer_addr)

    def send_tensor(self, peer: str, header: dict, tensor: Optional[torch.Tensor]) -> Future:
        p = self._peers.get(peer)
        if p is None or p.rank != 0:  # a consumer's replies, or an unknown peer: ZMQ only
            return self._ctrl.send_tensor(peer, {"h": header, "n": None}, tensor)
        wire.pack("d", header)                       # a non-msgpack header fails here
        t, ready = None, None
        if tensor is not None and self.backend.handles(tensor):
            t = tensor.detach().contiguous()
            ready = self.backend.ready_marker(t)     # the transfer waits for the producer
        nbytes = t.nbytes if t is not None else 0
        fut: Future = Future()
        self._gate.acquire(nbytes, self.config.send_timeout)
        with self._lock:
            if self._closed:
                self._gate.release(nbytes)
                raise PipeClosed("pipe is closed")
            # Everything to a peer goes through one queue: a FIN never overtakes its layers.
            self._sendq.put((peer, header, t if t is not None else tensor, t is not None,
                             ready, fut))
        return fut

    def recv_tensor(self, timeout: float) -> Optional[Message]:
        deadline = time.monotonic() + timeout
        with self._recv_lock:   # receives must be posted in header order
            while True:
                m = self._ctrl.recv_tensor(max(0.0, deadline - time.monotonic()))
                if m is None:
                    return None
                peer, wrapped, tensor = m
                header, meta = wrapped.get("h"), wrapped.get("n")
                if not isinstance(header, dict):
                    log.warning("%s pipe: dropped a message from %r without a header",
                                self.backend.name, peer)
                    continue
                if meta is None:
                    return peer, header, tensor
                current = self._peers.get(peer)
                if current is None or wrapped.get("g") != current.gen:
                    # Sent on a channel that was re-created since (after a timeout): its
                    # bytes will never come on the new one, so nothing is posted for it.
                    log.warning("%s pipe: dropped a header from %r of an old channel",
                                self.backend.name, peer)
                    continue
                try:
                    payload = self._recv_payload(peer, meta)
                    if payload_digest(self.config.integrity, payload, None,
                                      self._xfer_timeout) == wrapped.get("m"):
                        return peer, header, payload
                    self.integrity_failures += 1
                    self._ctrl._limited.warn(
                        "integrity failures", "%s pipe: dropped a payload from %r: its %s "
                        "does not hold", self.backend.name, peer[:120], self.config.integrity)
                except wire.Malformed as e:   # nothing was posted for it
                    log.warning("%s pipe: dropped a message from %r: %s",
                                self.backend.name, peer, e)
                except PipeError as e:  # the channel broke: forget it (the producer re-links)
                    log.warning("%s pipe: lost a payload from %r: %s", self.backend.name,
                                peer, e)
                    if self._peers.get(peer) is current:
                        self._replace(peer, None)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._gate.close()
        self._sendq.put(None)
        self._sender.join(self._xfer_timeout + 5)
        while not self._sendq.empty():
            item = self._sendq.get_nowait()
            if item is not None:
                self._gate.release(item[2].nbytes if item[3] else 0)
                settle(item[5], PipeClosed("pipe closed before the transfer"))
        self._ctrl.close()
        for addr in list(self._peers):
            self._replace(addr, None)

    def stats(self) -> dict[str, int]:
        ctrl = self._ctrl.stats()
        return {**ctrl, f"{self.backend.name}_inflight_bytes": self._gate.inflight,
                "integrity_failures": ctrl["integrity_failures"] + self.integrity_failures}

    # ---------------------------------------------------------------- internals
    def _validate(self, hello: dict) -> Optional[str]:
        if _GROUP_KEY not in hello or not isinstance(hello.get(_GEN_KEY), str):
            return f"peer is not a {self.backend.name} pipe (its hello has no group id)"
        user = {k: v for k, v in hello.items() if k not in (_GROUP_KEY, _GEN_KEY)}
        return self._validator(user) if self._validator is not None else None

    def _on_peer_accepted(self, peer: str, hello: dict) -> None:
        # Runs in the zmq I/O thread before the ack goes out: joining must not block it (the
        # producer joins only after the ack), so rank 1 joins in its own thread.
        p = _Peer(rank=1, gen=hello[_GEN_KEY])
        self._replace(peer, p)
        self._join(p, hello[_GROUP_KEY], None)

    def _replace(self, addr: str, new: Optional[_Peer]) -> None:
        """A peer's communicator is never reused after a reconnect: the old one is closed."""
        old = self._peers.pop(addr, None)
        if new is not None:
            self._peers[addr] = new
        if old is not None and old.comm is not None:
            try:
                old.comm.close(abort=True)
            except Exception as e:  # noqa: BLE001 - it is gone either way
                log.debug("%s pipe: closing the old channel to %s: %s", self.backend.name,
                          addr, e)

    def _join(self, p: _Peer, group_id: Any, handle: Any) -> None:
        def run() -> None:
            try:
                p.comm = self.backend.join(group_id, p.rank, self._host, handle,
                                           self.config.handshake_timeout)
            except Exception as e:  # noqa: BLE001 - reported through p.error
                p.error = f"{type(e).__name__}: {e}"
                log.error("%s pipe: group init (rank %d) failed: %s", self.backend.name,
                          p.rank, p.error)
            p.ready.set()

        threading.Thread(target=run, name=f"{self.backend.name}-init-r{p.rank}",
                         daemon=True).start()

    def _channel(self, peer: str) -> tuple[_Peer, Communicator]:
        p = self._peers.get(peer)
        if (p is None or not p.ready.wait(self.config.handshake_timeout) or not p.usable()
                or p.comm is None):
            raise PipeError(f"no usable {self.backend.name} communicator for {peer!r}"
                            + (f": {p.error}" if p is not None and p.error else ""))
        return p, p.comm

    def _send_loop(self) -> None:
        self.backend.on_sender_thread()
        while True:
            item = self._sendq.get()
            if item is None:
                return
            peer, header, t, collective, ready, fut = item
            try:
                if self._closed:
                    raise PipeClosed("pipe closed before the transfer")
                if not collective:
                    self._ctrl.send_tensor(peer, {"h": header, "n": None}, t).result(
                        self.config.send_timeout + self._xfer_timeout)
                    settle(fut)
                    continue
                p, comm = self._channel(peer)
                code = payload_digest(self.config.integrity, t, ready, self._xfer_timeout)
                # Header first: the consumer posts its receive when the header arrives.
                self._ctrl.send_tensor(peer, {"h": header, "n": wire.tensor_meta(t),
                                              "g": p.gen, "m": code}, None)
                if t.numel():
                    self._transfer(p, comm, lambda: comm.send(t, ready), f"send to {peer!r}")
                settle(fut)
            except Exception as e:
                settle(fut, e if isinstance(e, PipeError) else PipeError(str(e)))
            finally:
                self._gate.release(t.nbytes if collective else 0)

    def _recv_payload(self, peer: str, meta: Any) -> torch.Tensor:
        dtype, shape, _ = wire.parse_meta(meta)
        p, comm = self._channel(peer)
        out = self.backend.empty(shape, dtype)
        if out.numel():
            self._transfer(p, comm, lambda: comm.recv(out), f"recv from {peer!r}")
        return out

    def _transfer(self, p: _Peer, comm: Communicator, post: Callable[[], None],
                  what: str) -> None:
        try:
            post()
            comm.wait(self._xfer_timeout, what)
        except Exception as e:  # noqa: BLE001 - any failure leaves the channel unusable
            p.error = str(e)  # aborted: unusable until the peer re-links (a fresh channel)
            comm.close(abort=True)
            raise e if isinstance(e, PipeError) else PipeError(f"{what} failed: {e}") from None
