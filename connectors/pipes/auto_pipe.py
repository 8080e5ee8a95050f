"""Auto pipe (``kv_transfer.pipe: auto``, the default): each link takes the shm pipe's one copy
into the decode engine's shared cache when its handshake finds both engines on one host with
shared memory usable, and the ZMQ pipe's sends otherwise; the choice and its reason are logged
per link and shown by `pd-cluster status` (the connector's ``kv_links``).

Shared memory is usable when the decode engine could move its KV cache into a file under
/dev/shm (``extra.shm_dir``): a host-memory cache, the folder ours and writable, room for the
whole cache (shm_arena.SharedCache checks each); a decode engine where it is not keeps its cache
and answers every producer over ZMQ, saying why. A producer asks for shared memory only with
its own cache in host memory; the decode engine names its file only to a producer that proved
the cluster secret and says it runs on this host (hostname and boot id), and the producer maps
it only after the shm pipe's checks (open_peer_cache), else the link is ZMQ with that reason.

Control messages travel on the configured transport (tcp unless set), not ipc as under
``pipe: shm``: producers on other hosts reach the same socket. Both kinds of link feed one
consumer: layers sent whole over ZMQ, or written in place and vouched for by a MAC each.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

from connectors.pipes.base import PipeConfig, PipeError, register_pipe
from connectors.pipes.nixl_layout import CacheLayout
from connectors.pipes.shm_arena import SharedCache, open_peer_cache
from connectors.pipes.shm_pipe import _NOTIF_LABEL, SHM_KEY, ShmPipe, _Remote
from connectors.pipes.zmq_pipe import ZmqPipe

log = logging.getLogger(__name__)
SAME_HOST = "both engines on one host, shared memory usable"


@register_pipe("auto")
class AutoPipe(ShmPipe):
    control_on_ipc = False

    def __init__(self, config: PipeConfig) -> None:
        super().__init__(config)
        self._unusable: Optional[str] = None  # consumer: why our cache is not shared
        self._links: dict[str, tuple[str, str]] = {}  # producer: address -> (pipe, why)

    # ---- consumer --------------------------------------------------------------------------
    def _share(self) -> None:
        if (self._listening and self._caches is not None and self._shared is None
                and self._unusable is None):
            try:
                self._shared = SharedCache(self._base, self._caches)
            except (PipeError, OSError, ValueError) as e:  # UnsafePath is an OSError
                self._unusable = str(e)[:300]
                log.warning("kv_transfer.pipe auto: this decode engine's links use zmq, its "
                            "KV cache stays out of shared memory: %s", self._unusable)
            else:
                log.info("kv_transfer.pipe auto: KV cache shared in %s (producers on this "
                         "host write into it)", self._shared.path)
        ZmqPipe.set_handshake_validator(self, self._validate, self._user_info)

    def _reply_info(self) -> dict:
        return self._user_info  # the shared cache's place: per producer, _handshake_info

    def _validate(self, hello: dict) -> Optional[str]:
        """Any producer that proved the secret may link (over shm or zmq: its choice)."""
        plain = {k: v for k, v in hello.items() if k != SHM_KEY}
        return self._user_fn(plain) if self._user_fn is not None else None

    def _handshake_info(self, hello: dict) -> dict:
        """Where our shared cache is, only for a producer on this host that asked for it."""
        theirs = hello.get(SHM_KEY)
        if not isinstance(theirs, dict):
            return self._info  # its cache is not in host memory (or pipe zmq there): zmq
        if theirs.get("host") != self._host:  # another host: ours, so it can say why
            return {**self._info, SHM_KEY: {"host": self._host}}
        shared = self._shared
        if shared is None:
            why = self._unusable or "the KV cache is not in shared memory yet"
            return {**self._info, SHM_KEY: {"host": self._host, "unusable": why}}
        return {**self._info, SHM_KEY: {"host": self._host, "name": shared.name,
                                        "size": shared.size,
                                        "layout": shared.layout.encode()}}

    # ---- producer --------------------------------------------------------------------------
    def connect(self, peer_addr: str, hello: dict) -> dict:
        why = self._not_sharing()
        asked = hello if why is not None else {**hello, SHM_KEY: {"host": self._host}}
        reply = ZmqPipe.connect(self, peer_addr, asked)
        info = reply.get("info")
        theirs = info.pop(SHM_KEY, None) if isinstance(info, dict) else None
        if why is None:
            why = self._map(peer_addr, theirs)
        pipe = "zmq" if why is not None else "shm"
        self._links[peer_addr] = (pipe, why or SAME_HOST)
        log.info("kv_transfer.pipe auto: the link to %s uses %s (%s)", peer_addr, pipe,
                 why or SAME_HOST)
        return reply

    def _not_sharing(self) -> Optional[str]:
        """Why this producer cannot write into a shared cache, or None."""
        if self._caches is None:
            return "the prefill engine registered no KV cache"
        if any(c.device.type != "cpu" for c in self._caches):
            return "the prefill engine's KV cache is not in host memory"
        return None

    def _map(self, peer_addr: str, theirs: Any) -> Optional[str]:
        """Map the consumer's shared cache (None) or say why the link stays zmq."""
        if not isinstance(theirs, dict):
            return "the decode engine does not share its KV cache (its pipe is not auto or shm)"
        if theirs.get("host") != self._host:
            return "the decode engine runs on another host"
        if "unusable" in theirs:
            return f"the decode engine's shared memory is unusable: {str(theirs['unusable'])[:300]}"
        try:
            layout = CacheLayout.decode(theirs.get("layout"))
            mismatch = self._layout.mismatch(layout)  # type: ignore[union-attr]
            if mismatch is not None:
                raise ValueError(f"its KV cache differs: {mismatch}")
            if type(theirs.get("size")) is not int:
                raise ValueError("no cache size")
            layers = open_peer_cache(self._base, theirs.get("name"), theirs["size"], layout)
        except Exception as e:  # noqa: BLE001  (a file we refuse: the link stays zmq)
            return f"the decode engine's shared cache cannot be mapped: {str(e)[:300]}"
        key = self._channels[peer_addr].side_keys(_NOTIF_LABEL)[0]
        self._remotes[peer_addr] = _Remote(layers, layout, key)
        return None

    def writes_to(self, peer_addr: str) -> bool:
        """True: blocks for this consumer are written into its shared cache; False: sent."""
        return peer_addr in self._remotes

    def link(self, peer_addr: str) -> tuple[str, str]:
        """(pipe, why) of the link to a consumer: ("shm" | "zmq", the reason)."""
        return self._links.get(peer_addr, ("zmq", "no handshake yet"))

    def disconnect(self, peer_addr: str) -> None:
        super().disconnect(peer_addr)
        self._links.pop(peer_addr, None)
