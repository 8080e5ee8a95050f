"""The nixl pipe's one thread: posts WRITEs (each with its notification, sealed here, off the
forward thread), polls them to completion within a bound, and hands the notifications that
arrive to the pipe. NIXL's agent runs its own progress thread; this one only polls."""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, NamedTuple

import msgpack
import numpy as np

from connectors.pipes.base import PipeClosed, PipeError, PipeTimeout
from pd_cluster.futures import settle
from connectors.pipes.written_check import written_code

log = logging.getLogger(__name__)


def new_nonce() -> bytes:
    return os.urandom(16)


class Write(NamedTuple):
    remote_agent: str
    local: np.ndarray  # Nx3 descriptors (nixl_layout.CacheLayout.descs)
    remote: np.ndarray
    local_mem: str
    remote_mem: str
    chunks: Callable[[], list[Any]]  # the source bytes, for the tag
    head: bytes
    key: bytes
    future: Future


class NixlWorker:
    def __init__(self, agent: Any, mode: str, timeout: float,
                 on_notif: Callable[[str, bytes], None]) -> None:
        self._agent, self._mode, self._timeout = agent, mode, timeout
        self._on_notif = on_notif
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._inflight: list[tuple[Write, Any, float]] = []  # (write, handle, deadline)
        self.listening = False  # a consumer: poll for notifications
        self.writes = self.bytes_written = self.failures = 0
        self.descriptors = 0  # of the writes done: fewer than blocks where runs coalesced
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="nixl-pipe", daemon=True)
        self._thread.start()

    def submit(self, job: Write) -> Future:
        if self._stop.is_set():
            raise PipeClosed("pipe is closed")
        self._jobs.put(job)
        return job.future

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(self._timeout + 5)
        while True:  # what never went out
            try:
                settle(self._jobs.get_nowait().future, PipeClosed("pipe closed before the write"))
            except queue.Empty:
                break

    # ---- the thread ------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                busy = bool(self._inflight)
                wait = 0 if busy else (0.001 if self.listening else 0.05)
                try:
                    self._post(self._jobs.get(timeout=wait) if wait else self._jobs.get_nowait())
                    while True:
                        self._post(self._jobs.get_nowait())
                except queue.Empty:
                    pass
                progressed = self._poll()
                if self.listening:
                    for agent, msgs in self._agent.get_new_notifs().items():
                        for m in msgs:
                            self._on_notif(agent, m)
                if busy and not progressed:
                    time.sleep(0.0001)  # writes on the wire: poll again soon, not in a spin
        except Exception:
            log.exception("nixl pipe thread crashed")
        finally:
            for job, handle, _ in self._inflight:
                self._release(handle)
                settle(job.future, PipeClosed("pipe closed during the write"))
            self._inflight = []

    def _post(self, job: Write) -> None:
        if job.future.done():
            return
        try:
            nonce = new_nonce()
            tag = written_code(self._mode, job.key, nonce, job.head, job.chunks())
            notif = msgpack.packb([job.head, nonce, tag], use_bin_type=True)
            handle = self._agent.initialize_xfer(
                "WRITE", self._agent.get_xfer_descs(job.local, job.local_mem),
                self._agent.get_xfer_descs(job.remote, job.remote_mem), job.remote_agent, notif)
            state = self._agent.transfer(handle)
        except Exception as e:
            self.failures += 1
            settle(job.future, PipeError(f"nixl write not posted: {type(e).__name__}: {e}"))
            return
        self._inflight.append((job, handle, time.monotonic() + self._timeout))
        if state == "ERR":
            self._poll()

    def _poll(self) -> bool:
        """Settle the writes that ended; True when any did."""
        keep, now = [], time.monotonic()
        for job, handle, deadline in self._inflight:
            try:
                state = self._agent.check_xfer_state(handle)
            except Exception as e:
                state, err = "ERR", e
            else:
                err = None
            if state == "PROC" and now < deadline:
                keep.append((job, handle, deadline))
                continue
            self._release(handle)
            if state == "DONE":
                self.writes += 1
                self.bytes_written += int(job.local[:, 1].sum())
                self.descriptors += len(job.local)
                settle(job.future)
            else:
                self.failures += 1
                settle(job.future, PipeTimeout(f"nixl write still pending after "
                                               f"{self._timeout:.1f}s") if state == "PROC"
                       else PipeError(f"nixl write failed{f': {err}' if err else ''}"))
        ended = len(keep) != len(self._inflight)
        self._inflight = keep
        return ended

    def _release(self, handle: Any) -> None:
        try:  # an unfinished one is aborted by the release
            self._agent.release_xfer_handle(handle)
        except Exception as e:
            log.warning("nixl pipe: releasing a transfer handle failed: %s", e)
