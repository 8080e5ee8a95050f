"""Request fields the server does not know are ignored and logged once per name, as vLLM does
(clients send store, metadata, service_tier, ...). What is remembered is bounded: at most
``max_names`` names, each cut to _NAME_CHARS; once that many were seen, a new name is logged
at DEBUG only, so a client that makes names up costs neither memory nor log lines."""
from __future__ import annotations

import logging
from typing import Iterable

logger = logging.getLogger(__name__)

MAX_NAMES = 256
_NAME_CHARS = 64


class UnknownFields:
    def __init__(self, max_names: int = MAX_NAMES):
        self.max_names = max_names
        self._seen: set[str] = set()

    def __len__(self) -> int:
        return len(self._seen)

    def note(self, names: Iterable[str], prefix: str = "") -> None:
        """Log the names in ``names`` (under ``prefix``) not logged before."""
        new = sorted({f"{prefix}{name}"[:_NAME_CHARS] for name in names} - self._seen)
        if not new:
            return
        room = max(self.max_names - len(self._seen), 0)
        logged, rest = new[:room], new[room:]
        if logged:
            self._seen.update(logged)
            logger.warning("ignoring request field(s) this server does not know: %s "
                           "(logged once per name)", ", ".join(logged))
            if len(self._seen) >= self.max_names:
                logger.warning("%d unknown field names logged: further ones are logged at "
                               "DEBUG only", self.max_names)
        if rest:
            logger.debug("ignoring request field(s) this server does not know: %s",
                         ", ".join(rest))
