"""Thread-safe bounded queues shared by the pipes: every wait here has a timeout."""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any, Callable, Optional

from connectors.pipes.base import PipeClosed, PipeTimeout


class InflightGate:
    """Counts bytes handed to a transport and not yet released; acquire() blocks at the cap."""

    def __init__(self, cap: int) -> None:
        self.cap, self.inflight, self.peak = cap, 0, 0
        self._cv = threading.Condition()
        self._closed = False

    def acquire(self, nbytes: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self._cv:
            # A message bigger than the cap still goes when nothing else is in flight (else it
            # could never be sent); otherwise wait for releases.
            while not self._closed and self.inflight > 0 and self.inflight + nbytes > self.cap:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PipeTimeout(f"send blocked {timeout:.1f}s: {self.inflight} bytes in "
                                      f"flight, cap {self.cap} (receiver not draining?)")
                self._cv.wait(left)
            if self._closed:
                raise PipeClosed("pipe is closed")
            self.inflight += nbytes
            self.peak = max(self.peak, self.inflight)

    def release(self, nbytes: int) -> None:
        with self._cv:
            self.inflight -= nbytes
            self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()


class RecvQueue:
    """Received messages not yet taken; `full` tells the reader to stop reading (backpressure)."""

    def __init__(self, cap_bytes: int, on_drained: Callable[[], None]) -> None:
        self.cap, self.nbytes = cap_bytes, 0
        self._q: deque = deque()
        self._cv = threading.Condition()
        self._closed = False
        self._paused = False
        self._on_drained = on_drained   # wakes the reader after it paused on a full queue

    @property
    def full(self) -> bool:
        self._paused = self.nbytes >= self.cap
        return self._paused

    def put(self, item: Any, nbytes: int) -> None:
        with self._cv:
            self._q.append((item, nbytes))
            self.nbytes += nbytes
            self._cv.notify()

    def get(self, timeout: float) -> Any:
        """The oldest item, None on timeout; PipeClosed once closed and empty."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while not self._q:
                if self._closed:
                    raise PipeClosed("pipe is closed")
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cv.wait(left)
            item, n = self._q.popleft()
            self.nbytes -= n
            resume = self._paused and self.nbytes < self.cap
        if resume:
            self._on_drained()
        return item

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()


class ReleaseReaper:
    """A thread that calls finish(item, None) once item.tracker.done (zmq released its memory).

    Items are mostly released in send order, so it waits on the oldest; when that one is stuck
    (slow peer) it sweeps the rest. Closing is two steps: stop() ends the thread, then, once the
    transport has let go of all memory, fail_all() fails the items still held.
    """

    def __init__(self, finish: Callable[[Any, Optional[BaseException]], None],
                 not_done: type[BaseException]) -> None:
        self._finish, self._not_done = finish, not_done
        self._items: deque = deque()
        self._cv = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="pipe-reaper", daemon=True)
        self._thread.start()

    def add(self, item: Any) -> None:
        with self._cv:
            self._items.append(item)
            self._cv.notify()

    def stop(self, timeout: float = 5.0) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout)

    def fail_all(self, exc: BaseException) -> None:
        with self._cv:
            rest, self._items = list(self._items), deque()
        for o in rest:
            self._finish(o, exc)

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._items and not self._stop:
                    self._cv.wait()
                if self._stop:
                    return
                head = self._items[0]
            try:
                head.tracker.wait(0.05)
            except self._not_done:
                pass
            with self._cv:
                done = []
                while self._items and self._items[0].tracker.done:
                    done.append(self._items.popleft())
                if not done:
                    keep: deque = deque()
                    for o in self._items:
                        (done if o.tracker.done else keep).append(o)
                    self._items = keep
            for o in done:
                self._finish(o, None)
