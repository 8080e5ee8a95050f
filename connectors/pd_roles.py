"""The P/D connector's role as state: flipped in place between producer and consumer, and what
it still holds (so a draining engine can tell when every KV hold is released).

A role switch happens on a drained engine (no request in flight, nothing held): the caches,
the model and the pipe stay; only what the role decides changes. Becoming a consumer makes
the pipe listen (once: a pipe cannot stop listening, so a former consumer keeps its socket
but refuses every new handshake and advertises no endpoint); becoming a producer readies
the sender for the cache's device. Producers linked to a former consumer are told to drop it
by the cluster (the engine no longer advertises its endpoint).
"""
from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

_ROLES = ("producer", "consumer", "both")


class PDRoles:
    """Mixed into PDConnectorWorker (uses its config, pipe, receiver, sender, leases)."""

    config: Any
    pipe: Any
    receiver: Any
    sender: Any
    leases: Any
    hello: dict
    _endpoint: str | None
    _listening: bool

    def endpoint(self) -> str | None:
        """Where producers send this rank's KV; None while it is not a consumer."""
        return self._endpoint if self.config.is_consumer else None

    def set_role(self, role: str) -> str | None:
        """Become ``role`` (producer | consumer | both); returns this rank's endpoint (None
        for a producer). ValueError while it still holds KV of the old role's work."""
        if role not in _ROLES:
            raise ValueError(f"role: expected one of {', '.join(_ROLES)}, got {role!r}")
        held = {k: v for k, v in self.holds().items() if v}
        if held:
            raise ValueError(f"role: cannot switch while KV is held ({held}); drain first")
        self.config = self.config.model_copy(update={"role": role})
        if self.config.is_consumer:
            self._listen()
        if self.config.is_producer and getattr(self, "kv_caches", None):
            self.sender.use_device(self.kv_caches[0].device)
        logger.info("KV connector is now a %s (endpoint %s)", role, self.endpoint())
        return self.endpoint()

    def _listen(self) -> None:
        if self._listening:
            return
        self.pipe.set_handshake_validator(self._validate_hello, info=self.hello)
        self._endpoint = self.pipe.listen()
        self._listening = True

    def _validate_hello(self, hello: dict) -> str | None:
        if not self.config.is_consumer:  # a former consumer: its socket is still bound
            return "this engine is not a KV consumer (its role changed)"
        from connectors.hello import hello_mismatch
        return hello_mismatch(self.hello, hello)

    def holds(self) -> dict[str, int]:
        """What this rank still holds for KV transfers: bytes staged for requests not yet
        registered (and nixl staging ranges granted), requests being received, and finished
        sends whose blocks wait for the consumer's answer (or deferred layers / FINs). All
        zero on an idle engine."""
        in_use = getattr(self.pipe, "staging_in_use", None)  # the nixl pipe's staging ranges
        return {"kv_staging_bytes": int(self.receiver.staging_bytes())
                + (int(in_use()) if in_use is not None else 0),
                "kv_receiving": int(self.receiver.num_receiving()),
                "kv_send_holds": int(self.leases.num_held())
                + len(getattr(self, "_deferred", {})) + len(getattr(self, "_waiting_fins", {}))}
