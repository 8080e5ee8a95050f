"""Proving the cluster secret on a pipe's handshake, and ZMQ CURVE keys derived from it.

Challenge-response over nonces from both sides (neither end ever sends the secret, and a
recorded exchange is worth nothing on a new connection):

    producer -> consumer  hello  {auth: {n: Np}}                      (nothing else)
    consumer -> producer  ack    {challenge: Nd, proof: MAC("consumer", Np, Nd)}
    producer -> consumer  hello  {auth: {proof: MAC("producer", Np, Nd)}, ...model hello}
    consumer -> producer  ack    {ok, info} or {ok: false, error}

MAC is HMAC-SHA256 keyed by the cluster secret. The producer checks the consumer's proof
before it says anything about itself; the consumer looks at the model hello only after the
producer's proof held. A failed proof is answered with one fixed message.

``kv_transfer.security``: ``token`` (the exchange above), ``curve`` (the same, on sockets
encrypted and authenticated by ZMQ CURVE with keys derived from the secret: nothing crosses
the network in the clear), ``none`` (no proof: any process that reaches the port is a peer).
"""
from __future__ import annotations

import hashlib
import hmac
import os
from typing import Any, Literal

import zmq
from zmq.utils import z85

Security = Literal["token", "curve", "none"]
NONCE_BYTES = 16
KEY = "_auth"  # the hello key of the exchange (a model hello never uses it)
REFUSED = "authentication failed"  # the one answer to a failed proof: it says nothing more
_LABEL = b"pd-cluster kv handshake v1\0"


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def proof(secret: bytes, side: str, producer_nonce: bytes, consumer_nonce: bytes) -> bytes:
    """MAC over both nonces, bound to the side that sends it (a consumer's proof cannot be
    reflected back as a producer's)."""
    msg = _LABEL + side.encode() + b"\0" + producer_nonce + consumer_nonce
    return hmac.new(secret, msg, hashlib.sha256).digest()


def check(expected: bytes, got: Any) -> bool:
    return isinstance(got, bytes) and hmac.compare_digest(expected, got)


def is_nonce(value: Any) -> bool:
    return isinstance(value, bytes) and len(value) == NONCE_BYTES


def curve_keys(secret: bytes, role: str) -> tuple[bytes, bytes]:
    """(public, secret) z85 CURVE key pair of ``role`` ("server": the consumer's listening
    socket; "client": producers), the same in every process that holds the cluster secret."""
    raw = hmac.new(secret, b"pd-cluster curve v1\0" + role.encode(), hashlib.sha256).digest()
    secret_z85 = z85.encode(raw)
    return zmq.curve_public(secret_z85), secret_z85


def curve_server(sock: zmq.Socket, secret: bytes, channel: str = "") -> None:
    """A listening socket that takes only CURVE clients (encrypted; a client must know the
    server's public key, itself derived from the secret and never sent)."""
    _, sk = curve_keys(secret, channel + "server")
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, sk)


def curve_client(sock: zmq.Socket, secret: bytes, channel: str = "") -> None:
    server_pk, _ = curve_keys(secret, channel + "server")
    pk, sk = curve_keys(secret, channel + "client")
    sock.setsockopt(zmq.CURVE_SERVERKEY, server_pk)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, pk)
    sock.setsockopt(zmq.CURVE_SECRETKEY, sk)
