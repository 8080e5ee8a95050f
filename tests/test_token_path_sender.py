"""The token path, engine side alone: the OutputSender's frames read off a raw socket by a
"proxy" this test plays (no TokenChannel), and the framing itself (frame_socket.py).

Frames cut at any byte boundary parse back whole; a partial write (a tiny send buffer, large
frames, a slow reader) loses and reorders nothing; frames emitted before the proxy connects
wait for it; a proxy that reads nothing costs the engine bounded memory and time (the session
closes, its requests are aborted, nothing is left routed); stale socket files are swept.
"""
from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Callable

import msgspec
import pytest

from pd_cluster.driver.messages import EngineDelta
from pd_cluster.serving.engine.frame_socket import HEADER, FrameParser, MalformedFrame, frame
from pd_cluster.serving.engine.output_sender import OutputSender
from connectors.secret import cluster_secret
from pd_cluster.serving.engine.session_sockets import (NONCE_BYTES, parse_endpoint,
                                                       session_proof, sweep_stale_ipc)

_decoder = msgspec.msgpack.Decoder(list[EngineDelta])


def _until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


class _Proxy:
    """A sender with one session, and the raw socket its proxy connects."""

    def __init__(self, ipc: bool = True, connect: bool = True, **sender_kw: Any):
        self.aborted: list[str] = []
        self.closed: list[str] = []
        self.sender = OutputSender("127.0.0.1", self.aborted.extend,
                                   lambda session, why: self.closed.append(why), **sender_kw)
        self.endpoint = self.sender.open("s", ipc=ipc).result(10)
        self.sock: socket.socket | None = None
        if connect:
            self.connect()

    def connect(self) -> None:
        kind, addr = parse_endpoint(self.endpoint)
        if kind == "tcp":
            self.sock = socket.create_connection(addr, 10)
        else:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.connect(addr)
        prove(self.sock, "s")
        session = self.sender._sessions["s"]
        _until(lambda: session.conn is not None or session.closed)

    def read(self, n_frames: int, pause: float = 0.0, chunk: int = 65536) -> list[EngineDelta]:
        out: list[EngineDelta] = []
        parser, frames = FrameParser(), [0]

        def on_frame(payload: memoryview) -> None:
            frames[0] += 1
            out.extend(_decoder.decode(payload))
        self.sock.settimeout(10)
        while frames[0] < n_frames:
            data = self.sock.recv(chunk)
            assert data, "the engine closed the stream"
            parser.feed(data, on_frame)
            time.sleep(pause)
        return out


def prove(sock: socket.socket, session: str, secret: bytes | None = None) -> None:
    """What the proxy does first: answer the engine's nonce (session_sockets.py)."""
    sock.settimeout(10)
    nonce = b""
    while len(nonce) < NONCE_BYTES:
        nonce += sock.recv(NONCE_BYTES - len(nonce))
    sock.sendall(session_proof(secret or cluster_secret(), session, nonce))


def _step(rids: list[str], step: int, text: str = "x") -> list[EngineDelta]:
    return [EngineDelta(rid, step, [step], text) for rid in rids]


def test_frames_cut_anywhere_parse_back_whole_and_a_bad_length_is_malformed() -> None:
    rng = random.Random(0)
    payloads = [bytes(rng.randrange(256) for _ in range(rng.choice([0, 1, 7, 300, 70_000])))
                for _ in range(40)]
    stream = b"".join(frame(p) for p in payloads)
    got: list[bytes] = []
    parser = FrameParser()
    pos = 0
    while pos < len(stream):  # pieces of 1 byte up to several frames
        n = rng.choice([1, 2, 3, 5, 64, 4096, 100_000])
        parser.feed(stream[pos:pos + n], lambda p: got.append(bytes(p)))
        pos += n
    assert got == payloads
    with pytest.raises(MalformedFrame):
        FrameParser(max_frame=1000).feed(HEADER.pack(1001) + b"x", lambda p: None)


@pytest.mark.parametrize("ipc", [True, False], ids=["unix", "tcp"])
def test_partial_writes_keep_every_frame_in_order(ipc: bool) -> None:
    """A tiny send buffer, ~80 KB frames and a proxy reading small pieces slowly: most
    frames do not fit at once; what the kernel did not take is flushed by the output thread
    behind which later frames wait, and every delta arrives once, in order."""
    p = _Proxy(ipc=ipc)
    session = p.sender._sessions["s"]
    session.conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    rids = [f"r{i}" for i in range(64)]
    for rid in rids:
        p.sender.route(rid, "s")
    steps, text = 60, "y" * 1200
    deferred = [0]

    def engine() -> None:  # the engine thread: never blocks, whatever the proxy does
        for step in range(steps):
            p.sender.emit(_step(rids, step, text))
            deferred[0] += session.pending_bytes > 0
    t = threading.Thread(target=engine)
    t.start()
    deltas = p.read(steps, pause=0.0005, chunk=8192)
    t.join(10)
    assert deferred[0] > 0  # the partial-write path was taken
    for rid in rids:
        mine = [d for d in deltas if d.request_id == rid]
        assert [d.seq for d in mine] == list(range(steps))
        assert all(d.text == text for d in mine)
    assert session.pending_bytes == 0 and not p.aborted and not p.closed
    p.sender.stop()


def test_frames_emitted_before_the_proxy_connects_wait_for_it() -> None:
    p = _Proxy(connect=False)
    p.sender.route("early", "s")
    for step in range(5):
        p.sender.emit(_step(["early"], step))
    assert p.sender._sessions["s"].pending_bytes > 0
    p.connect()
    assert [d.seq for d in p.read(5)] == list(range(5))
    p.sender.stop()


@pytest.mark.parametrize("bound", ["bytes", "seconds"])
def test_a_proxy_that_reads_nothing_costs_the_engine_bounded_memory_and_time(bound: str
                                                                              ) -> None:
    """Connected, alive, reading nothing: past the byte bound (or the age bound) the session
    closes, its requests are aborted and its pending bytes freed; the engine thread never
    waited on it."""
    kw = {"backlog_bytes": 1 << 20, "backlog_seconds": 60.0} if bound == "bytes" else \
        {"backlog_bytes": 1 << 30, "backlog_seconds": 0.3}
    p = _Proxy(**kw)
    session = p.sender._sessions["s"]
    p.sender.route("stuck", "s")
    p.sender.route("other", "s")
    pending: list[int] = []

    def engine() -> None:  # emits until the session closes: only ends if emit never blocks
        step = 0
        while "s" in p.sender._sessions:
            p.sender.emit(_step(["stuck", "other"], step, "z" * 8000))
            pending.append(session.pending_bytes)
            step += 1
            time.sleep(0.002 if bound == "seconds" else 0)
    thread = threading.Thread(target=engine, daemon=True)
    thread.start()
    # The proxy reads nothing: an emit that waited on it would never return.
    thread.join(timeout=60)
    assert not thread.is_alive(), "emit blocked on the proxy, or the session never closed"
    assert pending and max(pending) <= kw["backlog_bytes"] + 20_000
    _until(lambda: bool(p.closed))
    why = "unread" if bound == "bytes" else "nothing accepted"
    assert why in p.closed[0], p.closed
    assert sorted(p.aborted) == ["other", "stuck"]
    assert not p.sender._routes and session.pending_bytes == 0 and session.closed
    assert p.sender.counters["output_sessions_dropped"] == 1
    p.sock.close()
    p.sender.stop()


def test_ipc_files_of_dead_engines_are_swept_and_a_stopped_sender_leaves_none(tmp_path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    paths = {k: str(tmp_path / f"pd-out-{pid}-{k}")
             for k, pid in (("dead", dead.pid), ("live", os.getpid()))}
    socks = []
    for path in paths.values():
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(path)
        socks.append(sock)
    (tmp_path / f"pd-out-{dead.pid}-notasocket").write_text("")
    assert sweep_stale_ipc(str(tmp_path)) == [paths["dead"]]
    assert sorted(os.listdir(tmp_path)) == sorted(
        [f"pd-out-{os.getpid()}-live", f"pd-out-{dead.pid}-notasocket"])
    for sock in socks:
        sock.close()

    sender = OutputSender("127.0.0.1", lambda ids: None)
    endpoint = sender.open("s", ipc=True).result(10)
    path = endpoint.removeprefix("unix://")
    assert os.stat(path).st_mode & 0o777 == 0o600  # no other local user may connect
    sender.stop()
    assert not os.path.exists(path)


def test_request_socket_files_are_owner_only(tmp_path) -> None:
    import zmq

    from pd_cluster.serving.engine.session_sockets import bind_session_socket
    sock, endpoint, path = bind_session_socket(zmq.Context.instance(), zmq.PULL, True,
                                               "127.0.0.1", str(tmp_path))
    try:
        assert endpoint == f"ipc://{path}" and os.stat(path).st_mode & 0o777 == 0o600
    finally:
        sock.close(linger=0)
