"""The token path under injected faults (``engine.faults.token``, test-only; what each kind
means: pd_cluster/faults.py): a FrameSession whose frames are dropped, delayed, corrupted or
whose connection breaks, at a rate. The OutputSender wraps its sessions in it only when the
site has a rate; everything but ``send`` is the session's own."""
from __future__ import annotations

import logging
import socket
from typing import Any

from pd_cluster.fault_sites import FaultSite, flip_bit
from pd_cluster.serving.engine.frame_socket import PREFIX, FrameSession, frame

logger = logging.getLogger(__name__)


class FaultyFrames:
    def __init__(self, session: FrameSession, site: FaultSite):
        self._session, self._site = session, site

    def __getattr__(self, name: str) -> Any:
        if name == "_session":
            raise AttributeError(name)
        return getattr(self._session, name)

    def send(self, payload: bytes, max_pending: int) -> bool:
        kind = self._site.pick(("fail", "drop", "corrupt", "delay"))
        data = frame(payload)
        if kind == "delay":
            self._site.wait()
        elif kind == "corrupt":  # after its CRC was computed: the proxy must refuse it
            data = data[:PREFIX] + flip_bit(data[PREFIX:]) if payload else flip_bit(data)
        elif kind == "fail" and self._break():
            return self._session.send_frame(data, max_pending)
        elif kind is not None:  # dropped (or failed before any proxy connected)
            return False
        return self._session.send_frame(data, max_pending)

    def _break(self) -> bool:
        """The connection breaks as a reset one does (the output thread then closes the
        session and aborts its requests); False: no proxy connected yet."""
        with self._session.lock:
            conn = self._session.conn
            if conn is None:
                return False
            logger.warning("output session %s: breaking its connection (injected fault)",
                           self._session.session)
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        return True
