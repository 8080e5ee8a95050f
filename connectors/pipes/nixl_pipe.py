"""NIXL pipe (``kv_transfer.pipe: nixl``): the producer WRITEs each layer's blocks straight
into the blocks the decode engine granted for the request (one-sided, no receive copy), over
NIXL's UCX backend: TCP or shared memory between CPU hosts, RDMA / NVLink / CUDA IPC where the
hardware has them (CUDA caches register as VRAM: written, untested here).

Both engines register their whole KV cache with a NIXL agent once (register_kv_caches). The
control messages (OFFER, HOLD with the granted block ids, FIN, ACK, RENEW) go over the ZMQ pipe
this class extends, and so does the handshake: NIXL's metadata crosses only once the cluster
secret was proven (auth.py): the producer's agent name rides in its hello with its proof, the
consumer's agent metadata and cache layout in its reply. Each write carries a NIXL
notification naming the blocks and the MAC of their bytes (written_check.written_code: GMAC,
keys derived from the connection's); the consumer checks it over its own blocks before they count
as received (check_written), so a corrupted or forged write fails the request closed.

What a producer may write: NIXL refuses descriptors outside the memory the consumer
registered (its KV cache and its staging slab, nothing else); within it, the producer writes
only the blocks the consumer granted for the request (checked by connectors/granted_writes.py
before every write), or into the request's staging range (nixl_staging.py: fragmented grants).
"""
from __future__ import annotations

import importlib
from concurrent.futures import Future
from typing import Any, Callable, NamedTuple, Optional, Sequence

import msgpack
import torch

from connectors.pipes import integrity
from connectors.pipes.base import HandshakeError, PipeConfig, PipeError, register_pipe
from connectors.pipes.nixl_layout import CacheLayout, block_chunks
from connectors.pipes.nixl_staging import StagingSlab, copy_and_check, staging_bytes
from connectors.pipes.nixl_worker import NixlWorker, Write
from connectors.pipes.written_check import WrittenCheck
from connectors.pipes.zmq_pipe import ZmqPipe

NIXL_KEY = "_nixl"  # in hellos and the consumer's reply
_NOTIF_LABEL = b"pd-cluster nixl notifications v1\0"
_NOT_CHECKED = integrity.Channel("none")  # notifications carry their own code (check_written)
NEEDS = ("kv_transfer.pipe: nixl needs NIXL: pip install torch==2.13.0 'pd-cluster[nixl]' "
         "(torch first, so the CPU build stays)")


def load_nixl() -> Any:
    """NIXL's Python API (the nixl-cu12 wheel, or nixl-cu13, or a source build's ``nixl``)."""
    for name in ("nixl_cu12", "nixl_cu13", "nixl._api"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise PipeError(NEEDS)


class _Remote(NamedTuple):
    agent: str
    layout: CacheLayout
    key: bytes  # our notifications' key on this connection
    staging: tuple[int, int]  # its staging slab (address, bytes); (0, 0): none


@register_pipe("nixl")
class NixlPipe(WrittenCheck, ZmqPipe):
    writes_in_place = True  # the connector grants blocks and writes them (granted_writes.py)
    notif_label = _NOTIF_LABEL  # the key of its write notifications' MACs
    # A write goes through the consumer's staging range when that saves at least this many
    # UCX descriptors (~10 us each here; the consumer's copy costs ~3 us per 16 KiB block)
    stage_min_saved = 8

    def __init__(self, config: PipeConfig) -> None:
        nixl = load_nixl()  # says what is missing before anything starts
        super().__init__(config)
        try:
            self._agent = nixl.nixl_agent(self._id_base, nixl.nixl_agent_config(
                backends=["UCX"], sync_mode=nixl.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT))
        except Exception as e:
            super().close()
            raise PipeError(f"nixl pipe: no NIXL agent with the UCX backend: {e}") from None
        self._layout: Optional[CacheLayout] = None
        self._registered: Any = None
        self._remotes: dict[str, _Remote] = {}  # consumer address -> its agent and layout
        self._producers: dict[str, str] = {}  # producer agent name -> its peer name here
        self._user_fn: Optional[Callable[[dict], Optional[str]]] = None
        self._user_info: dict = {}
        self._peer_hook = self._on_producer
        self._n.update(nixl_unknown_notifications=0, nixl_staged_writes=0,
                       nixl_staged_bytes=0)
        self._staging_bytes = staging_bytes(config.extra, "DRAM")  # CUDA caches: checked later
        self._slab: Optional[StagingSlab] = None
        self._worker = NixlWorker(self._agent, config.integrity, config.send_timeout,
                                  self._deliver)

    # ---- set-up ----------------------------------------------------------------------------
    def register_kv_caches(self, caches: Sequence[torch.Tensor]) -> None:
        """Register the engine's whole cache (once: a registration per request would cost
        more than the transfer); a consumer then answers handshakes with its metadata."""
        layout = CacheLayout.of(caches)
        self._registered = self._agent.register_memory(layout.regions(), layout.mem)
        self._layout = layout
        self._open_staging()
        super().set_handshake_validator(self._validate, self._reply_info())

    def listen(self) -> str:
        addr = super().listen()
        self._worker.listening = True
        if self._layout is not None and self._open_staging():
            super().set_handshake_validator(self._validate, self._reply_info())
        return addr

    def _open_staging(self) -> bool:
        """A consumer with a host cache registers its staging slab (before its metadata goes
        out: the slab's keys are in it); True when it did now."""
        if (self._slab is not None or not self._worker.listening or self._layout is None
                or self._layout.mem != "DRAM" or self._staging_bytes <= 0):
            return False
        slab = StagingSlab(self._staging_bytes)
        slab.registered = self._agent.register_memory(slab.region(), "DRAM")
        self._slab = slab
        return True

    def set_handshake_validator(self, fn: Optional[Callable[[dict], Optional[str]]],
                                info: Optional[dict] = None) -> None:
        self._user_fn, self._user_info = fn, dict(info or {})
        super().set_handshake_validator(self._validate, self._reply_info())

    def _reply_info(self) -> dict:
        if self._layout is None:
            return self._user_info
        slab = [self._slab.addr, self._slab.size] if self._slab is not None else [0, 0]
        return {**self._user_info, NIXL_KEY: {"md": self._agent.get_agent_metadata(),
                                              "layout": self._layout.encode(),
                                              "staging": slab}}

    def _validate(self, hello: dict) -> Optional[str]:
        """Consumer, I/O thread, after the producer proved the secret."""
        theirs = hello.get(NIXL_KEY)
        if not (isinstance(theirs, dict) and isinstance(theirs.get("agent"), str)):
            return "the prefill engine does not use kv_transfer.pipe: nixl"
        if self._layout is None:
            return "the decode engine's KV cache is not registered with NIXL yet (retry)"
        plain = {k: v for k, v in hello.items() if k != NIXL_KEY}
        return self._user_fn(plain) if self._user_fn is not None else None

    def _on_producer(self, peer: str, hello: dict) -> None:
        """Consumer, I/O thread: notifications from this agent come from ``peer``."""
        self._producers.pop(hello[NIXL_KEY]["agent"], None)
        self._producers[hello[NIXL_KEY]["agent"]] = peer
        while len(self._producers) > 1024:  # producers that came and went
            self._producers.pop(next(iter(self._producers)))

    def connect(self, peer_addr: str, hello: dict) -> dict:
        if self._layout is None:
            raise PipeError("nixl pipe: register the KV caches before connecting")
        reply = super().connect(peer_addr, {**hello, NIXL_KEY: {"agent": self._id_base}})
        info = reply.get("info")
        theirs = info.pop(NIXL_KEY, None) if isinstance(info, dict) else None
        try:
            if not isinstance(theirs, dict):
                raise ValueError("it does not use kv_transfer.pipe: nixl")
            layout = CacheLayout.decode(theirs.get("layout"))
            why = self._layout.mismatch(layout)
            if why is not None:
                raise ValueError(f"its KV cache differs: {why}")
            staging = theirs.get("staging", [0, 0])  # older consumers: none
            if not (isinstance(staging, list) and len(staging) == 2
                    and all(isinstance(v, int) and v >= 0 for v in staging)):
                raise ValueError("malformed staging slab")
            agent = self._agent.add_remote_agent(bytes(theirs["md"]))
        except Exception as e:
            self.disconnect(peer_addr)
            raise HandshakeError(f"{peer_addr}: {e}") from None
        agent = agent.decode() if isinstance(agent, bytes) else str(agent)
        key = self._channels[peer_addr].side_keys(_NOTIF_LABEL)[0]
        self._remotes[peer_addr] = _Remote(agent, layout, key, (staging[0], staging[1]))
        return reply

    def disconnect(self, peer_addr: str) -> None:
        super().disconnect(peer_addr)
        gone = self._remotes.pop(peer_addr, None)
        if gone is not None and all(r.agent != gone.agent for r in self._remotes.values()):
            try:
                self._agent.remove_remote_agent(gone.agent)
            except Exception:
                pass  # never loaded or already gone

    # ---- producer: writes ------------------------------------------------------------------
    def write_blocks(self, peer: str, layer: int, kv_layer: torch.Tensor,
                     src_ids: Sequence[int], dst_ids: Sequence[int], head: bytes,
                     staged_at: int = -1) -> Future:
        """WRITE every part of our blocks ``src_ids`` of ``layer`` into the consumer's
        ``dst_ids``, then notify it with ``head`` and the code of the bytes. The future
        resolves once the write completed (our blocks may change again); ValueError for
        blocks out of range, PipeError for a consumer without a handshake. Blocks
        consecutive on both sides go as one descriptor (CacheLayout.write_descs).
        ``staged_at`` >= 0: the bytes go contiguously into the consumer's staging slab at
        that offset instead (``head`` says so; the consumer copies them into ``dst_ids``)."""
        remote = self._remotes.get(peer)
        if remote is None or self._layout is None:
            raise PipeError(f"nixl pipe: no handshake with {peer}")
        src_ids = list(src_ids)
        if staged_at >= 0:
            need = kv_layer[:, 0].nbytes * len(src_ids)
            if len(src_ids) != len(dst_ids) or staged_at + need > remote.staging[1]:
                raise ValueError(f"a staged write of {need} bytes at {staged_at} does not fit "
                                 f"the consumer's staging slab")
            local, far = self._layout.staged_descs(layer, src_ids,
                                                   remote.staging[0] + staged_at)
            self._n["nixl_staged_writes"] += 1
            self._n["nixl_staged_bytes"] += need
        else:
            local, far = self._layout.write_descs(remote.layout, layer, src_ids, dst_ids)
        return self._worker.submit(Write(
            remote.agent, local, far, self._layout.mem, remote.layout.mem,
            lambda: block_chunks(kv_layer, src_ids), head, remote.key, Future()))

    def staging_plan(self, peer: str, layer: int, src_ids: Sequence[int],
                     dst_ids: Sequence[int]) -> int:
        """Bytes to stage for this write when staging saves ``stage_min_saved`` descriptors
        or more and the consumer has a slab; 0: write directly."""
        remote = self._remotes.get(peer)
        if remote is None or self._layout is None or remote.staging[1] == 0:
            return 0
        local, _ = self._layout.write_descs(remote.layout, layer, list(src_ids), dst_ids)
        staged, _ = self._layout.staged_descs(layer, list(src_ids), 0)
        if len(local) - len(staged) < self.stage_min_saved:
            return 0
        return int(local[:, 1].sum())

    # ---- consumer: staging and notifications -----------------------------------------------
    def grant_staging(self, request_id: str, nbytes: int) -> tuple[int, int] | None:
        """A range of the slab for the request's staged writes (its HOLD names it)."""
        return self._slab.ranges.grant(request_id, nbytes) if self._slab is not None else None

    def release_staging(self, request_id: str) -> None:
        if self._slab is not None:
            self._slab.ranges.release(request_id)

    def staging_in_use(self) -> int:
        return self._slab.ranges.in_use if self._slab is not None else 0

    def copy_staged(self, peer: str, request_id: str, at: int, head: bytes, tag: bytes,
                    nonce: bytes, kv_layer: torch.Tensor, targets: Sequence[int]) -> int:
        """A staged write's bytes into the request's ``targets`` blocks of ``kv_layer``,
        checked over what was copied; the bytes, else ValueError (fail closed)."""
        if self._slab is None:
            raise ValueError("a staged write, but this engine has no staging slab")
        rows = kv_layer.reshape(kv_layer.shape[0], kv_layer.shape[1], -1).view(torch.uint8)
        staged = self._slab.rows(request_id, at, rows.shape[0], len(targets), rows.shape[2])
        key = self.written_key(peer) if self.config.integrity != "none" else b""
        if key is None:
            raise ValueError("no connection with the producer")
        bad = copy_and_check(self.config.integrity, key, nonce, head, tag, staged, rows,
                             targets)
        if bad is not None:
            raise ValueError(f"the staged blocks fail their check ({bad})")
        return staged.numel()

    # ---- consumer: notifications -----------------------------------------------------------
    def _deliver(self, agent: str, msg: bytes) -> None:
        """The pipe thread: a notification becomes a message of the producer's peer (its
        header with the tag); recv_tensor hands it to the connector like any other."""
        peer = self._producers.get(agent)
        try:
            head, nonce, tag = msgpack.unpackb(msg, raw=False)
            body = msgpack.unpackb(head, raw=False)
            if (peer is None or not isinstance(body, dict)
                    or not isinstance(tag, bytes) or not isinstance(nonce, bytes)):
                raise ValueError("unknown agent" if peer is None else "malformed")
        except Exception as e:
            self._n["nixl_unknown_notifications"] += 1
            self._limited.warn("nixl notifications", "nixl pipe: dropped a notification "
                               "from %r: %s", str(agent)[:120], e)
            return
        self._rq.put((peer, {**body, "tag": tag, "nonce": nonce}, None,
                      (_NOT_CHECKED, b"", None)), len(msg))

    def stats(self) -> dict[str, int]:
        return {**super().stats(), "nixl_writes": self._worker.writes,
                "nixl_bytes_written": self._worker.bytes_written,
                "nixl_descriptors": self._worker.descriptors,
                "nixl_write_failures": self._worker.failures,
                "nixl_staging_in_use": self.staging_in_use()}

    def close(self) -> None:
        self._worker.stop()
        for peer in list(self._remotes):
            self._remotes.pop(peer, None)
        if self._registered is not None:
            try:
                self._agent.deregister_memory(self._registered)
            except Exception:
                pass
            self._registered = None
        if self._slab is not None and self._slab.registered is not None:
            try:
                self._agent.deregister_memory(self._slab.registered)
            except Exception:
                pass
            self._slab.registered = None
        super().close()
