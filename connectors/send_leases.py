"""Producer state of the P/D connector after a request's FIN: its blocks are held under a lease.

The consumer renews the lease of every request it is still receiving (a RENEW message every
``ttl / 3``); the producer frees a request's blocks when the consumer ACKs (done), NACKs (it
gave up or aborted), or stops renewing for ``ttl`` (it is gone) - not after a fixed hold that
is too short for a slow consumer and far too long for a dead one (vLLM #53095).
"""
from __future__ import annotations

import logging
import threading
import time

logger = logging.getLogger(__name__)


class SendLeases:
    def __init__(self, ttl: float):
        self.ttl = ttl
        self._lock = threading.Lock()
        self._expires: dict[str, float] = {}  # request id -> monotonic lease end
        self._started: dict[str, float] = {}  # request id -> first KV sent (for send_seconds)
        self._waiting: dict[str, int] = {}  # request id -> consumer ranks yet to ACK
        self._done: set[str] = set()
        self.send_seconds = 0.0  # first layer sent to the consumer's ACK, summed
        self.num_expired = 0

    def sending(self, request_id: str) -> None:
        with self._lock:
            self._started.setdefault(request_id, time.monotonic())

    def hold(self, request_id: str, answers: int = 1) -> None:
        """The FIN went out (to ``answers`` consumer ranks): keep the blocks until each
        answered, one NACKed, or they stop renewing."""
        with self._lock:
            self._expires[request_id] = time.monotonic() + self.ttl
            self._waiting[request_id] = answers

    def renew(self, request_ids: list[str]) -> None:
        end = time.monotonic() + self.ttl
        with self._lock:
            for rid in request_ids:
                if rid in self._expires:
                    self._expires[rid] = end

    def release(self, request_id: str, ok: bool) -> None:
        """ACK (ok) or NACK from the consumer; unknown ids (late replies) are ignored."""
        with self._lock:
            if request_id not in self._expires:
                return
            left = self._waiting.get(request_id, 1) - 1
            if ok and left > 0:
                self._waiting[request_id] = left
                return
            del self._expires[request_id]
            self._waiting.pop(request_id, None)
            started = self._started.pop(request_id, None)
            if ok and started is not None:
                self.send_seconds += time.monotonic() - started
            self._done.add(request_id)

    def num_held(self) -> int:
        """Finished sends whose blocks still wait for the consumer's answer."""
        with self._lock:
            return len(self._expires)

    def drop(self, request_id: str) -> None:
        """Nothing to wait for (the send failed, or no consumer can answer): free now."""
        with self._lock:
            self._expires.pop(request_id, None)
            self._waiting.pop(request_id, None)
            self._started.pop(request_id, None)
            self._done.add(request_id)

    def take_done(self) -> set[str]:
        """Requests whose blocks may be freed now (answered, dropped, or lease expired)."""
        now = time.monotonic()
        with self._lock:
            for rid in [r for r, end in self._expires.items() if now > end]:
                logger.warning("KV lease of %s expired (consumer silent for %.1fs): freeing its "
                               "blocks", rid, self.ttl)
                self.num_expired += 1
                del self._expires[rid]
                self._waiting.pop(rid, None)
                self._started.pop(rid, None)
                self._done.add(rid)
            done, self._done = self._done, set()
            return done
