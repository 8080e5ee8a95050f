"""Pipe messages carry a tag the receiver checks (connectors/pipes/integrity.py): a keyed MAC
per connection and direction with message numbers (forgery, alteration, replay, reordering
and moving frames between connections all fail), or CRC-32, or nothing; the mode is compared
at the handshake; the tag is taken off the caller's (the forward's) thread."""
from __future__ import annotations

import logging
import threading

import pytest
import torch

from connectors.config import KVTransferConfig
from connectors.pipes import HandshakeError, PipeConfig, create_pipe, integrity
from connectors.pipes.integrity import Channel, session_keys
from connectors.pipes.log_limit import LimitedLog
from pd_cluster.serving.cluster.testing import wait_until

HELLO = {"model_id": "m"}
SECRET = b"s" * 32


def _pair(mode: str = "mac") -> tuple[Channel, Channel]:
    """(producer's, consumer's) channels of one connection."""
    p2c, c2p = session_keys(SECRET, b"p" * 16, b"d" * 16)
    return Channel(mode, p2c, c2p), Channel(mode, c2p, p2c)


def _msg(i: int) -> tuple[bytes, list[bytes]]:
    return f"head{i}".encode(), [bytes([i]) * 100, b"tail"]


@pytest.mark.parametrize("mode", ["mac", "crc32"])
def test_a_channel_takes_each_genuine_message_once_in_order(mode: str) -> None:
    prod, cons = _pair(mode)
    tags = [prod.seal(*_msg(i)) for i in range(3)]
    assert cons.check(*_msg(0), tags[0]) is None
    assert cons.check(*_msg(2), tags[2]) is None  # a gap is allowed (a message lost)...
    assert "out of order" in cons.check(*_msg(1), tags[1])  # ...but not one after it
    assert "replayed" in cons.check(*_msg(2), tags[2])      # nor the same frame again
    head, payload = _msg(3)
    tag = prod.seal(head, payload)
    flipped = [payload[0][:50] + b"\x01" + payload[0][51:], payload[1]]
    assert cons.check(head, flipped, tag) == f"{mode} mismatch"
    assert cons.check(b"other", payload, tag) == f"{mode} mismatch"
    assert cons.check(head, payload, None) == f"no {mode} tag"
    assert cons.check(head, payload, tag) is None  # the failures did not move it forward


def test_a_mac_is_bound_to_its_connection_and_direction() -> None:
    prod, cons = _pair()
    other_p = Channel("mac", *session_keys(SECRET, b"q" * 16, b"d" * 16))
    head, payload = _msg(1)
    # another connection's producer (same secret, other nonces) cannot feed this consumer
    assert cons.check(head, payload, other_p.seal(head, payload)) == "mac mismatch"
    # the consumer's own messages, reflected back, fail too (keys differ per direction)
    assert cons.check(head, payload, cons.seal(head, payload)) == "mac mismatch"
    # while CRC-32 is recomputed by anyone: it stops accidents only
    crc = Channel("crc32")
    assert Channel("crc32").check(head, payload, crc.seal(head, payload)) is None
    assert cons.check(head, payload, prod.seal(head, payload)) is None


def test_integrity_config_defaults_aliases_and_errors() -> None:
    assert PipeConfig().integrity == "mac"                  # the secret is on: MAC
    assert PipeConfig(security="none").integrity == "crc32"  # no secret, no key
    with pytest.raises(ValueError, match="integrity: mac needs the cluster secret"):
        PipeConfig(security="none", integrity="mac")
    assert KVTransferConfig.from_dict({"digest": False}).pipe_config.integrity == "none"
    assert KVTransferConfig.from_dict({"digest": True}).pipe_config.integrity == "mac"
    with pytest.raises(ValueError, match="digest: false contradicts integrity"):
        KVTransferConfig.from_dict({"digest": False, "integrity": "crc32"})
    with pytest.raises(ValueError, match="digest: expected true or false"):
        KVTransferConfig.from_dict({"options": {"digest": "yes"}})
    with pytest.raises(ValueError):
        Channel("mac")  # no keys


@pytest.mark.parametrize("pipe", ["zmq", "gloo"])
@pytest.mark.parametrize("producer,consumer", [("crc32", "mac"), ("none", "crc32")])
def test_the_handshake_refuses_another_integrity_mode(pipe: str, producer: str,
                                                      consumer: str) -> None:
    cons = create_pipe(pipe, PipeConfig(integrity=consumer, handshake_timeout=5.0))
    prod = create_pipe(pipe, PipeConfig(integrity=producer, handshake_timeout=5.0))
    try:
        cons.set_handshake_validator(lambda h: None if h == HELLO else "not the hello")
        with pytest.raises(HandshakeError, match=f"kv_transfer.integrity differs: the prefill "
                                                 f"engine has '{producer}'"):
            prod.connect(cons.listen(), HELLO)
    finally:
        prod.close(), cons.close()


@pytest.mark.parametrize("mode", ["mac", "crc32", "none"])
def test_zmq_tags_are_taken_on_the_io_thread_and_checked(mode: str, monkeypatch) -> None:
    sealed_on: list[str] = []
    real_seal = Channel.seal

    def seal(self: Channel, head: bytes, payload: list) -> bytes | None:
        sealed_on.append(threading.current_thread().name)
        return real_seal(self, head, payload)
    monkeypatch.setattr(Channel, "seal", seal)
    cfg = PipeConfig(integrity=mode, handshake_timeout=5.0)
    cons, prod = create_pipe("zmq", cfg), create_pipe("zmq", cfg)
    try:
        addr = cons.listen()
        prod.connect(addr, HELLO)
        t = torch.arange(3000.0)
        prod.send_tensor(addr, {"n": 1}, t).result(timeout=5)  # sent from this (forward) thread
        peer, header, got = cons.recv_tensor(timeout=5)
        assert header == {"n": 1} and torch.equal(got, t)
        cons.send_tensor(peer, {"ack": 1}, None).result(timeout=5)  # and back
        assert prod.recv_tensor(timeout=5)[1] == {"ack": 1}
        assert sealed_on == ["zmq-pipe-io"] * 2  # never the caller's thread
        assert cons.stats()["integrity_failures"] == 0
    finally:
        prod.close(), cons.close()


def test_a_frame_altered_in_flight_is_dropped_and_counted() -> None:
    cons, prod = create_pipe("zmq", PipeConfig()), create_pipe("zmq", PipeConfig())
    real = cons._rq.put

    def alter(item, nbytes: int) -> None:  # in flight: before the receiver's check
        peer, body, tensor, tag = item
        if body.get("alter"):
            tensor = tensor.clone()
            tensor[7] += 1
        real((peer, body, tensor, tag), nbytes)
    cons._rq.put = alter
    try:
        addr = cons.listen()
        prod.connect(addr, HELLO)
        prod.send_tensor(addr, {"alter": True}, torch.ones(64)).result(timeout=5)
        prod.send_tensor(addr, {"alter": False}, torch.ones(64)).result(timeout=5)
        assert cons.recv_tensor(timeout=5)[1] == {"alter": False}  # the altered one: gone
        assert cons.stats()["integrity_failures"] == 1
    finally:
        prod.close(), cons.close()


def test_peer_caused_warnings_are_rate_limited(caplog) -> None:
    now = [0.0]
    limited = LimitedLog(logging.getLogger("t"), interval=60.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, "t"):
        for i in range(100):
            limited.warn("failed proofs", "refused %d", i)
        assert [r.getMessage() for r in caplog.records] == ["refused 0"]
        now[0] = 61.0
        limited.warn("failed proofs", "refused %d", 100)
        limited.warn("forged frames", "forged")  # another kind: its first is logged
    assert [r.getMessage() for r in caplog.records][1:] == [
        "100 more failed proofs in the last 60s (latest: refused 100)", "forged"]


def test_many_failed_proofs_log_one_line_and_count_each(caplog) -> None:
    cons = create_pipe("zmq", PipeConfig(handshake_timeout=2.0))
    forger = create_pipe("zmq", PipeConfig(security="none", handshake_timeout=2.0))
    try:
        addr = cons.listen()
        with caplog.at_level(logging.WARNING, "connectors.pipes.zmq_pipe"):
            for _ in range(5):
                with pytest.raises(HandshakeError):
                    forger.connect(addr, {**HELLO, integrity.HELLO_KEY: "mac"})
        wait_until(lambda: cons.stats()["auth_failures"] == 5, 10, "5 failed proofs counted")
        assert sum("refused peer" in r.getMessage() for r in caplog.records) == 1
    finally:
        forger.close(), cons.close()


def test_the_forward_thread_never_reads_device_kv_back(monkeypatch) -> None:
    """A layer of device KV (here on the meta device, which cannot be read back: any
    ``.cpu()`` raises) becomes messages without a copy back in the calling thread: the tag
    is the pipe's, over the staged host copy (the old per-layer digest read the device
    buffer here, a synchronous copy per layer)."""
    from types import SimpleNamespace

    from connectors.layer_sender import LayerSender
    from connectors.metadata import SendSpec
    monkeypatch.setattr("connectors.layer_sender.gather_blocks",
                        lambda kv, ids, out: out.copy_(kv.index_select(1, torch.tensor(
                            ids, device=kv.device))))
    pipe = SimpleNamespace(config=PipeConfig(), carries=lambda device: False)
    sender = LayerSender(pipe, 1 << 20, copy_timeout=1.0)
    staged: list[torch.Tensor] = []

    class Staging:  # stands in for host_staging.HostStaging (a CUDA stream's copy)
        def stage(self, device_buf: torch.Tensor):
            staged.append(device_buf)
            return torch.zeros(device_buf.shape), "copied"
    sender._staging = Staging()
    kv = torch.empty(2, 8, 4, 2, 16, device="meta")
    spec = SendSpec("r", "peer", (5, 2, 7), 0)
    msgs = sender.layer_messages(spec, 0, kv)
    assert len(msgs) == 1 and msgs[0].tensor.device.type == "cpu"
    assert staged and staged[0].device.type == "meta"


def test_the_mac_is_aes_gmac_over_number_envelope_and_payload() -> None:
    """Issue 42: HMAC-SHA256 (1.2 GB/s per core) was 60-70% of a transfer's CPU on both
    ends; the tag is AES-256-GMAC with the message number as nonce (12+ GB/s), and the
    handshake names it, so an engine of the HMAC era is refused there, not per message."""
    import struct

    from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    prod, _ = _pair()
    head, payload = _msg(7)
    tag = prod.seal(head, payload)
    seq = struct.unpack_from("<Q", tag)[0]
    p2c, _c2p = session_keys(SECRET, b"p" * 16, b"d" * 16)
    aad = (b"pd-cluster kv frame v1\0" + struct.pack("<QQ", seq, len(head)) + head
           + b"".join(payload))
    # GCM with no plaintext is GMAC: its output is the tag alone
    assert tag[8:] == AESGCM(p2c).encrypt(b"\0" * 4 + struct.pack("<Q", seq), b"", aad)
    assert integrity.mismatch("mac", {integrity.HELLO_KEY: "mac"}) is not None
    assert integrity.mismatch("mac", {integrity.HELLO_KEY: integrity.hello_value("mac")}) is None
