"""The KV plane admits only the cluster's own engines (connectors/pipes/auth.py): a producer
and a consumer each prove the cluster secret over nonces from both sides; a forged producer
(the project's own pipe and the right model hello, but no secret, or another secret) is
refused with one fixed answer, counted, and nothing it sends is received."""
from __future__ import annotations

import secrets

import pytest
import torch

from connectors.pipes import PipeConfig, create_pipe
from connectors.pipes.auth import REFUSED
from connectors.pipes.base import HandshakeError, PipeTimeout
from connectors.secret import ENV
from pd_cluster.serving.cluster.testing import wait_until

HELLO = {"model_id": "m", "dtype": "float32"}


def _validator(hello: dict) -> str | None:
    return None if hello == HELLO else f"model_id (the prefill engine has {hello!r:.40})"


def _pipes(security: str = "token", **kw):
    cfg = PipeConfig(security=security, handshake_timeout=3.0, **kw)
    cons, prod = create_pipe("zmq", cfg), create_pipe("zmq", cfg)
    cons.set_handshake_validator(_validator)
    return cons, prod, cons.listen()


def _other_secret_pipe(monkeypatch: pytest.MonkeyPatch, security: str = "token"):
    """A pipe made in a process holding another cluster's secret."""
    own = __import__("os").environ[ENV]
    monkeypatch.setenv(ENV, secrets.token_hex(32))
    try:
        return create_pipe("zmq", PipeConfig(security=security, handshake_timeout=3.0))
    finally:
        monkeypatch.setenv(ENV, own)


@pytest.mark.parametrize("security", ["token", "curve"])
def test_peers_with_the_secret_connect_and_transfer(security: str) -> None:
    cons, prod, addr = _pipes(security)
    try:
        prod.connect(addr, HELLO)
        prod.send_tensor(addr, {"x": 1}, torch.arange(8.0)).result(timeout=5)
        peer, header, t = cons.recv_tensor(timeout=5)
        assert header == {"x": 1} and torch.equal(t, torch.arange(8.0))
        assert cons.stats()["auth_failures"] == 0
    finally:
        prod.close()
        cons.close()


def test_forged_and_wrong_secret_producers_are_refused(monkeypatch) -> None:
    cons, prod, addr = _pipes()
    forged = create_pipe("zmq", PipeConfig(security="none", handshake_timeout=3.0))
    wrong = _other_secret_pipe(monkeypatch)
    try:
        prod.connect(addr, HELLO)  # the genuine producer, before and after the attempts
        with pytest.raises(HandshakeError) as no_secret:
            forged.connect(addr, HELLO)  # the right model hello, no proof
        assert str(no_secret.value).endswith(REFUSED)  # nothing about the consumer's values
        with pytest.raises(HandshakeError, match="did not prove the cluster secret"):
            wrong.connect(addr, HELLO)  # the consumer's proof fails at the producer first
        assert cons.stats()["auth_failures"] == 1
        # a forged producer's data is refused, counted, never received
        forged._run_in_io(lambda: forged._open_dealer(addr, b"forger", __import__(
            "concurrent.futures").futures.Future(), _data_message(addr)))
        prod.send_tensor(addr, {"genuine": True}, torch.ones(4)).result(timeout=5)
        got = cons.recv_tensor(timeout=5)
        assert got is not None and got[1] == {"genuine": True}
        wait_until(lambda: cons.stats()["refused"] >= 1, 10, "the forged data refused")
        assert cons.recv_tensor(timeout=0.1) is None and cons.stats()["received"] == 1
    finally:
        for p in (forged, wrong, prod, cons):
            p.close()


def _data_message(addr: str):
    from connectors.pipes import wire
    from connectors.pipes.zmq_peers import Outgoing
    t = torch.zeros(16)
    return Outgoing(addr, wire.pack("d", {"kind": "kv"}, wire.tensor_meta(t)),
                    [t.numpy().tobytes()], None)


def test_a_consumer_without_the_secret_is_not_trusted(monkeypatch) -> None:
    impostor = _other_secret_pipe(monkeypatch)
    impostor.set_handshake_validator(lambda h: None)
    prod = create_pipe("zmq", PipeConfig(handshake_timeout=3.0))
    try:
        with pytest.raises(HandshakeError, match="did not prove the cluster secret"):
            prod.connect(impostor.listen(), HELLO)  # our hello never left
        assert impostor.recv_tensor(timeout=0.2) is None
    finally:
        prod.close()
        impostor.close()


def test_curve_refuses_a_plain_producer() -> None:
    cons, genuine, addr = _pipes("curve")
    plain = create_pipe("zmq", PipeConfig(security="token", handshake_timeout=1.0))
    try:
        with pytest.raises(PipeTimeout):  # CURVE's own handshake never completes
            plain.connect(addr, HELLO)
    finally:
        for p in (plain, genuine, cons):
            p.close()


def test_a_layout_mismatch_names_only_the_producers_values() -> None:
    cons, prod, addr = _pipes()
    try:
        with pytest.raises(HandshakeError) as e:
            prod.connect(addr, {**HELLO, "model_id": "other"})
        assert "other" in str(e.value) and "'m'" not in str(e.value)
    finally:
        prod.close()
        cons.close()


def _layer(rid: str, first_block: int, tensor: torch.Tensor):
    """A layer message's header as a producer sends it."""
    from connectors.metadata import KVLayerHeader
    return KVLayerHeader(rid, 0, first_block)


def test_per_peer_bounds_refuse_without_affecting_other_requests() -> None:
    from connectors.kv_receiver import KVReceiver
    from connectors.metadata import RecvSpec
    kv = torch.zeros(2, 1, 4, 1, 8)  # one block: 256 bytes
    rx = KVReceiver(1, 4, timeout=0.2, max_staging_bytes=1024)
    rx.kv_caches = [torch.zeros(2, 8, 4, 1, 8)]
    # One peer stages KV for requests not registered here: at most half the area is its.
    assert [rx.on_message(_layer(f"u{i}", 0, kv), kv, "greedy") for i in range(4)] == [[]] * 4
    assert rx.num_refused == 2
    # Another peer's early arrival still finds room, and is used once its request comes.
    assert rx.on_message(_layer("r", 0, kv), kv, "fair") == []
    assert rx.register(RecvSpec("r", (3,), 4)) == [] and torch.equal(rx.kv_caches[0][:, 3],
                                                                       kv[:, 0])
    # Blocks the request does not own fail it closed: recomputed, the producer told at once.
    assert rx.on_message(_layer("r", 5, kv), kv, "fair") == [("fair", "r", False)]
    assert rx.take_finished() == {"r": None} and rx.num_failed_closed == 1
    # The greedy peer's messages for unknown requests are refused when they expire.
    wait_until(lambda: rx.take_finished() == {} and rx.num_refused == 4, 10,
               "unknown requests' messages refused")


def test_the_collective_pipes_control_channel_proves_the_secret() -> None:
    """The Gloo (and NCCL) pipe's headers, handshake and group id go over this same ZMQ
    handshake: a forger that knows the collective hello's shape is refused before any group
    is joined."""
    cons = create_pipe("gloo", PipeConfig(handshake_timeout=3.0))
    cons.set_handshake_validator(_validator)
    forged = create_pipe("zmq", PipeConfig(security="none", handshake_timeout=3.0))
    try:
        addr = cons.listen()
        with pytest.raises(HandshakeError, match=f"{REFUSED}$"):
            forged.connect(addr, {**HELLO, "_group_id": "x", "_group_gen": "y"})
        assert cons.stats()["auth_failures"] == 1 and not cons._peers
    finally:
        forged.close()
        cons.close()
