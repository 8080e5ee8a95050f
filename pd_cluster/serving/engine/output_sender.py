"""The engine's token path to the proxy: one msgpack message per engine step over ZMQ.

The engine thread hands each step's deltas to ``emit`` (a queue put, nothing else); the output
thread routes them by request to the proxy session the request came from and sends one message
per session with every delta of the step (several steps, if the thread fell behind: fewer
sends, the same numbered deltas). Each session is a PUSH socket the engine binds (ipc when the
proxy is on this node, tcp on this node's address otherwise); the proxy connects one PULL to it.

The output thread owns every socket (ZMQ sockets are not thread safe). A session the proxy
stopped reading (it died, or it hangs) is not waited on: its messages queue in a backlog that
is bounded by count and age; past either bound the session is closed and its requests are
aborted, so a dead proxy costs the engine neither memory nor compute.
"""
from __future__ import annotations

import collections
import logging
import os
import queue
import stat
import tempfile
import threading
import time
import uuid
from concurrent.futures import Future
from typing import Any, Callable

import zmq

from pd_cluster.driver.messages import EngineDelta, encode

logger = logging.getLogger(__name__)

_MAX_SESSIONS = 16  # proxies that may stream from one engine at once (restarts included)
_BACKLOG_MESSAGES = 4096  # per session, beyond ZMQ's own high-water mark
_BACKLOG_SECONDS = 10.0  # a session that accepts nothing for this long is closed
_RETRY_WAIT = 0.002  # s: output thread's wait while a backlog waits for its peer
_IPC_PREFIX = "pd-out-"  # ipc socket files: pd-out-<pid>-<random>


class _Session:
    def __init__(self, sock: zmq.Socket, endpoint: str, ipc_path: str | None):
        self.sock, self.endpoint, self.ipc_path = sock, endpoint, ipc_path
        self.backlog: collections.deque[bytes] = collections.deque()
        self.stalled_since: float | None = None


class OutputSender:
    """``emit`` on the engine thread; ``open``/``close``/``route`` from anywhere."""

    def __init__(self, host: str, abort: Callable[[list[str]], None],
                 local: Callable[[list[EngineDelta]], None],
                 closed: Callable[[str, str], None] = lambda session, why: None,
                 backlog_messages: int = _BACKLOG_MESSAGES,
                 backlog_seconds: float = _BACKLOG_SECONDS):
        """``host``: this node's address (tcp sessions bind there); ``abort``: aborts requests
        of a closed session; ``local``: gets the deltas of requests that have no session
        (those streamed over a Ray call); ``closed(session, why)``: a session closed;
        ``backlog_*``: how much a session that accepts nothing may hold, and how long."""
        self._host, self._abort, self._local, self._closed = host, abort, local, closed
        self.ipc_dir = tempfile.gettempdir()
        sweep_stale_ipc(self.ipc_dir)  # left by engines that crashed (no shutdown ran)
        self._backlog_messages, self._backlog_seconds = backlog_messages, backlog_seconds
        self._ctx = zmq.Context.instance()
        self._q: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._routes: dict[str, str] = {}  # request id -> session (finished: removed)
        self._sessions: dict[str, _Session] = {}  # output thread only
        self.counters = {"output_messages": 0, "output_sessions_dropped": 0}
        self._thread = threading.Thread(target=self._run, name="engine-output", daemon=True)
        self._thread.start()

    # ---- any thread --------------------------------------------------------------------------
    def emit(self, deltas: list[EngineDelta]) -> None:
        """Engine thread: one step's deltas (cheap: the output thread does the rest)."""
        self._q.put(("deltas", deltas))

    def route(self, request_id: str, session: str) -> None:
        """Before the request is submitted: its deltas go to ``session``."""
        self._routes[request_id] = session

    def open(self, session: str, ipc: bool) -> Future:
        """Bind a PUSH socket for ``session``; the Future holds its endpoint."""
        fut: Future = Future()
        self._q.put(("open", session, ipc, fut))
        return fut

    def close(self, session: str) -> None:
        self._q.put(("close", session))

    def stop(self, timeout: float = 5.0) -> None:
        self._q.put(("stop",))
        self._thread.join(timeout)

    # ---- the output thread ---------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            try:
                first = self._q.get(timeout=_RETRY_WAIT) if self._stalled() else self._q.get()
            except queue.Empty:
                self._flush_backlogs()
                continue
            items = [first]
            while True:  # everything queued meanwhile goes out in this round
                try:
                    items.append(self._q.get_nowait())
                except queue.Empty:
                    break
            per_session: dict[str, list[EngineDelta]] = {}
            local: list[EngineDelta] = []
            for item in items:
                kind = item[0]
                if kind == "deltas":
                    self._split(item[1], per_session, local)
                elif kind == "open":
                    self._open(*item[1:])
                elif kind == "close":
                    self._drop(item[1], "closed by the proxy")
                elif kind == "stop":
                    for session in list(self._sessions):
                        self._drop(session, "engine shutting down", abort=False)
                    return
            self._flush_backlogs()
            for session, deltas in per_session.items():
                self._send(session, encode(deltas))
            if local:
                self._local(local)

    def _split(self, deltas: list[EngineDelta], per_session: dict[str, list[EngineDelta]],
               local: list[EngineDelta]) -> None:
        for d in deltas:
            session = self._routes.get(d.request_id)
            if session is None:
                local.append(d)
                continue
            if d.finished:
                self._routes.pop(d.request_id, None)
            per_session.setdefault(session, []).append(d)

    def _open(self, session: str, ipc: bool, fut: Future) -> None:
        try:
            if session in self._sessions:
                fut.set_result(self._sessions[session].endpoint)
                return
            while len(self._sessions) >= _MAX_SESSIONS:  # the oldest is a proxy long gone
                self._drop(next(iter(self._sessions)), "too many proxy sessions")
            sock, endpoint, path = bind_session_socket(self._ctx, zmq.PUSH, ipc, self._host,
                                                       self.ipc_dir)
            self._sessions[session] = _Session(sock, endpoint, path)
            fut.set_result(endpoint)
        except Exception as e:  # noqa: BLE001 - handed to the caller (the proxy retries)
            fut.set_exception(e)

    def _send(self, session: str, data: bytes) -> None:
        s = self._sessions.get(session)
        if s is None:  # closed: its requests were aborted
            return
        if s.backlog:
            s.backlog.append(data)
            if len(s.backlog) > self._backlog_messages:
                self._drop(session, f"backlog over {self._backlog_messages} messages")
            return
        try:
            s.sock.send(data, zmq.NOBLOCK, copy=False)
            self.counters["output_messages"] += 1
        except zmq.Again:  # no peer yet (still connecting), or it stopped reading
            s.backlog.append(data)
            s.stalled_since = time.monotonic()

    def _flush_backlogs(self) -> None:
        now = time.monotonic()
        for session, s in list(self._sessions.items()):
            while s.backlog:
                try:
                    s.sock.send(s.backlog[0], zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                s.backlog.popleft()
                self.counters["output_messages"] += 1
                s.stalled_since = now
            if not s.backlog:
                s.stalled_since = None
            elif s.stalled_since is not None and now - s.stalled_since > self._backlog_seconds:
                self._drop(session, f"nothing accepted for {self._backlog_seconds:.1f}s")

    def _stalled(self) -> bool:
        return any(s.backlog for s in self._sessions.values())

    def _drop(self, session: str, why: str, abort: bool = True) -> None:
        s = self._sessions.pop(session, None)
        if s is None:
            return
        s.sock.close(linger=0)
        unlink_quietly(s.ipc_path)
        orphans = [rid for rid, sess in list(self._routes.items()) if sess == session]
        for rid in orphans:
            self._routes.pop(rid, None)
        self.counters["output_sessions_dropped"] += 1
        logger.warning("output session %s closed (%s); aborting %d requests", session, why,
                       len(orphans))
        if orphans and abort:
            self._abort(orphans)
        self._closed(session, why)


def bind_session_socket(ctx: zmq.Context, kind: int, ipc: bool, host: str, ipc_dir: str
                        ) -> tuple[zmq.Socket, str, str | None]:
    """A socket of ``kind`` bound for one proxy session: ipc in ``ipc_dir`` (the proxy is on
    this node) or tcp on ``host`` at a free port. Returns it, its endpoint and its ipc path."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        if ipc:
            path = os.path.join(ipc_dir, f"{_IPC_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}")
            endpoint = f"ipc://{path}"
            sock.bind(endpoint)
            return sock, endpoint, path
        url_host = f"[{host}]" if ":" in host else host
        port = sock.bind_to_random_port(f"tcp://{url_host}")
        return sock, f"tcp://{url_host}:{port}", None
    except BaseException:
        sock.close(linger=0)
        raise


def unlink_quietly(path: str | None) -> None:
    if path is not None:
        try:
            os.unlink(path)
        except OSError:
            pass


def sweep_stale_ipc(directory: str) -> list[str]:
    """Remove the output sessions' ipc socket files in ``directory`` whose process is gone
    (an engine that crashed or was killed closes nothing); returns the paths removed."""
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(_IPC_PREFIX):
            continue
        pid = name[len(_IPC_PREFIX):].split("-", 1)[0]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        path = os.path.join(directory, name)
        try:
            if stat.S_ISSOCK(os.lstat(path).st_mode):
                os.unlink(path)
                removed.append(path)
        except OSError:  # another engine swept it first
            pass
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by someone else
        return True
    return True
