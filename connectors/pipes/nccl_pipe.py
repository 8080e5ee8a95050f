"""NCCL pipe (CuPy): headers, the handshake and the NCCL unique id travel over a ZmqPipe; the
bytes of CUDA tensors travel producer -> consumer over a 2-rank NCCL communicator per peer.

- The producer (connect) is rank 0 and puts a fresh unique id in its hello; the consumer
  (listen) accepts it, replies, and joins as rank 1. Init is bounded by handshake_timeout.
- Transfers run on dedicated CUDA streams that first wait for the caller's stream; a transfer is
  reported done only after its stream work has completed (vLLM #20263: garbage output from
  unsynchronised streams). Each wait is bounded (extra["transfer_timeout"], default send_timeout).
- CPU tensors, None payloads and consumer -> producer replies go over ZMQ: NCCL ops on one
  communicator must be issued in the same order on both ranks, so only one direction uses it.
- cupy is imported lazily: this module imports on machines without CUDA or CuPy.
NCCL refuses two ranks on one GPU ("Duplicate GPU detected"): tests need two GPUs.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from connectors.pipes import wire
from connectors.pipes.base import (KVPipe, Message, PipeClosed, PipeConfig, PipeError, PipeTimeout,
                                   register_pipe)
from connectors.pipes.sync import InflightGate, settle
from connectors.pipes.zmq_pipe import ZmqPipe

log = logging.getLogger(__name__)
NEEDS = "nccl pipe needs cupy-cuda12x and a CUDA GPU; install pd-cluster[nccl]"
_UID_KEY = "_nccl_uid"


def _load_nccl() -> Any:
    """The cupy.cuda.nccl module, or a RuntimeError that says what is missing."""
    try:
        from cupy.cuda import nccl
    except Exception as e:  # ImportError, or a CUDA library that fails to load
        raise RuntimeError(f"{NEEDS} (cannot import cupy.cuda.nccl: {e})") from e
    if not torch.cuda.is_available():
        raise RuntimeError(f"{NEEDS} (torch sees no CUDA GPU)")
    return nccl


def _nccl_type(nccl: Any, t: torch.Tensor) -> tuple[int, int]:
    """(NCCL datatype, element count); dtypes NCCL lacks go as raw bytes (send/recv is a copy)."""
    names = {torch.float32: "NCCL_FLOAT32", torch.float16: "NCCL_FLOAT16",
             torch.bfloat16: "NCCL_BFLOAT16", torch.float64: "NCCL_FLOAT64",
             torch.int32: "NCCL_INT32", torch.int64: "NCCL_INT64", torch.int8: "NCCL_INT8"}
    const = getattr(nccl, names.get(t.dtype, ""), None)
    if const is not None:
        return const, t.numel()
    return getattr(nccl, "NCCL_UINT8", None) or nccl.NCCL_CHAR, t.numel() * t.element_size()


@dataclass
class _Comm:
    rank: int
    ready: threading.Event = field(default_factory=threading.Event)
    comm: Any = None
    error: Optional[str] = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def peer_rank(self) -> int:
        return 1 - self.rank


@register_pipe("nccl")
class NcclPipe(KVPipe):
    def __init__(self, config: PipeConfig) -> None:
        super().__init__(config)
        self._nccl = _load_nccl()
        self._device = torch.device("cuda", int(config.extra.get("device",
                                                                  torch.cuda.current_device())))
        self._xfer_timeout = float(config.extra.get("transfer_timeout", config.send_timeout))
        self._send_stream = torch.cuda.Stream(self._device)
        self._recv_stream = torch.cuda.Stream(self._device)
        self._comms: dict[str, _Comm] = {}
        self._gate = InflightGate(config.max_inflight_bytes)
        self._validator: Optional[Callable[[dict], Optional[str]]] = None
        self._recv_lock = threading.Lock()
        self._lock = threading.Lock()            # orders close() against enqueues
        self._closed = False
        self._ctrl = ZmqPipe(config)
        self._ctrl.set_handshake_validator(self._validate)
        self._ctrl._peer_hook = self._on_peer_accepted   # consumer: join the peer's NCCL group
        self._sendq: queue.Queue = queue.Queue()
        self._sender = threading.Thread(target=self._send_loop, name="nccl-pipe-send", daemon=True)
        self._sender.start()

    # ------------------------------------------------------------------ public API
    def listen(self) -> str:
        return self._ctrl.listen()

    def set_handshake_validator(self, fn: Optional[Callable[[dict], Optional[str]]],
                                info: Optional[dict] = None) -> None:
        self._validator = fn
        self._ctrl.set_handshake_validator(self._validate, info)

    def connect(self, peer_addr: str, hello: dict) -> dict:
        uid = self._nccl.get_unique_id()
        reply = self._ctrl.connect(peer_addr, {**hello, _UID_KEY: list(uid)})
        c = _Comm(rank=0)
        self._comms[peer_addr] = c
        self._init_comm(c, tuple(uid))
        if not c.ready.wait(self.config.handshake_timeout):
            raise PipeTimeout(f"NCCL init with {peer_addr} timed out "
                              f"after {self.config.handshake_timeout}s")
        if c.error:
            raise PipeError(f"NCCL init with {peer_addr} failed: {c.error}")
        return reply

    def send_tensor(self, peer: str, header: dict, tensor: Optional[torch.Tensor]) -> Future:
        c = self._comms.get(peer)
        if tensor is None or not tensor.is_cuda or c is None or c.rank != 0:
            return self._ctrl.send_tensor(peer, {"h": header, "n": None}, tensor)
        t = tensor.detach().contiguous()
        meta = wire.tensor_meta(t)
        wire.pack("d", header)                       # a non-msgpack header fails here
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(t.device))   # the transfer waits for the producer
        fut: Future = Future()
        self._gate.acquire(t.nbytes, self.config.send_timeout)
        with self._lock:
            if self._closed:
                self._gate.release(t.nbytes)
                raise PipeClosed("pipe is closed")
            self._sendq.put((peer, header, t, meta, ready, fut))
        return fut

    def recv_tensor(self, timeout: float) -> Optional[Message]:
        deadline = time.monotonic() + timeout
        with self._recv_lock:   # NCCL recvs must be issued in header order
            while True:
                m = self._ctrl.recv_tensor(max(0.0, deadline - time.monotonic()))
                if m is None:
                    return None
                peer, wrapped, tensor = m
                header, meta = wrapped.get("h"), wrapped.get("n")
                if not isinstance(header, dict):
                    log.warning("nccl pipe: dropped a message from %r without a header", peer)
                    continue
                if meta is None:
                    return peer, header, tensor
                try:
                    return peer, header, self._recv_payload(peer, meta)
                except wire.Malformed as e:   # nothing was posted to NCCL for it
                    log.warning("nccl pipe: dropped a message from %r: %s", peer, e)

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
                self._gate.release(item[2].nbytes)
                settle(item[5], PipeClosed("pipe closed before the transfer"))
        self._ctrl.close()
        for c in self._comms.values():
            if c.comm is not None:
                (c.comm.abort if c.error else c.comm.destroy)()
        self._comms.clear()

    def stats(self) -> dict[str, int]:
        return {**self._ctrl.stats(), "nccl_inflight_bytes": self._gate.inflight}

    # ---------------------------------------------------------------- internals
    def _validate(self, hello: dict) -> Optional[str]:
        uid = hello.get(_UID_KEY)
        if not (isinstance(uid, list) and uid and all(type(b) is int for b in uid)):
            return "peer is not an nccl pipe (its hello has no NCCL unique id)"
        user = {k: v for k, v in hello.items() if k != _UID_KEY}
        return self._validator(user) if self._validator is not None else None

    def _on_peer_accepted(self, peer: str, hello: dict) -> None:
        # Runs in the zmq I/O thread before the ack goes out: init must not block it (the
        # producer joins only after the ack), so rank 1 initialises in its own thread.
        c = _Comm(rank=1)
        self._comms[peer] = c
        self._init_comm(c, tuple(hello[_UID_KEY]))

    def _init_comm(self, c: _Comm, uid: tuple) -> None:
        def run() -> None:
            try:
                with torch.cuda.device(self._device):
                    c.comm = self._nccl.NcclCommunicator(2, uid, c.rank)
            except Exception as e:
                c.error = f"{type(e).__name__}: {e}"
                log.error("nccl pipe: communicator init (rank %d) failed: %s", c.rank, c.error)
            c.ready.set()

        threading.Thread(target=run, name=f"nccl-init-r{c.rank}", daemon=True).start()

    def _wait_stream(self, stream: torch.cuda.Stream, c: _Comm, what: str) -> None:
        """Bounded synchronisation: poll an event; on timeout abort the communicator."""
        done = torch.cuda.Event()
        done.record(stream)
        deadline = time.monotonic() + self._xfer_timeout
        while not done.query():
            if time.monotonic() > deadline:
                c.error = f"{what} timed out after {self._xfer_timeout}s"
                c.comm.abort()
                raise PipeTimeout(f"nccl pipe: {c.error}")
            time.sleep(0.0002)

    def _send_loop(self) -> None:
        torch.cuda.set_device(self._device)
        while True:
            item = self._sendq.get()
            if item is None:
                return
            peer, header, t, meta, ready, fut = item
            try:
                if self._closed:
                    raise PipeClosed("pipe closed before the transfer")
                c = self._comms[peer]
                if c.error or c.comm is None:
                    raise PipeError(f"no usable NCCL communicator for {peer!r}: {c.error}")
                # Header first: the consumer posts its recv when the header arrives.
                self._ctrl.send_tensor(peer, {"h": header, "n": meta}, None)
                if t.numel():
                    self._send_stream.wait_event(ready)
                    dtype, count = _nccl_type(self._nccl, t)
                    with c.lock:
                        c.comm.send(t.data_ptr(), count, dtype, c.peer_rank,
                                    self._send_stream.cuda_stream)
                    self._wait_stream(self._send_stream, c, f"send to {peer!r}")
                settle(fut)
            except Exception as e:
                settle(fut, e if isinstance(e, PipeError) else PipeError(str(e)))
            finally:
                self._gate.release(t.nbytes)

    def _recv_payload(self, peer: str, meta: Any) -> torch.Tensor:
        dtype, shape, _ = wire.parse_meta(meta)
        c = self._comms.get(peer)
        if c is None or not c.ready.wait(self.config.handshake_timeout) or c.error:
            raise PipeError(f"no usable NCCL communicator for {peer!r}")
        with torch.cuda.device(self._device):
            out = torch.empty(shape, dtype=dtype, device=self._device)
            if out.numel():
                # `out` may reuse memory the caller's stream still works on: wait for it first.
                self._recv_stream.wait_stream(torch.cuda.current_stream(self._device))
                nd, count = _nccl_type(self._nccl, out)
                with c.lock:
                    c.comm.recv(out.data_ptr(), count, nd, c.peer_rank,
                                self._recv_stream.cuda_stream)
                self._wait_stream(self._recv_stream, c, f"recv from {peer!r}")
        return out
