"""What every pipe message carries so the receiver knows it is what the sender sent
(``kv_transfer.integrity``, compared at the handshake: both ends must agree).

- ``mac``: AES-256-GMAC under a key of this connection and this direction, over a message
  number, the envelope (kind, header, tensor meta) and every payload byte, the message
  number as the nonce (unique per key: numbers only grow, and each connection has new keys). The keys are
  derived from the cluster secret and both handshake nonces (auth.py), so they are new on
  every connection and never cross the wire. Message numbers grow by one per message and the
  receiver takes only numbers above the last it accepted: a frame cannot be forged, altered,
  replayed, reordered, or moved to another connection (or direction) without the check
  failing. Needs the secret (``security: token`` or ``curve``); the default there.
  GMAC rather than HMAC-SHA256: OpenSSL's GHASH runs on the CPU's carry-less
  multiply (12-14 GB/s per core on this project's CPU machine against HMAC-SHA256's 1.2,
  which was 60-70% of both ends' CPU in a ZMQ transfer and capped it at ~0.6 GB/s). The
  handshake sends ``mac`` as ``MAC_WIRE_NAME``: an engine of the HMAC era is refused there,
  not failed per message.
- ``crc32``: CRC-32 over the same bytes, unkeyed: it catches accidents (a corrupted receive,
  a buffer reused before it left, a bug), not an attacker, who recomputes it. The default
  with ``security: none``.
- ``none``: nothing is checked.

Neither mode hides anything: KV travels in clear unless ``security: curve`` encrypts it.
"""
from __future__ import annotations

import hashlib
import hmac
import struct
import threading
import zlib
from typing import Any, Iterable, Literal, Optional

from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

Integrity = Literal["mac", "crc32", "none"]
HELLO_KEY = "_integrity"  # the producer's mode, in its hello (a model hello never uses it)
MAC_WIRE_NAME = "mac-gmac"  # what ``mac`` is called in the hello (the algorithm is compared)
_KEY_LABEL = b"pd-cluster kv frame key v1\0"
_MAC_LABEL = b"pd-cluster kv frame v1\0"
_SEQ = struct.Struct("<Q")
TAG_BYTES = {"mac": _SEQ.size + 16, "crc32": _SEQ.size + 4}


def hello_value(mode: str) -> str:
    """The producer's ``HELLO_KEY`` value for ``mode`` (names the MAC's algorithm)."""
    return MAC_WIRE_NAME if mode == "mac" else mode


def session_keys(secret: bytes, producer_nonce: bytes, consumer_nonce: bytes
                 ) -> tuple[bytes, bytes]:
    """(producer -> consumer key, consumer -> producer key) of one connection: HMAC-SHA256
    as a PRF over a label, the direction and both nonces (HKDF-Expand with one block)."""
    def key(direction: bytes) -> bytes:
        return hmac.new(secret, _KEY_LABEL + direction + producer_nonce + consumer_nonce,
                        hashlib.sha256).digest()
    return key(b"p2c"), key(b"c2p")


def mismatch(mine: str, hello: dict) -> Optional[str]:
    """Why a producer's hello cannot be served under this consumer's integrity mode (it
    names the producer's value only, as hello.py's reasons do)."""
    theirs = hello.get(HELLO_KEY)
    if theirs == hello_value(mine):
        return None
    return (f"kv_transfer.integrity differs: the prefill engine has {theirs!r:.20}; both "
            f"ends must use the same mode (mac, crc32 or none) and version")


class Channel:
    """One connection's two directions. ``seal`` is called by the one thread that puts this
    connection's messages on the wire, in wire order; ``check`` by the one thread that takes
    them off the receive queue, in arrival order."""

    def __init__(self, mode: Integrity, send_key: bytes = b"", recv_key: bytes = b"") -> None:
        if mode == "mac" and not (send_key and recv_key):
            raise ValueError("integrity: mac needs the connection's keys (the cluster secret)")
        self.mode, self._send_key, self._recv_key = mode, send_key, recv_key
        self._next_seq = 1
        self._last_seq = 0
        self._lock = threading.Lock()  # seal may be called from a test thread too

    def side_keys(self, label: bytes) -> tuple[bytes, bytes]:
        """(send, receive) keys of a side channel of this connection labelled ``label`` (the
        nixl pipe's notifications): derived from the frame keys, never equal to them."""
        return (hmac.new(self._send_key, label, hashlib.sha256).digest(),
                hmac.new(self._recv_key, label, hashlib.sha256).digest())

    def seal(self, head: bytes, payload: Iterable[Any]) -> Optional[bytes]:
        """The tag frame of the next message (None in mode none): its number and MAC/CRC."""
        if self.mode == "none":
            return None
        with self._lock:
            seq, self._next_seq = self._next_seq, self._next_seq + 1
        return _SEQ.pack(seq) + _code(self.mode, self._send_key, seq, head, payload)

    def check(self, head: bytes, payload: Iterable[Any], tag: Any) -> Optional[str]:
        """Why a received message must be dropped (None: it holds; its number is then
        consumed). A failed message leaves the state as it was: a forger cannot push the
        accepted number forward."""
        if self.mode == "none":
            return None
        tag = bytes(tag) if tag is not None else b""
        if len(tag) != TAG_BYTES[self.mode]:
            return f"no {self.mode} tag"
        seq = _SEQ.unpack_from(tag)[0]
        want = _code(self.mode, self._recv_key, seq, head, payload)
        if not hmac.compare_digest(want, tag[_SEQ.size:]):
            return f"{self.mode} mismatch"
        if seq <= self._last_seq:
            return f"message number {seq} replayed or out of order (last {self._last_seq})"
        self._last_seq = seq
        return None


def _code(mode: str, key: bytes, seq: int, head: bytes, payload: Iterable[Any]) -> bytes:
    prefix = _MAC_LABEL + _SEQ.pack(seq) + _SEQ.pack(len(head))
    if mode == "mac":
        return gmac(key, seq, [prefix, head, *payload])
    crc = zlib.crc32(head, zlib.crc32(prefix))
    for chunk in payload:
        crc = zlib.crc32(chunk, crc)
    return struct.pack("<I", crc)


def gmac(key: bytes, seq: int, chunks: Iterable[Any]) -> bytes:
    """AES-GMAC (GCM over associated data only) of ``chunks`` under ``key`` with nonce
    ``seq``: the caller never uses one (key, seq) twice for two different messages."""
    mac = Cipher(algorithms.AES(key), modes.GCM(b"\0\0\0\0" + _SEQ.pack(seq))).encryptor()
    for chunk in chunks:
        mac.authenticate_additional_data(chunk)
    mac.finalize()
    return mac.tag


def payload_code(mode: Integrity, data: Any) -> Optional[bytes]:
    """A digest of a payload that travels outside the MAC'd frame (the collective pipes'
    tensors): SHA-256 (collision resistant; the frame that carries it is MAC'd, so the
    payload is bound to it) or CRC-32; None in mode none."""
    if mode == "none":
        return None
    if mode == "mac":
        return hashlib.sha256(data).digest()
    return struct.pack("<I", zlib.crc32(data))
