"""Shared-memory pipe (``kv_transfer.pipe: shm``), both engines on one host: the decode
engine's KV cache lives in a shared file (shm_arena.py); the prefill engine maps it after the
handshake and copies each layer's blocks straight into the blocks the decode engine granted
for the request (one copy, no socket, no staging). Only control messages (OFFER, HOLD, a
notification per written layer, FIN, ACK, RENEW) travel, over the ZMQ pipe this class
extends, on its ipc transport unless ``transport`` is set.

The handshake is the ZMQ pipe's: the file's name and the cache layout go to a producer only
after it proved the cluster secret (auth.py), and only to one on this host (hostname and
boot id in its hello). A producer maps only a file of its own user's 0700 folder, 0600 and
of the announced size (open_peer_cache). Each write's notification carries a MAC of the
bytes written (AES-GMAC under a one-time key from the connection's notification key, the
write's random nonce and its head); the decode engine checks it over its own blocks before
they count (granted_writes.check_written), so a corrupted or forged write fails the request
closed: recomputed, blocks released. A producer writes only the granted blocks
(granted_writes.py) and only inside the mapped cache (bounds checked here as well).

``extra: {shm_dir: ...}`` moves the files from /dev/shm (both ends must agree).
"""
from __future__ import annotations

import hashlib
import hmac
import os
import struct
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, NamedTuple, Optional, Sequence

import msgpack
import torch

from connectors.pipes import integrity
from connectors.pipes.base import (HandshakeError, PipeClosed, PipeConfig, PipeError,
                                   register_pipe)
from connectors.pipes.nixl_layout import CacheLayout, block_chunks
from connectors.pipes.nixl_worker import written_tag as crc_or_none_tag
from connectors.pipes.shm_arena import SharedCache, host_id, open_peer_cache
from connectors.pipes.zmq_peers import identity
from connectors.pipes.zmq_pipe import ZmqPipe

SHM_KEY = "_shm"  # in hellos and the consumer's reply
_NOTIF_LABEL = b"pd-cluster shm notifications v1\0"
_MAC_LABEL = b"pd-cluster shm written v1\0"


def written_code(mode: str, key: bytes, nonce: bytes, head: bytes, chunks: list[Any]) -> bytes:
    """The code of a write. mac: AES-GMAC over every byte written under a one-time key,
    HMAC-SHA256 (the connection's notification key) of the write's random nonce and head
    (request, layer, blocks), so the GMAC nonce can be fixed: GHASH runs at 12-14 GB/s per
    core here (integrity.py), the copy's pace. crc32 / none: as the nixl pipe's."""
    if mode != "mac":
        return crc_or_none_tag(mode, key, nonce, head, chunks)
    once = hmac.new(key, _MAC_LABEL + struct.pack("<Q", len(head)) + nonce + head,
                    hashlib.sha256).digest()
    return integrity.gmac(once, 0, chunks)


class _Remote(NamedTuple):
    layers: list[torch.Tensor]  # per layer [parts, num_blocks, block_bytes] uint8, mapped
    layout: CacheLayout
    key: bytes  # our notifications' key on this connection


@register_pipe("shm")
class ShmPipe(ZmqPipe):
    writes_in_place = True  # the connector grants blocks and writes them (granted_writes.py)

    def __init__(self, config: PipeConfig) -> None:
        if "transport" not in config.model_fields_set:  # one host: control messages on ipc
            config = config.model_copy(update={"transport": "ipc"})
        super().__init__(config)
        self._base = str(config.extra.get("shm_dir", "/dev/shm"))
        self._host = host_id()
        self._layout: Optional[CacheLayout] = None
        self._caches: Optional[list[torch.Tensor]] = None
        self._shared: Optional[SharedCache] = None
        self._listening = False
        self._remotes: dict[str, _Remote] = {}  # consumer address -> its mapped cache
        self._user_fn: Optional[Callable[[dict], Optional[str]]] = None
        self._user_info: dict = {}
        self._n.update(shm_writes=0, shm_bytes_written=0, shm_write_failures=0)
        # One thread copies and seals, off the forward thread, in submission order (so a
        # layer's notification precedes the FIN sent after its future).
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="shm-pipe")

    # ---- set-up ----------------------------------------------------------------------------
    def register_kv_caches(self, caches: Sequence[torch.Tensor]) -> None:
        """A consumer moves its cache into shared memory (once) and answers handshakes with
        where it is; a producer only records its layout (compared at the handshake)."""
        self._layout = CacheLayout.of(caches)
        self._caches = list(caches)
        self._share()

    def listen(self) -> str:
        addr = super().listen()
        self._listening = True
        self._share()
        return addr

    def _share(self) -> None:
        if self._listening and self._caches is not None and self._shared is None:
            self._shared = SharedCache(self._base, self._caches)
            super().set_handshake_validator(self._validate, self._reply_info())

    def set_handshake_validator(self, fn: Optional[Callable[[dict], Optional[str]]],
                                info: Optional[dict] = None) -> None:
        self._user_fn, self._user_info = fn, dict(info or {})
        super().set_handshake_validator(self._validate, self._reply_info())

    def _reply_info(self) -> dict:
        if self._shared is None:
            return self._user_info
        return {**self._user_info, SHM_KEY: {
            "host": self._host, "name": self._shared.name, "size": self._shared.size,
            "layout": self._shared.layout.encode()}}

    def _validate(self, hello: dict) -> Optional[str]:
        """Consumer, I/O thread, after the producer proved the secret."""
        theirs = hello.get(SHM_KEY)
        if not (isinstance(theirs, dict) and isinstance(theirs.get("host"), str)):
            return "the prefill engine does not use kv_transfer.pipe: shm"
        if theirs["host"] != self._host:
            return ("the prefill engine runs on another host (kv_transfer.pipe: shm needs both "
                    "engines on one host; use zmq or nixl between hosts)")
        if self._shared is None:
            return "the decode engine's KV cache is not in shared memory yet (retry)"
        plain = {k: v for k, v in hello.items() if k != SHM_KEY}
        return self._user_fn(plain) if self._user_fn is not None else None

    def connect(self, peer_addr: str, hello: dict) -> dict:
        if self._layout is None:
            raise PipeError("shm pipe: register the KV caches before connecting")
        reply = super().connect(peer_addr, {**hello, SHM_KEY: {"host": self._host}})
        info = reply.get("info")
        theirs = info.pop(SHM_KEY, None) if isinstance(info, dict) else None
        try:
            if not isinstance(theirs, dict):
                raise ValueError("it does not use kv_transfer.pipe: shm")
            if theirs.get("host") != self._host:
                raise ValueError("it runs on another host (kv_transfer.pipe: shm needs one)")
            layout = CacheLayout.decode(theirs.get("layout"))
            why = self._layout.mismatch(layout)
            if why is not None:
                raise ValueError(f"its KV cache differs: {why}")
            size = theirs.get("size")
            if type(size) is not int:
                raise ValueError("no cache size")
            layers = open_peer_cache(self._base, theirs.get("name"), size, layout)
        except Exception as e:  # a consumer's reply, or a file we refuse: no link
            self.disconnect(peer_addr)
            raise HandshakeError(f"{peer_addr}: {e}") from None
        key = self._channels[peer_addr].side_keys(_NOTIF_LABEL)[0]
        self._remotes[peer_addr] = _Remote(layers, layout, key)
        return reply

    def disconnect(self, peer_addr: str) -> None:
        super().disconnect(peer_addr)
        self._remotes.pop(peer_addr, None)  # the map goes with its last view

    # ---- producer: writes ------------------------------------------------------------------
    def write_blocks(self, peer: str, layer: int, kv_layer: torch.Tensor,
                     src_ids: Sequence[int], dst_ids: Sequence[int], head: bytes) -> Future:
        """Copy every part of our blocks ``src_ids`` of ``layer`` into the consumer's
        ``dst_ids``, then notify it with ``head`` and the code of the bytes. The future
        resolves once the copy is done and the notification queued; ValueError for blocks
        out of range, PipeError for a consumer without a handshake."""
        remote = self._remotes.get(peer)
        if remote is None:
            raise PipeError(f"shm pipe: no handshake with {peer}")
        if len(src_ids) != len(dst_ids) or not src_ids:
            raise ValueError("source and destination blocks differ in number")
        if not 0 <= layer < len(remote.layers):
            raise ValueError(f"layer {layer} out of range")
        dst = remote.layers[layer]
        src = kv_layer.reshape(kv_layer.shape[0], kv_layer.shape[1], -1).view(torch.uint8)
        if src.shape[0] != dst.shape[0] or src.shape[2] != dst.shape[2]:
            raise ValueError(f"layer {layer}'s blocks differ from the consumer's")
        src_ids, dst_ids = [int(i) for i in src_ids], [int(i) for i in dst_ids]
        if min(dst_ids) < 0 or max(dst_ids) >= dst.shape[1]:
            raise ValueError(f"block ids out of range 0..{dst.shape[1] - 1}")
        if min(src_ids) < 0 or max(src_ids) >= src.shape[1]:
            raise ValueError("source block ids out of range")
        try:
            return self._pool.submit(self._write, peer, remote, src, dst, src_ids, dst_ids,
                                     kv_layer, head)
        except RuntimeError:  # shut down by close()
            raise PipeClosed("pipe is closed") from None

    def _write(self, peer: str, remote: _Remote, src: torch.Tensor, dst: torch.Tensor,
               src_ids: list[int], dst_ids: list[int], kv_layer: torch.Tensor,
               head: bytes) -> None:
        try:
            for s, d, n in _runs(src_ids, dst_ids):  # one copy per run of adjacent blocks
                dst[:, d:d + n].copy_(src[:, s:s + n])
            nonce = os.urandom(16)
            tag = written_code(self.config.integrity, remote.key, nonce, head,
                               block_chunks(kv_layer, src_ids))
            self._notify(peer, {**msgpack.unpackb(head, raw=False), "tag": tag,
                                "nonce": nonce})
        except Exception as e:
            self._n["shm_write_failures"] += 1
            raise e if isinstance(e, PipeError) else PipeError(
                f"shm write failed: {type(e).__name__}: {e}") from None
        self._n["shm_writes"] += 1
        self._n["shm_bytes_written"] += src[:, 0].nbytes * len(src_ids)

    def _notify(self, peer: str, header: dict) -> None:
        """The write's notification, queued behind nothing of ours (no payload); a consumer
        that stopped reading fails it within send_timeout."""
        self.send_tensor(peer, header, None).result(timeout=self.config.send_timeout + 5)

    # ---- consumer: checks ------------------------------------------------------------------
    def check_written(self, peer: str, head: bytes, chunks: list[Any], tag: bytes,
                      nonce: bytes) -> Optional[str]:
        """Why the bytes a producer's notification vouches for are not what it wrote (None:
        they are). Called by the connector with the bytes in our granted blocks."""
        if self.config.integrity == "none":
            return None
        conn = self._conns.get(identity(peer))
        if conn is None:
            return "no connection with the producer"
        key = conn.channel.side_keys(_NOTIF_LABEL)[1]
        want = written_code(self.config.integrity, key, nonce, head, chunks)
        if not hmac.compare_digest(want, tag):
            return f"{self.config.integrity} mismatch"
        return None

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)  # each write bounded by send_timeout
        self._remotes.clear()
        if self._shared is not None:
            self._shared.close()
            self._shared = None
        super().close()


def _runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(src start, dst start, count) of the stretches where both id lists ascend by one."""
    out, i = [], 0
    while i < len(src):
        j = i + 1
        while j < len(src) and src[j] == src[j - 1] + 1 and dst[j] == dst[j - 1] + 1:
            j += 1
        out.append((src[i], dst[i], j - i))
        i = j
    return out
