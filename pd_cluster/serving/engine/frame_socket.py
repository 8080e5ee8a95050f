"""Length-prefixed frames over a stream socket, both ends of the token path.

A frame is a 4-byte big-endian length, the payload's CRC-32 (4 bytes) and that many bytes of
payload (the msgpack of one engine step's deltas for one session). The CRC catches a frame
altered on the way (a bit flipped in a token id would still decode): the proxy refuses it.
The engine's end is a ``FrameSession``: the socket a proxy session connects to, and the
bytes the kernel has not taken yet. ``send`` runs on the
engine thread and never blocks: while nothing is pending it writes straight to the socket
(no thread hop, no I/O thread: the proxy's loop wakes on the kernel's readiness alone), and
what the kernel does not take (EAGAIN, a partial write, no proxy connected yet) goes to
``pending``, which the output thread flushes when the socket is writable; later frames queue
behind it, so the order holds. The proxy's end is a ``FrameParser``: it cuts what the socket
delivered into frames, keeping a partial tail for the next read.
"""
from __future__ import annotations

import os
import socket
import struct
import threading
import time
import zlib
from typing import Callable

from pd_cluster.serving.engine.session_sockets import NONCE_BYTES, PROOF_BYTES, proof_holds

HEADER = struct.Struct(">I")  # the payload's length
CHECK = struct.Struct(">I")  # its CRC-32, after the length
PREFIX = HEADER.size + CHECK.size
MAX_FRAME = 64 << 20  # bytes: a longer length means the stream is corrupt, not a big step
_ANSWER_SECONDS = 5.0  # a connection answers the session's challenge within this, or is closed
_MAX_CANDIDATES = 4  # unproven connections held at once per session (the oldest goes first)
_COMPACT = 1 << 20  # pending: bytes sent before the buffer is compacted


class MalformedFrame(ValueError):
    """The stream cannot be cut into frames any more (a length over MAX_FRAME), or a frame
    is not what was sent (its CRC-32 does not hold)."""


def frame(payload: bytes) -> bytes:
    return HEADER.pack(len(payload)) + CHECK.pack(zlib.crc32(payload)) + payload


class FrameParser:
    """Feed it what a stream socket delivered; it calls ``on_frame`` with each complete
    payload (a memoryview valid during the call) and keeps the partial tail."""

    def __init__(self, max_frame: int = MAX_FRAME):
        self._max = max_frame
        self._tail = bytearray()
        self._need = 0  # total bytes the tail's frame needs (0: its header is incomplete)

    def feed(self, data: bytes | memoryview, on_frame: Callable[[memoryview], None]) -> None:
        """Raises MalformedFrame (and whatever ``on_frame`` raises). ``data`` is not kept
        after the call (a partial tail is copied), so a reused receive buffer may be passed."""
        if self._tail:
            self._tail += data
            if len(self._tail) < max(self._need, HEADER.size):
                return  # a frame still arriving: no copy until it is complete
            if not self._need:
                self._need = self._check(HEADER.unpack_from(self._tail)[0]) + PREFIX
                if len(self._tail) < self._need:
                    return
            data = bytes(self._tail)
            self._tail.clear()
            self._need = 0
        end, pos = len(data), 0
        with memoryview(data) as view:
            while end - pos >= HEADER.size:
                n = self._check(HEADER.unpack_from(data, pos)[0])
                if end - pos - PREFIX < n:
                    self._need = PREFIX + n
                    break
                crc = CHECK.unpack_from(data, pos + HEADER.size)[0]
                pos += PREFIX
                with view[pos:pos + n] as payload:
                    if zlib.crc32(payload) != crc:
                        raise MalformedFrame(f"a frame of {n} bytes fails its CRC-32")
                    on_frame(payload)
                pos += n
        if pos < end:
            self._tail += data[pos:]

    def _check(self, n: int) -> int:
        if n > self._max:
            raise MalformedFrame(f"frame length {n} over {self._max} bytes")
        return n


class FrameSession:
    """One proxy session's end on the engine: its listener until the proxy connects, then
    the connection. ``send`` from any thread; ``accept``/``flush``/``close`` from the output
    thread. Every field below the lock is read and written under it."""

    def __init__(self, listener: socket.socket, endpoint: str, ipc_path: str | None,
                 session: str = "", secret: bytes | None = None,
                 on_refused: Callable[[str], None] = lambda why: None):
        """``secret``: a connection becomes the session's only once it answered a nonce with
        session_sockets.session_proof (others are closed, ``on_refused(why)``)."""
        self.endpoint, self.ipc_path = endpoint, ipc_path
        self.session, self._secret, self._on_refused = session, secret, on_refused
        self.lock = threading.Lock()
        self.listener: socket.socket | None = listener
        # Connections still to answer their nonce: fd -> (socket, nonce, answer so far, deadline)
        self.candidates: dict[int, tuple[socket.socket, bytes, bytearray, float]] = {}
        self.conn: socket.socket | None = None
        self.pending = bytearray()
        self._sent = 0  # bytes of ``pending`` already written
        self.stalled_since: float | None = None  # pending and no progress since (None: empty)
        self.overflow = False  # pending went over its bound: the output thread closes it
        self.closed = False

    @property
    def pending_bytes(self) -> int:
        return len(self.pending) - self._sent

    def send(self, payload: bytes, max_pending: int) -> bool:
        """Queue one frame, writing it at once when nothing waits before it. True when the
        output thread has new work (pending started, or went over ``max_pending``)."""
        return self.send_frame(frame(payload), max_pending)

    def send_frame(self, data: bytes, max_pending: int) -> bool:
        """``send`` of a frame already made (``frame``)."""
        with self.lock:
            if self.closed or self.overflow:
                return False  # its requests are (being) aborted
            was_idle = not self.pending_bytes
            n = 0
            if self.conn is not None and was_idle:
                try:
                    n = self.conn.send(data)
                except OSError:  # EAGAIN; or the proxy went away: the output thread closes
                    n = 0
                if n == len(data):
                    return False
            self.pending += memoryview(data)[n:]
            if was_idle:
                self.stalled_since = time.monotonic()
            if self.pending_bytes > max_pending:
                self.overflow = True
                self.pending.clear()  # the session closes: free the memory now
                self._sent = 0
                return True
            return was_idle

    def waiting_sockets(self) -> list[socket.socket]:
        """What the output thread polls until the proxy is in: the listener, the candidates."""
        with self.lock:
            return ([self.listener] if self.listener is not None else []) + [
                c[0] for c in self.candidates.values()]

    def readable(self, fd: int) -> bool:
        """The listener or a candidate has something: accept, or check an answer. True once
        the proxy is in (the listener is closed, what waited is written)."""
        with self.lock:
            if self.listener is None or self.closed:
                return False
            if fd != self.listener.fileno():
                return self._check_answer(fd)
            try:
                conn, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return False
            conn.setblocking(False)
            if self._secret is None:
                return self._take(conn)
            nonce = os.urandom(NONCE_BYTES)
            try:
                conn.send(nonce)  # 16 bytes into a fresh socket's empty buffer: all of it
            except OSError:
                conn.close()
                return False
            self.candidates[conn.fileno()] = (conn, nonce, bytearray(),
                                              time.monotonic() + _ANSWER_SECONDS)
            while len(self.candidates) > _MAX_CANDIDATES:  # the oldest first
                self._refuse(next(iter(self.candidates)), "too many unproven connections")
            return False

    def expire_candidates(self, now: float) -> None:
        with self.lock:
            for fd in [fd for fd, c in self.candidates.items() if now > c[3]]:
                self._refuse(fd, "no answer to its challenge in time")

    def _check_answer(self, fd: int) -> bool:
        conn, nonce, answer, _ = self.candidates[fd]
        try:
            got = conn.recv(PROOF_BYTES - len(answer))
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            got = b""
        if not got:
            self._refuse(fd, "closed before it answered")
            return False
        answer += got
        if len(answer) < PROOF_BYTES:
            return False
        if not proof_holds(self._secret, self.session, nonce, answer):
            self._refuse(fd, "a wrong answer")
            return False
        del self.candidates[fd]
        return self._take(conn)

    def _refuse(self, fd: int, why: str) -> None:
        self.candidates.pop(fd)[0].close()
        self._on_refused(why)

    def _take(self, conn: socket.socket) -> bool:
        """``conn`` is the session's (TCP_NODELAY: frames are latency); the listener and any
        other candidate are closed (one proxy per session). Lock held."""
        if conn.family != socket.AF_UNIX:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for fd in list(self.candidates):
            self.candidates.pop(fd)[0].close()
        self.listener.close()
        self.listener, self.conn = None, conn
        return True

    def flush(self) -> None:
        """Write what the socket takes now. Raises OSError when the proxy is gone."""
        with self.lock:
            if self.conn is None or not self.pending_bytes:
                return
            with memoryview(self.pending) as view, view[self._sent:] as rest:
                try:
                    n = self.conn.send(rest)
                except BlockingIOError:
                    n = 0
            if n:
                self._sent += n
                self.stalled_since = time.monotonic()
            if self._sent == len(self.pending):
                self.pending.clear()
                self._sent, self.stalled_since = 0, None
            elif self._sent > _COMPACT:
                del self.pending[:self._sent]
                self._sent = 0

    def close(self) -> None:
        with self.lock:
            self.closed = True
            for sock in (self.listener, self.conn, *(c[0] for c in self.candidates.values())):
                if sock is not None:
                    sock.close()
            self.candidates.clear()
            self.listener = self.conn = None
            self.pending.clear()
            self._sent = 0
