"""The consumer's check of a one-sided write (nixl, shm): the MAC its notification carries,
recomputed over the bytes now in our granted blocks under the connection's notification key.
Each pipe names its key label and its MAC function (nixl: Poly1305, shm: AES-GMAC)."""
from __future__ import annotations

import hmac
from typing import Any, Callable, Optional

from connectors.pipes.zmq_peers import identity

WrittenMac = Callable[[str, bytes, bytes, bytes, list[Any]], bytes]


class WrittenCheck:
    """Mixin for a ZmqPipe subclass: set ``notif_label`` and ``written_mac``."""
    notif_label: bytes
    written_mac: WrittenMac

    def check_written(self, peer: str, head: bytes, chunks: list[Any], tag: bytes,
                      nonce: bytes) -> Optional[str]:
        """Why the bytes a producer's notification vouches for are not what it wrote (None:
        they are). Called by the connector with the bytes in our granted blocks."""
        if self.config.integrity == "none":  # type: ignore[attr-defined]
            return None
        conn = self._conns.get(identity(peer))  # type: ignore[attr-defined]
        if conn is None:
            return "no connection with the producer"
        key = conn.channel.side_keys(self.notif_label)[1]
        want = type(self).written_mac(self.config.integrity, key, nonce,  # type: ignore[attr-defined]
                                      head, chunks)
        if not hmac.compare_digest(want, tag):
            return f"{self.config.integrity} mismatch"  # type: ignore[attr-defined]
        return None
