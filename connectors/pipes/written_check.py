"""The code of a one-sided write (nixl, shm): what the producer's notification carries and the
consumer recomputes over the bytes now in its granted blocks, under the connection's
notification key (each pipe derives its own: ``notif_label``).

One MAC for both pipes: AES-GMAC under a one-time key, HMAC-SHA256 (the notification
key) of the write's random nonce and head (request, layer, blocks), so the GMAC nonce can be
fixed. Measured on this project's CPU machine (one core, 256 KiB / 16 KiB updates): GMAC 10.0 /
8.9 GB/s, Poly1305 (the nixl pipe's until then) 6.3 / 5.5, BLAKE3 keyed 5.0 / 4.5 (the
``blake3`` package; 7.5 with two threads), HMAC-SHA256 1.4, keyed BLAKE2b 0.75, a memcpy 4.7.
Where the MAC runs: the shm producer seals each 256 KiB piece right after copying it, while
in cache (shm_pipe.copy_and_seal). Sealing the source on a second thread while the first
copies (OpenSSL and numpy both release the GIL) was tried and measured worse on this 2-core
machine (shm_efficiency 0.29 against 0.45 in-pass, runs half an hour apart): with the
consumer checking on the other core, three streams share two cores. With the CPU kernels
(kernels/ghash_copy.py) the copy and the hash are one pass (GHASH on VPCLMULQDQ, tags equal
to OpenSSL's GMAC): shm_efficiency 0.248 / 0.284 without -> 0.365 / 0.363 with, two
alternating runs here (4.3-5.2 against 2.5-3.8 GB/s at 16k tokens).

crc32: CRC-32 over the head and the bytes (accidents only). none: nothing. No message
number: the head names the request's blocks and the bytes are in them, so a replayed
notification vouches only for what is there.
"""
from __future__ import annotations

import hashlib
import hmac
import struct
import zlib
from typing import Any, Iterable, Optional

from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from connectors.pipes.zmq_peers import identity
from kernels import ghash_copy

# v2: GMAC for nixl too (v1 was Poly1305 there); a mixed pair fails its writes closed
_MAC_LABEL = b"pd-cluster written v2\0"


class _OpenSslGmac:
    """OpenSSL's AES-GMAC (nonce 0) with ghash_copy.Gmac's interface: update, tag."""

    def __init__(self, key: bytes) -> None:
        self._enc = Cipher(algorithms.AES(key), modes.GCM(bytes(12))).encryptor()

    def update(self, chunk: Any) -> None:
        self._enc.authenticate_additional_data(chunk)

    def tag(self) -> bytes:
        self._enc.finalize()
        return self._enc.tag


class Sealer:
    """The code of a write, fed in pieces (the bytes in order: part by part, blocks in
    order, as nixl_layout.block_chunks lists them). In mode mac with the GHASH kernel
    (kernels/ghash_copy.py) ``fused`` is set: copy_blocks / hash_blocks take whole layers in
    one call; the tags are OpenSSL's either way."""

    def __init__(self, mode: str, key: bytes, nonce: bytes, head: bytes) -> None:
        self._mode = mode
        self.fused = False
        prefix = _MAC_LABEL + struct.pack("<Q", len(head))
        if mode == "mac":
            once = hmac.new(key, prefix + nonce + head, hashlib.sha256).digest()
            self.fused = ghash_copy.available()
            self._mac: Any = (ghash_copy.Gmac(once, bytes(12)) if self.fused else
                              _OpenSslGmac(once))
        self._crc = zlib.crc32(head, zlib.crc32(prefix)) if mode == "crc32" else 0

    def copy_blocks(self, src: Any, dst: Any, src_ids: list[int], dst_ids: list[int]) -> None:
        """Copy ``src[p, src_ids[i]]`` to ``dst[p, dst_ids[i]]`` and feed the bytes, in one
        pass (only when ``fused``)."""
        self._mac.copy_blocks(src, dst, src_ids, dst_ids)

    def hash_blocks(self, rows: Any, ids: list[int]) -> None:
        """Feed ``rows[p, ids[i]]`` for every part, then i (only when ``fused``)."""
        self._mac.hash_blocks(rows, ids)

    def update(self, chunk: Any) -> None:
        if self._mode == "mac":
            self._mac.update(chunk)
        elif self._mode == "crc32":
            self._crc = zlib.crc32(chunk, self._crc)

    def tag(self) -> bytes:
        if self._mode == "mac":
            return self._mac.tag()
        return struct.pack("<I", self._crc) if self._mode == "crc32" else b""


def written_code(mode: str, key: bytes, nonce: bytes, head: bytes, chunks: Iterable[Any]
                 ) -> bytes:
    """The code of ``chunks`` in one go (what the consumer checks its blocks against).
    Chunks from nixl_layout.block_chunks name their blocks: one kernel call then (8.1 GB/s
    against OpenSSL's 6.2 over 12 layers of 1024 scattered 16 KiB blocks, one thread: the
    kernel prefetches the next block, which the hardware prefetcher cannot guess)."""
    sealer = Sealer(mode, key, nonce, head)
    blocks = getattr(chunks, "blocks", None)
    if sealer.fused and blocks is not None:
        sealer.hash_blocks(*blocks)
        return sealer.tag()
    for c in chunks:
        sealer.update(c)
    return sealer.tag()


class WrittenCheck:
    """Mixin for a ZmqPipe subclass: set ``notif_label`` (its notifications' key label)."""
    notif_label: bytes

    def check_written(self, peer: str, head: bytes, chunks: list[Any], tag: bytes,
                      nonce: bytes) -> Optional[str]:
        """Why the bytes a producer's notification vouches for are not what it wrote (None:
        they are). Called by the connector with the bytes in our granted blocks."""
        mode = self.config.integrity  # type: ignore[attr-defined]
        if mode == "none":
            return None
        key = self.written_key(peer)
        if key is None:
            return "no connection with the producer"
        if not hmac.compare_digest(written_code(mode, key, nonce, head, chunks), tag):
            return f"{mode} mismatch"
        return None

    def written_key(self, peer: str) -> Optional[bytes]:
        """The key of ``peer``'s write notifications to us (None: no connection)."""
        conn = self._conns.get(identity(peer))  # type: ignore[attr-defined]
        return None if conn is None else conn.channel.side_keys(self.notif_label)[1]
