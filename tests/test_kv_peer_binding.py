"""Frames are bound to the authenticated connection (connectors/pipes/zmq_conns.py): a ROUTER
identity is forgotten when its socket disconnects, the table is bounded, and a process that
re-uses a seen identity cannot inject -- refused by the binding, and, in the window before the
disconnect is seen, by the per-connection MAC. The collective pipes' payloads carry a code in
their MAC'd header, taken on the pipe's sending thread (payload_digest.py)."""
from __future__ import annotations

import threading

import pytest
import torch
import zmq

from connectors.pipes import PipeConfig, PipeError, create_pipe, wire
from connectors.pipes import collective
from connectors.pipes.integrity import TAG_BYTES
from connectors.pipes.payload_digest import payload_digest
from connectors.pipes.zmq_conns import Conn, Connections
from pd_cluster.serving.cluster.testing import wait_until

HELLO = {"model_id": "m"}


def _forged_frames() -> list[bytes]:
    t = torch.full((16,), 7.0)
    return [wire.pack("d", {"kind": "kv", "request_id": "r", "layer": 0, "first_block": 0},
                      wire.tensor_meta(t)), t.numpy().tobytes(), b"\0" * TAG_BYTES["mac"]]


def _raw_dealer(ctx: zmq.Context, ident: bytes, addr: str) -> zmq.Socket:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.ROUTING_ID, ident)
    s.connect(addr)
    return s


def _connected(cons, prod, addr: str) -> bytes:
    """Connect ``prod``, prove the link with one message; its ROUTER identity."""
    prod.connect(addr, HELLO)
    prod.send_tensor(addr, {"genuine": 1}, torch.ones(4)).result(timeout=5)
    peer, header, _ = cons.recv_tensor(timeout=5)
    assert header == {"genuine": 1}
    return peer.encode()


def test_a_reused_identity_after_the_producer_left_is_refused() -> None:
    cons, prod = create_pipe("zmq", PipeConfig()), create_pipe("zmq", PipeConfig())
    ctx = zmq.Context()
    try:
        addr = cons.listen()
        ident = _connected(cons, prod, addr)
        prod.disconnect(addr)
        wait_until(lambda: cons._run_in_io(lambda: len(cons._conns)) == 0, 10,
                   "the connection forgotten on disconnect")
        raw = _raw_dealer(ctx, ident, addr)  # the identity, seen on the wire, re-used
        raw.send_multipart(_forged_frames())
        wait_until(lambda: cons.stats()["refused"] >= 1, 10, "the forged frame refused")
        assert cons.recv_tensor(timeout=0.2) is None and cons.stats()["received"] == 1
    finally:
        prod.close(), cons.close()
        ctx.destroy(linger=0)


def test_without_the_binding_the_connection_key_still_stops_a_reused_identity(
        monkeypatch) -> None:
    """The window before the disconnect event is read (or a descriptor number re-used):
    the binding is switched off here, and the frame still fails its MAC."""
    gone: list[int] = []
    monkeypatch.setattr(Connections, "drop_fd", lambda self, fd: gone.append(fd) or [])
    monkeypatch.setattr(Connections, "on_this_connection",
                        lambda self, ident, frame: self.get(ident))
    cons, prod = create_pipe("zmq", PipeConfig()), create_pipe("zmq", PipeConfig())
    ctx = zmq.Context()
    try:
        addr = cons.listen()
        ident = _connected(cons, prod, addr)
        prod.disconnect(addr)
        # ZMQ itself refuses an identity while its socket is still there
        wait_until(lambda: gone, 10, "the producer's socket gone (its entry kept)")
        raw = _raw_dealer(ctx, ident, addr)
        raw.send_multipart(_forged_frames())
        wait_until(lambda: cons.stats()["received"] == 2, 10, "the forged frame taken in")
        assert cons.recv_tensor(timeout=0.5) is None  # dropped by the MAC check...
        assert cons.stats()["integrity_failures"] == 1  # ...and counted
    finally:
        prod.close(), cons.close()
        ctx.destroy(linger=0)


def test_a_producer_whose_connection_was_lost_fails_its_sends_and_can_relink() -> None:
    """ZMQ would reconnect under the same identity, which the consumer no longer takes: the
    producer ends the link instead, so its sends fail (the connector re-links) rather than
    vanish."""
    cons, prod = create_pipe("zmq", PipeConfig()), create_pipe("zmq", PipeConfig())
    try:
        addr = cons.listen()
        _connected(cons, prod, addr)
        cons.close()  # the consumer's end of the connection goes away

        def fails() -> bool:
            try:
                prod.send_tensor(addr, {"after": 1}, torch.ones(4)).result(timeout=5)
            except PipeError:
                return True
            return False
        wait_until(fails, 10, "sends to the lost consumer failing")
    finally:
        prod.close(), cons.close()


def test_the_connection_table_is_bounded_and_drops_by_socket() -> None:
    from connectors.pipes.integrity import Channel
    conns = Connections(limit=2)
    for i, fd in enumerate((10, 11, 11)):
        conns.add(b"p%d" % i, Conn({}, Channel("none"), fd))
    assert len(conns) == 2 and conns.get(b"p0") is None and conns.dropped == 1
    assert len(conns.drop_fd(11)) == 2 and len(conns) == 0


def test_gloo_payload_codes_are_taken_on_the_send_thread_and_checked(monkeypatch) -> None:
    taken_on: list[str] = []

    def digest(mode, t, ready=None, timeout=30.0):
        taken_on.append(threading.current_thread().name)
        return payload_digest(mode, t, ready, timeout)
    monkeypatch.setattr(collective, "payload_digest", digest)
    cfg = PipeConfig(handshake_timeout=10.0, send_timeout=5.0)
    cons, prod = create_pipe("gloo", cfg), create_pipe("gloo", cfg)
    try:
        addr = cons.listen()
        prod.connect(addr, HELLO)
        t = torch.arange(1000.0)
        sent = prod.send_tensor(addr, {"n": 1}, t)  # done once the consumer received it
        peer, header, got = cons.recv_tensor(timeout=10)
        sent.result(timeout=10)
        assert header == {"n": 1} and torch.equal(got, t)
        assert taken_on[0] == "gloo-pipe-send"  # the producer's: never the caller's thread
        # a payload altered in the collective transfer is dropped and counted
        real = cons._recv_payload
        monkeypatch.setattr(cons, "_recv_payload", lambda p, m: real(p, m).add_(1))
        sent = prod.send_tensor(addr, {"n": 2}, t)
        assert cons.recv_tensor(timeout=2) is None and cons.stats()["integrity_failures"] == 1
        sent.result(timeout=10)
    finally:
        prod.close(), cons.close()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_device_payloads_code_is_its_host_bytes_code() -> None:
    """CUDA only (scripts/gpu_check.sh, "kv integrity cuda"): the pinned copy on its own
    stream after the ready event reads what the forward's stream wrote."""
    for mode in ("mac", "crc32"):
        t = torch.randn(4, 64, 16, device="cuda")
        ready = torch.cuda.Event()
        t.mul_(3)  # queued work the copy must wait for
        ready.record()
        assert payload_digest(mode, t, ready) == payload_digest(mode, t.cpu())
