"""The engine's token path to the proxy: one frame per engine step and proxy session, over a
plain stream socket (AF_UNIX when the proxy is on this node, TCP otherwise).

``emit`` runs on the engine thread: it routes each delta by request to the proxy session the
request came from and writes one length-prefixed msgpack frame per session with every delta
of the step, itself, non-blocking (frame_socket.py). Per token nothing but the kernel sits
between the engine thread and the proxy's event loop: no queue to another thread, no ZMQ I/O
thread on either side (measured: they cost ~130 us a token on an idle 5 ms step).

The output thread does what may wait: it binds the sessions' listeners and accepts the
proxy's connection, flushes what a socket did not take (the proxy fell behind, or has not
connected yet) when it becomes writable, and closes sessions. A session whose proxy stopped
reading is never waited on: its pending bytes are bounded by size and by age, past either
bound (or when the proxy closed the connection) the session is closed and its requests are
aborted, so a dead or hung proxy costs the engine neither memory nor compute.
"""
from __future__ import annotations

import functools
import logging
import queue
import select
import socket
import tempfile
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

from pd_cluster.driver.messages import EngineDelta, encode
from pd_cluster.fault_sites import fault_site
from pd_cluster.futures import run_into
from pd_cluster.serving.engine.faulty_frames import FaultyFrames
from pd_cluster.serving.engine.frame_socket import FrameSession
from pd_cluster.serving.engine.session_sockets import (listen_session_socket, sweep_stale_ipc,
                                                       unlink_quietly)

# Why a session closed when its engine stops in order: the proxy takes that engine out of
# routing quietly instead of reporting it as failed.
SHUTTING_DOWN = "engine shutting down"

logger = logging.getLogger(__name__)

_MAX_SESSIONS = 16  # proxies that may stream from one engine at once (restarts included)
_BACKLOG_BYTES = 64 << 20  # per session, beyond the kernel's buffer: ~10 s of a busy proxy
_BACKLOG_SECONDS = 10.0  # a session that takes nothing for this long is closed
_IDLE_WAIT = 1.0  # s: the output thread's longest wait (it also wakes on every command)
_ERRORS = select.POLLERR | select.POLLHUP | select.POLLNVAL


class OutputSender:
    """``emit`` on the engine thread; ``open``/``close``/``route`` from anywhere."""

    def __init__(self, host: str, abort: Callable[[list[str]], None],
                 closed: Callable[[str, str], None] = lambda session, why: None,
                 backlog_bytes: int = _BACKLOG_BYTES,
                 backlog_seconds: float = _BACKLOG_SECONDS, faults: Any = None):
        """``host``: this node's address (tcp sessions listen there); ``abort``: aborts
        requests of a closed session; ``closed(session, why)``: a session closed;
        ``backlog_*``: how much a session whose proxy reads nothing may hold, and how long;
        ``faults``: the engine's FaultsConfig (test-only: its token site's faults)."""
        self._host, self._abort, self._closed = host, abort, closed
        self.ipc_dir = tempfile.gettempdir()
        sweep_stale_ipc(self.ipc_dir)  # left by engines that crashed (no shutdown ran)
        self._backlog_bytes, self._backlog_seconds = backlog_bytes, backlog_seconds
        self._q: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._routes: dict[str, str] = {}  # request id -> session (finished: removed)
        # Written by the output thread only; the engine thread reads single entries.
        self._sessions: dict[str, FrameSession] = {}
        self.counters = {"output_messages": 0, "output_sessions_dropped": 0,
                         "session_auth_failures": 0}
        from connectors.pipes.log_limit import LimitedLog
        from connectors.secret import cluster_secret
        self._secret = cluster_secret()  # every session's proxy proves it (frame_socket.py)
        self._limited = LimitedLog(logger)  # refused connections: any local process can cause
        self._faults = fault_site(faults, "token", self.counters)  # None: off
        self._thread = threading.Thread(target=self._run, name="engine-output", daemon=True)
        self._thread.start()

    # ---- any thread --------------------------------------------------------------------------
    def emit(self, deltas: list[EngineDelta]) -> None:
        """Engine thread: one step's deltas, one frame per session, written at once."""
        per_session: dict[str, list[EngineDelta]] = {}
        routes = self._routes
        for d in deltas:
            session = routes.get(d.request_id)
            if session is None:  # its session closed (and aborted it): nobody reads it
                continue
            if d.finished:
                routes.pop(d.request_id, None)
            per_session.setdefault(session, []).append(d)
        for session, ds in per_session.items():
            s = self._sessions.get(session)
            if s is None:  # closed: its requests were aborted
                continue
            # (counted on the engine thread; the rare refusal emitted elsewhere may race it)
            self.counters["output_messages"] += 1
            if s.send(encode(ds), self._backlog_bytes):
                self._wake()

    def route(self, request_id: str, session: str) -> None:
        """Before the request is submitted: its deltas go to ``session``."""
        self._routes[request_id] = session

    def open(self, session: str, ipc: bool) -> Future:
        """Listen for ``session``'s proxy; the Future holds the endpoint it connects to."""
        fut: Future = Future()
        self._command(("open", session, ipc, fut))
        return fut

    def close(self, session: str) -> None:
        self._command(("close", session))

    def stop(self, timeout: float = 5.0) -> None:
        self._command(("stop",))
        self._thread.join(timeout)

    def _command(self, item: tuple[Any, ...]) -> None:
        self._q.put(item)
        self._wake()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except OSError:  # full (the thread is awake anyway) or closed (stopped)
            pass

    # ---- the output thread ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while self._round():
                pass
        finally:
            self._wake_r.close()
            self._wake_w.close()

    def _round(self) -> bool:
        """Wait for a command or a socket, handle them; False once stopped."""
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        by_fd: dict[int, tuple[str, FrameSession]] = {}
        for name, s in self._sessions.items():
            with s.lock:
                conn = s.conn
                # A connection is read only to see the proxy hang up (it never writes).
                events = select.POLLIN | (select.POLLOUT if s.conn and s.pending_bytes else 0)
            for sock in [conn] if conn is not None else s.waiting_sockets():
                poller.register(sock, events)
                by_fd[sock.fileno()] = (name, s)
        for fd, events in poller.poll(self._wait_ms()):
            if fd == self._wake_r.fileno():
                continue
            name, s = by_fd[fd]
            if self._sessions.get(name) is s:
                self._serve(name, s, events, fd)
        while True:  # the wake-ups only end the wait: commands queue here
            try:
                self._wake_r.recv(4096)
            except OSError:
                break
        while True:
            try:
                item = self._q.get_nowait()
            except queue.Empty:
                break
            if item[0] == "open":
                self._open(*item[1:])
            elif item[0] == "close":
                self._drop(item[1], "closed by the proxy")
            elif item[0] == "stop":
                for session in list(self._sessions):
                    self._drop(session, SHUTTING_DOWN, abort=False)
                return False
        self._check_bounds()
        return True

    def _wait_ms(self) -> int:
        """Until the oldest stalled session reaches its age bound (at most _IDLE_WAIT)."""
        wait = _IDLE_WAIT
        now = time.monotonic()
        for s in self._sessions.values():
            since = s.stalled_since
            if since is not None:
                wait = min(wait, since + self._backlog_seconds - now)
        return max(1, int(wait * 1000) + 1)

    def _serve(self, name: str, s: FrameSession, events: int, fd: int) -> None:
        try:
            if s.conn is None:
                if s.readable(fd):  # the proxy proved the secret: what waited goes out
                    s.flush()
                return
            if events & (select.POLLIN | _ERRORS):
                if not s.conn.recv(4096) or events & _ERRORS:
                    self._drop(name, "the proxy closed the connection")
                    return
            if events & select.POLLOUT:
                s.flush()
        except BlockingIOError:
            pass
        except OSError as e:  # reset, broken pipe: the proxy is gone
            self._drop(name, f"the proxy closed the connection ({e})")

    def _check_bounds(self) -> None:
        now = time.monotonic()
        for name, s in list(self._sessions.items()):
            s.expire_candidates(now)
            if s.overflow:
                self._drop(name, f"over {self._backlog_bytes} bytes unread")
            elif s.stalled_since is not None and now - s.stalled_since > self._backlog_seconds:
                self._drop(name, f"nothing accepted for {self._backlog_seconds:.1f}s")

    def _open(self, session: str, ipc: bool, fut: Future) -> None:
        # Skipped when the proxy gave up waiting (it opens again); errors go to the proxy.
        run_into(fut, lambda: self._open_session(session, ipc))

    def _open_session(self, session: str, ipc: bool) -> str:
        s = self._sessions.get(session)
        if s is not None and s.conn is None:
            return s.endpoint  # asked again before its proxy connected
        if s is not None:  # the proxy lost its link and opens anew: the old one is stale
            self._drop(session, "the proxy opened the session again")
        while len(self._sessions) >= _MAX_SESSIONS:  # the oldest is a proxy long gone
            self._drop(next(iter(self._sessions)), "too many proxy sessions")
        s = FrameSession(*listen_session_socket(ipc, self._host, self.ipc_dir), session,
                         self._secret, functools.partial(self._refused, session))
        self._sessions[session] = s if self._faults is None else FaultyFrames(s, self._faults)
        return s.endpoint

    def _refused(self, session: str, why: str) -> None:
        """A connection to a session's listener that did not prove the secret: closed."""
        self.counters["session_auth_failures"] += 1
        self._limited.warn("refused session connections", "output session %s: refused a "
                           "connection (%s)", session, why)

    def _drop(self, session: str, why: str, abort: bool = True) -> None:
        s = self._sessions.pop(session, None)
        if s is None:
            return
        s.close()
        unlink_quietly(s.ipc_path)
        orphans = [rid for rid, sess in list(self._routes.items()) if sess == session]
        for rid in orphans:
            self._routes.pop(rid, None)
        self.counters["output_sessions_dropped"] += 1
        level = logging.INFO if why == SHUTTING_DOWN and not orphans else logging.WARNING
        logger.log(level, "output session %s closed (%s); aborting %d requests", session, why,
                   len(orphans))
        if orphans and abort:
            self._abort(orphans)
        self._closed(session, why)
