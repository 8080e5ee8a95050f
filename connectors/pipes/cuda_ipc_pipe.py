"""CUDA IPC pipe (``kv_transfer.pipe: cuda_ipc``), both engines on one host with their KV
caches on CUDA: the shm pipe's design with device memory. After the handshake (the producer
proved the cluster secret and runs on this host: hostname and boot id, as shm) the decode
engine hands it the CUDA IPC handles of its cache layers (cuda_ipc_handles.py: plain msgpack
fields, never pickle); the producer opens them once per consumer and copies each layer's
granted blocks device to device into them (granted_writes.py decides which; bounds checked
here too). Control messages (OFFER, HOLD, a notification per written layer, FIN, ACK, RENEW)
travel over ZMQ as shm's: grants, leases, FIN and failing closed are shm's, inherited.

Each notification carries a keyed check of the bytes computed on the device
(device_hash.py: a multilinear hash over a prime field under a one-time key per write, from
the connection's notification key, the write's nonce and head); the decode engine recomputes
it over its own blocks before they count, so a corrupted write fails the request closed
(recomputed). integrity: none skips it; mac and crc32 both use this check.

UNVERIFIED ON A GPU until scripts/gpu_check.sh passes its "cuda ipc pipe" row (written without
a GPU; its CPU parts are tested in tests/test_cuda_ipc_pipe.py). Never chosen by ``pipe:
auto``: only an explicit ``kv_transfer.pipe: cuda_ipc``.
"""
from __future__ import annotations

import hmac
import os
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import msgpack
import torch

from connectors.pipes.base import HandshakeError, PipeClosed, PipeError, register_pipe
from connectors.pipes.cuda_ipc_handles import export_layers, open_layer
from connectors.pipes.device_hash import block_rows, device_tag, one_time_seed
from connectors.pipes.nixl_layout import CacheLayout
from connectors.pipes.shm_pipe import ShmPipe, _Remote
from pd_cluster.futures import settle
from connectors.pipes.zmq_peers import identity
from connectors.pipes.zmq_pipe import ZmqPipe

CUDA_KEY = "_cuda_ipc"  # in hellos and the consumer's reply
_NOTIF_LABEL = b"pd-cluster cuda_ipc notifications v1\0"
NOT_ON_CUDA = ("kv_transfer.pipe: cuda_ipc needs the engine's KV cache on CUDA (this one is on "
               "{}); use shm or auto for a host-memory cache")


def require_cuda(caches: Sequence[torch.Tensor]) -> None:
    """ValueError naming kv_transfer.pipe unless every cache layer is a CUDA tensor."""
    kinds = sorted({c.device.type for c in caches}) or ["nothing"]
    if kinds != ["cuda"]:
        raise ValueError(NOT_ON_CUDA.format(", ".join(kinds)))


@register_pipe("cuda_ipc")
class CudaIpcPipe(ShmPipe):
    notif_label = _NOTIF_LABEL
    adds_caches = True  # more layers (a draft's) before any handshake: exported afresh

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self._handles: list[dict] | None = None  # consumer: our layers' handles
        self._n.update(cuda_ipc_writes=0, cuda_ipc_bytes_written=0)

    # ---- set-up ----------------------------------------------------------------------------
    def register_kv_caches(self, caches: Sequence[torch.Tensor]) -> None:
        require_cuda(caches)
        self._layout = CacheLayout.of(caches)
        self._caches = list(caches)
        self._handles = None
        self._share()

    def _share(self) -> None:
        if self._listening and self._caches is not None and self._handles is None:
            self._handles = export_layers(self._caches)
            ZmqPipe.set_handshake_validator(self, self._validate, self._reply_info())

    def _reply_info(self) -> dict:
        if self._handles is None or self._layout is None:
            return self._user_info
        return {**self._user_info, CUDA_KEY: {"host": self._host, "handles": self._handles,
                                              "layout": self._layout.encode()}}

    def _validate(self, hello: dict) -> str | None:
        """Consumer, I/O thread, after the producer proved the secret."""
        theirs = hello.get(CUDA_KEY)
        if not (isinstance(theirs, dict) and isinstance(theirs.get("host"), str)):
            return "the prefill engine does not use kv_transfer.pipe: cuda_ipc"
        if theirs["host"] != self._host:
            return ("the prefill engine runs on another host (kv_transfer.pipe: cuda_ipc needs "
                    "both engines on one host; use nixl or zmq between hosts)")
        if self._handles is None:
            return "the decode engine's KV cache is not exported yet (retry)"
        plain = {k: v for k, v in hello.items() if k != CUDA_KEY}
        return self._user_fn(plain) if self._user_fn is not None else None

    def connect(self, peer_addr: str, hello: dict) -> dict:
        if self._layout is None:
            raise PipeError("cuda_ipc pipe: register the KV caches before connecting")
        reply = ZmqPipe.connect(self, peer_addr, {**hello, CUDA_KEY: {"host": self._host}})
        info = reply.get("info")
        theirs = info.pop(CUDA_KEY, None) if isinstance(info, dict) else None
        try:
            layers, layout = open_remote(theirs, self._host, self._layout)
        except Exception as e:  # noqa: BLE001  (a reply we refuse: no link)
            self.disconnect(peer_addr)
            raise HandshakeError(f"{peer_addr}: {e}") from None
        key = self._channels[peer_addr].side_keys(_NOTIF_LABEL)[0]
        self._remotes[peer_addr] = _Remote(layers, layout, key)
        return reply

    # ---- producer: writes ------------------------------------------------------------------
    def write_blocks(self, peer: str, layer: int, kv_layer: torch.Tensor,
                     src_ids: Sequence[int], dst_ids: Sequence[int], head: bytes) -> Future:
        """As ShmPipe.write_blocks, device to device; the copy waits for the work queued on
        the caller's stream so far (the layer's forward)."""
        remote = self._remotes.get(peer)
        if remote is None:
            raise PipeError(f"cuda_ipc pipe: no handshake with {peer}")
        if kv_layer.device.type != "cuda":
            raise ValueError("kv_transfer.pipe: cuda_ipc copies from a CUDA KV cache only")
        src_ids, dst_ids = [int(i) for i in src_ids], [int(i) for i in dst_ids]
        src = kv_layer.reshape(kv_layer.shape[0], kv_layer.shape[1], -1).view(torch.uint8)
        check_write(remote.layers, layer, src, src_ids, dst_ids)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(kv_layer.device))
        done: Future = Future()
        self._pending.add(done)
        done.add_done_callback(self._pending.discard)
        try:
            self._pool.submit(self._copy, peer, remote, src, remote.layers[layer], src_ids,
                              dst_ids, head, ready, done)
        except RuntimeError:  # shut down by close()
            raise PipeClosed("pipe is closed") from None
        return done

    def _copy(self, peer: str, remote: _Remote, src: torch.Tensor, dst: torch.Tensor,
              src_ids: list[int], dst_ids: list[int], head: bytes, ready: Any,
              done: Future) -> None:
        """The pipe thread: copy, synchronise (the bytes are in place before the
        notification says so), tag the source bytes, queue the notification."""
        try:
            ready.synchronize()
            rows = block_rows(src, src_ids)
            with torch.cuda.device(dst.device):
                idx = torch.tensor(dst_ids, dtype=torch.int64, device=dst.device)
                for part, piece in enumerate(rows):
                    dst[part].index_copy_(0, idx, piece.to(dst.device))
                torch.cuda.current_stream(dst.device).synchronize()
            nonce = os.urandom(16)
            tag = (b"" if self.config.integrity == "none"
                   else device_tag(rows, one_time_seed(remote.key, nonce, head)))
            sent = self._notify(peer, {**msgpack.unpackb(head, raw=False), "tag": tag,
                                       "nonce": nonce})
        except Exception as e:  # noqa: BLE001  (any failure fails the write, said)
            self._n["shm_write_failures"] += 1
            settle(done, e if isinstance(e, PipeError) else PipeError(
                f"cuda_ipc write failed: {type(e).__name__}: {e}"))
            return
        self._n["cuda_ipc_writes"] += 1
        self._n["cuda_ipc_bytes_written"] += src[:, 0].nbytes * len(src_ids)
        sent.add_done_callback(lambda f: settle(done, PipeClosed("notification cancelled")
                                                if f.cancelled() else f.exception()))

    # ---- consumer: checks ------------------------------------------------------------------
    def check_written(self, peer: str, head: bytes, chunks: list[Any], tag: bytes,
                      nonce: bytes) -> str | None:
        """Why our granted blocks (``chunks``: device tensors, granted_writes asks for them
        by ``on_device``) are not what the producer wrote, or None."""
        if self.config.integrity == "none":
            return None
        conn = self._conns.get(identity(peer))
        if conn is None:
            return "no connection with the producer"
        key = conn.channel.side_keys(_NOTIF_LABEL)[1]
        if not hmac.compare_digest(device_tag(chunks, one_time_seed(key, nonce, head)), tag):
            return "device hash mismatch"
        return None

    check_written.on_device = True  # type: ignore[attr-defined]

    def close(self) -> None:
        super().close()
        self._handles = None


def open_remote(theirs: Any, host: str, ours: CacheLayout
                ) -> tuple[list[torch.Tensor], CacheLayout]:
    """The consumer's layers, opened from its reply (ValueError saying why not)."""
    if not isinstance(theirs, dict):
        raise ValueError("it does not use kv_transfer.pipe: cuda_ipc")
    if theirs.get("host") != host:
        raise ValueError("it runs on another host (kv_transfer.pipe: cuda_ipc needs one)")
    layout = CacheLayout.decode(theirs.get("layout"))
    n = min(len(layout.layers), len(ours.layers))  # past n: a draft's layers (as shm)
    why = CacheLayout(ours.mem, ours.layers[:n]).mismatch(CacheLayout(layout.mem,
                                                                      layout.layers[:n]))
    if why is not None:
        raise ValueError(f"its KV cache differs: {why}")
    handles = theirs.get("handles")
    if not isinstance(handles, list) or len(handles) != len(layout.layers):
        raise ValueError("no CUDA handle per layer")
    return [open_layer(h, lay.parts, lay.num_blocks, lay.block_bytes)
            for h, lay in zip(handles, layout.layers)], layout


def check_write(layers: list[torch.Tensor], layer: int, src: torch.Tensor,
                src_ids: list[int], dst_ids: list[int]) -> None:
    """ValueError for a write outside the consumer's cache or our own."""
    if len(src_ids) != len(dst_ids) or not src_ids:
        raise ValueError("source and destination blocks differ in number")
    if not 0 <= layer < len(layers):
        raise ValueError(f"layer {layer} out of range")
    dst = layers[layer]
    if src.shape[0] != dst.shape[0] or src.shape[2] != dst.shape[2]:
        raise ValueError(f"layer {layer}'s blocks differ from the consumer's")
    if min(dst_ids) < 0 or max(dst_ids) >= dst.shape[1]:
        raise ValueError(f"block ids out of range 0..{dst.shape[1] - 1}")
    if min(src_ids) < 0 or max(src_ids) >= src.shape[1]:
        raise ValueError("source block ids out of range")
