"""The ZMQ pipe's sending half, run on its I/O thread: commands from callers become queued
messages, each data message gets its integrity tag (integrity.py) as it first goes on the
wire, and frames are handed to zmq with backpressure and bounded retries.

Split from zmq_pipe.py (the public API and the I/O loop); both are one object (ZmqPipe).
"""
from __future__ import annotations

import logging
import queue
import time

import zmq

from connectors.pipes.base import PipeError, PipeTimeout
from connectors.pipes.zmq_peers import Outgoing as _Out
from connectors.pipes.zmq_peers import identity as _identity
from pd_cluster.futures import run_into

log = logging.getLogger("connectors.pipes.zmq_pipe")


class ZmqSends:
    """Send-side methods of ZmqPipe (see its __init__ for the attributes)."""

    def _seal(self, s: zmq.Socket, out: _Out) -> bool:
        """Append the data message's integrity tag, here: this thread puts a connection's
        messages on the wire in order, so message numbers are in wire order, and neither
        the forward thread nor the staging thread pays for the MAC."""
        if s is self._router:
            conn = self._conns.get(_identity(out.peer))
            channel = conn.channel if conn is not None else None
        else:
            channel = self._channels.get(out.peer)
        if channel is None:
            self._finish(out, PipeError(f"send to {out.peer!r} failed: unknown or disconnected "
                                        f"peer (no handshake with it)"))
            return False
        tag = channel.seal(out.head, out.payload)
        if tag is not None:
            out.payload = out.payload + [tag]
        return True

    def _drain_cmds(self) -> None:
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "call":
                run_into(cmd[2], cmd[1])  # skipped when its caller gave up waiting
                continue
            out: _Out = cmd[1]
            s = self._dealers.get(out.peer, self._router)
            if s is None:
                self._finish(out, PipeError(f"unknown peer {out.peer!r}: not connected"))
            else:
                self._outq[s].append(out)

    def _flush(self, s: zmq.Socket) -> None:
        q = self._outq[s]
        while q:
            out = q[0]
            if not out.started:
                out.started = True
                if out.future is not None and not out.future.set_running_or_notify_cancel():
                    q.popleft()
                    self._finish(out, None)    # cancelled before it was sent
                    continue
                if out.future is not None and not self._seal(s, out):
                    q.popleft()
                    continue
            frames = [out.head] + out.payload
            if s is self._router:
                frames.insert(0, _identity(out.peer))
            try:   # only a message's first frame can be refused: zmq's HWM counts messages
                s.send(frames[0], zmq.NOBLOCK | (zmq.SNDMORE if len(frames) > 1 else 0))
            except zmq.Again:                  # retried next turn, for send_timeout at most
                if time.monotonic() - out.queued <= self.config.send_timeout:
                    return
                q.popleft()
                self._finish(out, PipeTimeout(f"send to {out.peer!r} not accepted within "
                                              f"{self.config.send_timeout}s (peer gone or "
                                              f"not draining)"))
                continue
            except zmq.ZMQError as e:
                q.popleft()
                why = "unknown or disconnected peer" if e.errno == zmq.EHOSTUNREACH else e
                self._finish(out, PipeError(f"send to {out.peer!r} failed: {why}"))
                continue
            q.popleft()
            try:
                trackers = [s.send(f, zmq.SNDMORE if i < len(frames) - 1 else 0, copy=False,
                                   track=True) for i, f in enumerate(frames) if i]
            except zmq.ZMQError as e:          # SNDTIMEO mid-message: bounded, should not happen
                log.error("zmq pipe: send to %r failed mid-message: %s", out.peer, e)
                self._finish(out, PipeError(f"send to {out.peer!r} failed mid-message: {e}"))
                continue
            self._n["sent"] += out.future is not None
            pending = [t for t in trackers if not t.done]  # frames < 64 KiB were copied: done
            if pending:
                out.tracker = zmq.MessageTracker(*pending)
                self._reaper.add(out)
            else:
                self._finish(out, None)
