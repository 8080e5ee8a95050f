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
bytes written (written_check.py: AES-GMAC under a one-time key from the connection's
notification key, the write's random nonce and its head; each piece sealed right after its
copy, while in cache); the decode engine checks it over its own blocks before
they count (granted_writes.check_written), so a corrupted or forged write fails the request
closed: recomputed, blocks released. A producer writes only the granted blocks
(granted_writes.py) and only inside the mapped cache (bounds checked here as well).

``extra: {shm_dir: ...}`` moves the files from /dev/shm (both ends must agree).
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Callable, NamedTuple, Optional, Sequence

import msgpack
import numpy as np
import torch

from connectors.pipes.base import (HandshakeError, PipeClosed, PipeConfig, PipeError,
                                   register_pipe)
from connectors.pipes.nixl_layout import CacheLayout
from pd_cluster.futures import settle
from connectors.pipes.shm_arena import SharedCache, host_id, open_peer_cache
from connectors.pipes.written_check import Sealer, WrittenCheck
from connectors.pipes.zmq_pipe import ZmqPipe

SHM_KEY = "_shm"  # in hellos and the consumer's reply
_NOTIF_LABEL = b"pd-cluster shm notifications v1\0"
_CHUNK = 256 << 10  # bytes copied, then sealed while still in cache
# How long the pipe thread lets a notification go before the next copy (see _write): ample
# for a hand-over between threads; a notification stuck behind backpressure keeps its own
# send_timeout, and the copies go on meanwhile as before.
_HANDOFF_WAIT = 0.05


def copy_and_seal(src: torch.Tensor, dst: torch.Tensor, src_ids: list[int],
                  dst_ids: list[int], sealer: Sealer) -> None:
    """Copy blocks ``src_ids`` of every part of ``src`` ([parts, blocks, bytes] uint8, host
    memory) into ``dst_ids`` of ``dst``, feeding ``sealer`` the bytes in block_chunks' order.
    A piece (a run of blocks adjacent in ``src``, at most _CHUNK bytes) goes in one numpy
    call whatever the destination's order (an index array: numpy loops over its blocks in
    C), and is sealed right after, while still in cache: one trip through memory, two Python
    calls per piece. A call per block cost ~1 us each in copies and ~0.7 us in GMAC updates
    (~40 ms of a 16k-token transfer's 24k scattered 16 KiB blocks here). With the GHASH
    kernel (``sealer.fused``): one call, each byte read once, stored and hashed from
    registers (kernels/cpu/ghash_copy.cpp)."""
    if sealer.fused:
        sealer.copy_blocks(src, dst, src_ids, dst_ids)
        return
    src_np, dst_np = src.numpy(), dst.numpy()
    per = max(1, _CHUNK // src.shape[2])
    targets = np.asarray(dst_ids, dtype=np.intp)
    pieces = [(i + j, s + j, min(per, n - j)) for i, s, n in _src_runs(src_ids)
              for j in range(0, n, per)]
    for part in range(src.shape[0]):
        s_part, d_part = src_np[part], dst_np[part]
        for i, s, k in pieces:
            piece = s_part[s:s + k]
            if k == 1:
                d_part[targets[i]] = piece[0]
            else:
                d_part[targets[i:i + k]] = piece
            sealer.update(piece)


class _Remote(NamedTuple):
    layers: list[torch.Tensor]  # per layer [parts, num_blocks, block_bytes] uint8, mapped
    layout: CacheLayout
    key: bytes  # our notifications' key on this connection


@register_pipe("shm")
class ShmPipe(WrittenCheck, ZmqPipe):
    writes_in_place = True  # the connector grants blocks and writes them (granted_writes.py)
    notif_label = _NOTIF_LABEL  # the key of its write notifications' MACs

    control_on_ipc = True  # the auto pipe keeps tcp: producers on other hosts reach it too
    # register_kv_caches may come again with more layers (a draft model's, before any
    # handshake: connectors/draft_layers.py): the cache is shared afresh.
    adds_caches = True

    def __init__(self, config: PipeConfig) -> None:
        if self.control_on_ipc and "transport" not in config.model_fields_set:  # one host
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
        self._pending: set[Future] = set()  # writes not yet settled (close fails them)
        self._queued = 0  # writes submitted and not yet started (see _write's wait)
        self._queued_lock = threading.Lock()

    # ---- set-up ----------------------------------------------------------------------------
    def register_kv_caches(self, caches: Sequence[torch.Tensor]) -> None:
        """A consumer moves its cache into shared memory (once) and answers handshakes with
        where it is; a producer only records its layout (compared at the handshake). Again
        with more layers: shared afresh (the tensors keep their identity and contents)."""
        self._layout = CacheLayout.of(caches)
        self._caches = list(caches)
        if self._shared is not None:
            self._shared.close()
            self._shared = None
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
            # Layers past the other's: a draft model's (draft_layers.py; the target's layer
            # count is the hello's), each checked when written to.
            n = min(len(layout.layers), len(self._layout.layers))
            why = CacheLayout(self._layout.mem, self._layout.layers[:n]).mismatch(
                CacheLayout(layout.mem, layout.layers[:n]))
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
        if kv_layer.device.type != "cpu":
            raise ValueError("kv_transfer.pipe: shm copies from a host-memory KV cache only")
        dst = remote.layers[layer]
        src = kv_layer.reshape(kv_layer.shape[0], kv_layer.shape[1], -1).view(torch.uint8)
        if src.shape[0] != dst.shape[0] or src.shape[2] != dst.shape[2]:
            raise ValueError(f"layer {layer}'s blocks differ from the consumer's")
        src_ids, dst_ids = [int(i) for i in src_ids], [int(i) for i in dst_ids]
        if min(dst_ids) < 0 or max(dst_ids) >= dst.shape[1]:
            raise ValueError(f"block ids out of range 0..{dst.shape[1] - 1}")
        if min(src_ids) < 0 or max(src_ids) >= src.shape[1]:
            raise ValueError("source block ids out of range")
        done: Future = Future()
        self._pending.add(done)
        done.add_done_callback(self._pending.discard)
        with self._queued_lock:
            self._queued += 1
        try:
            self._pool.submit(self._write, peer, remote, src, dst, src_ids, dst_ids, head,
                              done)
        except RuntimeError:  # shut down by close()
            with self._queued_lock:
                self._queued -= 1
            raise PipeClosed("pipe is closed") from None
        return done

    def _write(self, peer: str, remote: _Remote, src: torch.Tensor, dst: torch.Tensor,
               src_ids: list[int], dst_ids: list[int], head: bytes, done: Future) -> None:
        """The pipe thread: copy, seal, queue the notification; ``done`` resolves when the
        notification left."""
        with self._queued_lock:
            self._queued -= 1
        try:
            nonce = os.urandom(16)
            sealer = Sealer(self.config.integrity, remote.key, nonce, head)
            copy_and_seal(src, dst, src_ids, dst_ids, sealer)
            tag = sealer.tag()
            sent = self._notify(peer, {**msgpack.unpackb(head, raw=False), "tag": tag,
                                       "nonce": nonce})
        except Exception as e:
            self._n["shm_write_failures"] += 1
            settle(done, e if isinstance(e, PipeError) else PipeError(
                f"shm write failed: {type(e).__name__}: {e}"))
            return
        self._n["shm_writes"] += 1
        self._n["shm_bytes_written"] += src[:, 0].nbytes * len(src_ids)
        sent.add_done_callback(lambda f: settle(done, PipeClosed("notification cancelled")
                                                if f.cancelled() else f.exception()))
        # With another copy queued, let the I/O thread send this notification first:
        # copy_and_seal holds the GIL (numpy's indexed copy and the GMAC keep it), so that
        # thread would otherwise run only at the next forced switch
        # (sys.getswitchinterval(), 5 ms) or once no copy is queued. Measured:
        # every notification of a 1k-token transfer left after the last copy, and the
        # consumer checked its 12 layers after the copies instead of alongside them. This
        # wait releases the GIL (_HANDOFF_WAIT at most); with nothing queued this thread
        # goes idle, which releases the GIL anyway. With integrity none the consumer has
        # nothing to check: the notifications may go together after the copies (waiting
        # measured slower there), nor with the GHASH kernel, which copies without the GIL:
        # the notification leaves while the next copy runs (a 1k-token transfer's copies
        # ended 3 ms sooner of 13 without the wait, traced).
        with self._queued_lock:
            more = self._queued > 0
        if more and self.config.integrity != "none" and not sealer.fused:
            wait([sent], timeout=_HANDOFF_WAIT)

    def _notify(self, peer: str, header: dict) -> Future:
        """Queue the write's notification (no payload; the send gate bounds the wait)."""
        return self.send_tensor(peer, header, None)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)  # a running copy ends by itself
        for done in list(self._pending):  # never started, or their notification never left
            settle(done, PipeClosed("pipe closed before the write"))
        self._remotes.clear()
        if self._shared is not None:
            self._shared.close()
            self._shared = None
        super().close()


def _src_runs(src: list[int]) -> list[tuple[int, int, int]]:
    """(index in the list, src start, count) of the stretches where the ids ascend by one."""
    out, i = [], 0
    while i < len(src):
        j = i + 1
        while j < len(src) and src[j] == src[j - 1] + 1:
            j += 1
        out.append((i, src[i], j - i))
        i = j
    return out
