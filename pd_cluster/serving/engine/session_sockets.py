"""Where a proxy session's sockets live on the engine's node: ipc socket files named
``pd-out-<pid>-<random>`` in one directory when the proxy is on this node, tcp on this
node's address otherwise; and the sweep of files left by engines that crashed.

Both session sockets use it: the token path's stream listener (output_sender.py, frames in
frame_socket.py) and the request path's ZMQ PULL (request_reader.py).
"""
from __future__ import annotations

import hashlib
import hmac
import os
import socket
import uuid

import zmq

from pd_cluster.ipc_files import sweep_stale

IPC_PREFIX = "pd-out-"  # ipc socket files: pd-out-<pid>-<random>
_LISTEN_BACKLOG = 4  # one proxy connects per session; a few spare for a racing reconnect
# Socket files: only this user's processes (the cluster's) may connect to a session, so no
# other local user can read its token stream or submit requests. Every session also proves
# the cluster secret: the token stream by challenge-response (session_proof), the request
# socket over tcp by ZMQ CURVE with keys derived from it (curve_request_socket).
_OWNER_ONLY = 0o600
NONCE_BYTES = 16
PROOF_BYTES = 32
_CURVE_CHANNEL = "session-"


def session_proof(secret: bytes, session: str, nonce: bytes) -> bytes:
    """What the proxy answers to the engine's nonce on a token stream: HMAC over the session
    and the nonce (a new nonce per connection: a recorded answer is worth nothing)."""
    msg = b"pd-cluster token session v1\0" + session.encode() + b"\0" + nonce
    return hmac.new(secret, msg, hashlib.sha256).digest()


def proof_holds(secret: bytes, session: str, nonce: bytes, answer: bytes) -> bool:
    return hmac.compare_digest(session_proof(secret, session, nonce), bytes(answer))


def curve_request_socket(sock: zmq.Socket, secret: bytes, server: bool) -> None:
    """A tcp request socket's CURVE keys (derived from the cluster secret): only a proxy of
    this cluster can connect, and requests travel encrypted."""
    from connectors.pipes.auth import curve_client, curve_server
    (curve_server if server else curve_client)(sock, secret, _CURVE_CHANNEL)


def new_ipc_path(ipc_dir: str) -> str:
    """A fresh socket file path for this process (the sweep reads the pid back)."""
    return os.path.join(ipc_dir, f"{IPC_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}")


def bind_session_socket(ctx: zmq.Context, kind: int, ipc: bool, host: str, ipc_dir: str,
                        secret: bytes | None = None) -> tuple[zmq.Socket, str, str | None]:
    """A ZMQ socket of ``kind`` bound for one proxy session: ipc in ``ipc_dir`` (the proxy is
    on this node) or tcp on ``host`` at a free port, CURVE with ``secret`` (tcp only: an ipc
    file is this user's alone). Returns it, its endpoint and ipc path."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if secret is not None and not ipc:
        curve_request_socket(sock, secret, server=True)
    try:
        if ipc:
            path = new_ipc_path(ipc_dir)
            endpoint = f"ipc://{path}"
            sock.bind(endpoint)
            os.chmod(path, _OWNER_ONLY)
            return sock, endpoint, path
        url_host = f"[{host}]" if ":" in host else host
        port = sock.bind_to_random_port(f"tcp://{url_host}")
        return sock, f"tcp://{url_host}:{port}", None
    except BaseException:
        sock.close(linger=0)
        raise


def listen_session_socket(ipc: bool, host: str, ipc_dir: str
                          ) -> tuple[socket.socket, str, str | None]:
    """A non-blocking stream socket listening for one proxy session: AF_UNIX in ``ipc_dir``
    (endpoint ``unix://<path>``) or TCP on ``host`` at a free port (``tcp://host:port``).
    Returns it, its endpoint and its socket file (None for tcp)."""
    if ipc:
        path = new_ipc_path(ipc_dir)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        endpoint = f"unix://{path}"
        addr: object = path
    else:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        path, addr = None, (host, 0)
    try:
        sock.bind(addr)
        if path is not None:
            os.chmod(path, _OWNER_ONLY)
        sock.listen(_LISTEN_BACKLOG)
        sock.setblocking(False)
        if path is None:
            url_host = f"[{host}]" if ":" in host else host
            endpoint = f"tcp://{url_host}:{sock.getsockname()[1]}"
        return sock, endpoint, path
    except BaseException:
        sock.close()
        unlink_quietly(path)
        raise


def parse_endpoint(endpoint: str) -> tuple[str, str | tuple[str, int]]:
    """``unix://<path>`` -> ("unix", path); ``tcp://host:port`` -> ("tcp", (host, port))."""
    if endpoint.startswith("unix://"):
        return "unix", endpoint[len("unix://"):]
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint[len("tcp://"):].rpartition(":")
        if host and port.isdigit():
            return "tcp", (host.strip("[]"), int(port))
    raise ValueError(f"endpoint: expected unix://<path> or tcp://<host>:<port>, got {endpoint!r}")


def unlink_quietly(path: str | None) -> None:
    if path is not None:
        try:
            os.unlink(path)
        except OSError:
            pass


def sweep_stale_ipc(directory: str) -> list[str]:
    """Remove the sessions' ipc socket files in ``directory`` whose process is gone (an
    engine that crashed or was killed closes nothing); returns the paths removed."""
    return sweep_stale(directory, IPC_PREFIX)
