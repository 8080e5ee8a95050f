"""AES-GMAC with its hash in the C++ kernel (kernels/cpu/ghash_copy.cpp), fused with a block
copy where the bytes are being copied anyway (the shm pipe's writes): the source is
read once, stored and hashed from registers, instead of a copy then OpenSSL's pass over the
same bytes.

The tag is GCM's over associated data only (a 12-byte nonce, no plaintext), bit-identical to
``cryptography``'s: H = AES_K(0^128) and E_K(J0) come from OpenSSL (AES-ECB on one block each);
the kernel does GHASH over the stream (one stream across calls, zero-padded only at its end,
then the length block) and the tag is GHASH xor E_K(J0). The kernel runs without the GIL
(torch ops release it).

``available()`` is False when the CPU kernels are off (``PD_CLUSTER_CPU_KERNELS=0``), failed to
build, are still building (the first start: a send never waits for the compiler), or have no
carry-less multiply (their bit-serial path is far slower than OpenSSL): callers keep OpenSSL's
GMAC then, with the same tags.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from kernels import cpu_build

STATE_BYTES = 48 + 16 * 32  # ghash_copy.cpp's state: hash, partial block, lengths, H^1..32
BEST = -1  # the kernel's fastest path (2: VPCLMULQDQ 512-bit, 1: PCLMULQDQ, 0: software)
_ready: list[bool] = []


def available(wait: bool = False) -> bool:
    """Whether the kernel is loaded and has a carry-less multiply path. Never waits for the
    kernels' build unless ``wait`` (tests, benchmarks): False until it finished (OpenSSL's
    tags are the same), True from the call after it did."""
    if not _ready:
        loaded = cpu_build.load_cpu_kernels() if wait else cpu_build.loaded_without_waiting()
        if not loaded:
            return False  # building (asked again next time), or off / failed
        ok = hasattr(torch.ops.pd_cluster_cpu, "ghash_impl")
        _ready.append(ok and int(torch.ops.pd_cluster_cpu.ghash_impl()) >= 1)
    return _ready[0]


def best_path() -> int:
    """The kernel's fastest path here (needs the kernels loaded)."""
    return int(torch.ops.pd_cluster_cpu.ghash_impl())


def _as_bytes_tensor(data: Any) -> torch.Tensor:
    if isinstance(data, torch.Tensor):
        if data.device.type != "cpu":
            raise ValueError("data: a CPU tensor is needed")
        return data.contiguous().reshape(-1).view(torch.uint8)
    arr = np.frombuffer(data, dtype=np.uint8)
    if not arr.flags.writeable:  # torch wants a writable buffer; the kernel only reads it
        arr = arr.copy()
    return torch.from_numpy(arr)


def _ids(ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
    if isinstance(ids, torch.Tensor):
        return ids.to(torch.int64).contiguous()
    return torch.as_tensor(np.asarray(ids, dtype=np.int64))


class Gmac:
    """AES-GMAC of a stream under ``key`` (16/24/32 bytes) and a 12-byte ``nonce``: what
    ``Cipher(AES(key), GCM(nonce)).encryptor()`` fed with authenticate_additional_data only
    gives as ``.tag``. ``path`` forces the kernel's path (tests); BEST by default."""

    def __init__(self, key: bytes, nonce: bytes, path: int = BEST) -> None:
        if len(nonce) != 12:
            raise ValueError(f"nonce: 12 bytes needed, got {len(nonce)}")
        ecb = Cipher(algorithms.AES(key), modes.ECB()).encryptor()
        h = ecb.update(bytes(16))
        self._ekj0 = ecb.update(nonce + b"\0\0\0\1")
        self._path = int(path)
        self._state = torch.empty(STATE_BYTES, dtype=torch.uint8)
        torch.ops.pd_cluster_cpu.ghash_init(self._state, torch.tensor(list(h), dtype=torch.uint8))
        self._done = False

    def _live(self) -> torch.Tensor:
        if self._done:
            raise ValueError("gmac: already finalized")
        return self._state

    def update(self, data: Any) -> None:
        """Hash the bytes of ``data`` (a buffer or a CPU tensor), after those before."""
        t = _as_bytes_tensor(data)
        if t.numel():
            torch.ops.pd_cluster_cpu.ghash_update(self._live(), t, self._path)

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor, src_ids: Sequence[int],
                    dst_ids: Sequence[int]) -> None:
        """Copy ``src[p, src_ids[i]]`` to ``dst[p, dst_ids[i]]`` ([parts, blocks, bytes]
        uint8, each block contiguous) for every part p, then i, hashing the source bytes in
        that order: one pass over them."""
        torch.ops.pd_cluster_cpu.ghash_copy_blocks(self._live(), src, dst, _ids(src_ids),
                                                   _ids(dst_ids), self._path)

    def hash_blocks(self, src: torch.Tensor, ids: Sequence[int]) -> None:
        """Hash ``src[p, ids[i]]`` for every part p, then i (no copy)."""
        torch.ops.pd_cluster_cpu.ghash_blocks(self._live(), src, _ids(ids), self._path)

    def tag(self) -> bytes:
        """The 16-byte tag; the object is spent after it."""
        out = torch.empty(16, dtype=torch.uint8)
        torch.ops.pd_cluster_cpu.ghash_final(self._live(), out, self._path)
        self._done = True
        return bytes(a ^ b for a, b in zip(out.tolist(), self._ekj0))
