"""The KV pipe under injected faults (``engine.faults.kv_send`` / ``kv_recv``, test-only;
pd_cluster/faults.py says what each kind means): a wrapper around the real pipe, installed
by ``with_faults`` only when a KV site has a rate, so a pipe without faults runs unwrapped.

Drops, delays and failures happen here, where a message or a write is handed to the pipe or
taken from it. A corruption must happen where the bytes and their integrity code part ways:
each connection's integrity channel (integrity.Channel) is wrapped (FaultyChannel), whose
seal computes the code over the bytes with one bit flipped (the wire carries the others, as
if the bit flipped in flight after the code was computed) and whose check sees one bit of
what arrived flipped; a write in place is checked over its blocks (check_written), where one
bit of them flips. The receiver's check must refuse each: nothing corrupted is decoded on.
"""
from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Any, Callable, Optional

from connectors.pipes import wire
from connectors.pipes.base import KVPipe, Message, PipeError
from pd_cluster.fault_sites import FaultSite, fault_site, flip_bit
from pd_cluster.faults import FaultsConfig

_LOST = ("fail", "drop", "delay")  # the kinds handled here, in the order they are rolled
_WRITTEN = "kvw"  # a write's notification: its blocks are corrupted where they are checked


def with_faults(pipe: KVPipe, faults: Optional[FaultsConfig]) -> KVPipe:
    """``pipe`` itself when no KV site has a rate, else ``pipe`` under faults."""
    counters: dict[str, Any] = {}
    send = fault_site(faults, "kv_send", counters)
    recv = fault_site(faults, "kv_recv", counters)
    if send is None and recv is None:
        return pipe
    try:
        return FaultyPipe(pipe, send, recv, counters)
    except ValueError:
        pipe.close()  # its threads and sockets: nobody else holds it
        raise


class FaultyPipe(KVPipe):
    """Every KVPipe call goes to the wrapped pipe, as do its optional capabilities
    (writes_in_place, link, staging...: ``__getattr__``)."""

    def __init__(self, inner: KVPipe, send: Optional[FaultSite], recv: Optional[FaultSite],
                 counters: dict[str, Any]) -> None:
        super().__init__(inner.config)
        self.inner, self._send, self._recv = inner, send, recv
        self.fault_counters = counters  # the connector's stats show them
        corrupt = [s.name for s in (send, recv) if s is not None and s.has("corrupt")]
        if corrupt:
            if not hasattr(inner, "wrap_channel"):
                raise ValueError(f"faults.{corrupt[0]}.corrupt: the {type(inner).__name__} has "
                                 f"no integrity channel to corrupt under (use zmq, shm or auto)")
            inner.wrap_channel = self._wrap_channel
        if hasattr(inner, "write_blocks"):
            self.write_blocks = self._write_blocks
        if hasattr(inner, "check_written") and recv is not None and recv.has("corrupt"):
            if getattr(inner.check_written, "on_device", False):
                raise ValueError("faults.kv_recv.corrupt: the cuda_ipc pipe checks its writes "
                                 "on the device (flipping a bit there is not supported)")
            self.check_written = self._check_written

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    # ---- sending ---------------------------------------------------------------------------
    def send_tensor(self, peer: str, header: dict, tensor: Any) -> Future:
        return self._sent(lambda: self.inner.send_tensor(peer, header, tensor))

    def _write_blocks(self, *args: Any, **kwargs: Any) -> Future:
        return self._sent(lambda: self.inner.write_blocks(*args, **kwargs))

    def _sent(self, send: Callable[[], Future]) -> Future:
        kind = self._send.pick(_LOST) if self._send is not None else None
        if kind is None:
            return send()
        if kind == "delay":
            self._send.wait()
            return send()
        lost: Future = Future()
        if kind == "fail":
            lost.set_exception(PipeError("send failed (injected fault)"))
        else:
            lost.set_result(None)  # dropped: the sender believes it went
        return lost

    # ---- receiving -------------------------------------------------------------------------
    def recv_tensor(self, timeout: float) -> Optional[Message]:
        deadline = time.monotonic() + timeout
        while True:
            msg = self.inner.recv_tensor(max(0.0, deadline - time.monotonic()))
            kind = self._recv.pick(_LOST) if msg is not None and self._recv is not None else None
            if kind is None:
                return msg
            if kind == "fail":
                raise PipeError("receive failed (injected fault): its message is lost")
            if kind == "delay":
                self._recv.wait()
                return msg
            # dropped: wait for the next one

    def _check_written(self, peer: str, head: bytes, chunks: Any, tag: bytes,
                       nonce: bytes) -> Optional[str]:
        if self._recv is not None and self._recv.pick(("corrupt",)):
            chunks = list(chunks)
            chunks[0] = flip_bit(chunks[0])
        return self.inner.check_written(peer, head, chunks, tag, nonce)

    def _wrap_channel(self, channel: Any) -> "FaultyChannel":
        return FaultyChannel(channel, self._send, self._recv)

    # ---- the rest is the wrapped pipe's ----------------------------------------------------
    def listen(self) -> str:
        return self.inner.listen()

    def connect(self, peer_addr: str, hello: dict) -> dict:
        return self.inner.connect(peer_addr, hello)

    def disconnect(self, peer_addr: str) -> None:
        self.inner.disconnect(peer_addr)

    def carries(self, device: Any) -> bool:
        return self.inner.carries(device)

    def set_handshake_validator(self, fn: Any, info: Optional[dict] = None) -> None:
        self.inner.set_handshake_validator(fn, info)

    def stats(self) -> dict[str, int]:
        return self.inner.stats()

    def close(self) -> None:
        self.inner.close()


class FaultyChannel:
    """A connection's integrity channel with one bit flipped in a share of what it seals
    (kv_send's corrupt) and of what it checks (kv_recv's); ``mode``, ``side_keys``: the
    channel's."""

    def __init__(self, inner: Any, send: Optional[FaultSite], recv: Optional[FaultSite]):
        self._inner = inner
        self._send = send if send is not None and send.has("corrupt") else None
        self._recv = recv if recv is not None and recv.has("corrupt") else None

    def __getattr__(self, name: str) -> Any:
        if name == "_inner":
            raise AttributeError(name)
        return getattr(self._inner, name)

    def seal(self, head: bytes, payload: Any) -> Optional[bytes]:
        if self._send is not None and self._send.pick(("corrupt",)):
            head, payload = _flipped(head, payload)
        return self._inner.seal(head, payload)

    def check(self, head: bytes, payload: Any, tag: Any) -> Optional[str]:
        # A write's notification: its blocks are what kv_recv corrupts (check_written).
        if self._recv is not None and _kind(head) != _WRITTEN and self._recv.pick(("corrupt",)):
            head, payload = _flipped(head, payload)
        return self._inner.check(head, payload, tag)


def _flipped(head: bytes, payload: Any) -> tuple[bytes, list]:
    """(head, payload) with one bit flipped: in the first payload chunk that has bytes, else
    in the header."""
    chunks = list(payload)
    for i, chunk in enumerate(chunks):
        if memoryview(chunk).nbytes:
            chunks[i] = flip_bit(chunk)
            return head, chunks
    return flip_bit(head), chunks


def _kind(head: bytes) -> Any:
    """The connector header's kind in a message's envelope (None if it has none)."""
    try:
        return wire.unpack(head)[1].get("kind")
    except (wire.Malformed, AttributeError):
        return None
