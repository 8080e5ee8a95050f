"""A keyed check of bytes in device memory, computed with torch ops where the bytes are (the
cuda_ipc pipe's written check: copying a GPU write to the host for a MAC would cost what the
pipe saves).

A two-level multilinear hash over the prime field p = 2^31 - 1, two lanes: the bytes are read
as 16-bit words (each < p, so any change of a word is a nonzero difference), laid out in rows
of ROW words (zero-padded; the length goes in as a last row so padding is not ambiguous);
each row gets inner = sum_j r_j * w_j mod p and the tag is sum_i s_i * inner_i mod p, per lane.
The key vectors r (ROW per lane) and s (one per row) are drawn from [1, p - 1] by a torch
generator seeded with 64 bits of a one-time key (HMAC-SHA256 of the connection's notification
key, the write's random nonce and its head, as written_check.Sealer derives GMAC's), so they
are new for every write and unknown to anyone without the key. A change confined to one word
is always caught (r_j * d and s_i * inner are nonzero mod p); for any other pair of distinct
inputs a lane collides with probability at most 2/p over the key (a standard multilinear
bound), both lanes ~2^-60. Not a MAC against an adversary who can learn many tags under one
key: a one-time key per write and a tag that never leaves the connection make that moot here.
"""
from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Sequence

import torch

P = (1 << 31) - 1
ROW = 4096  # 16-bit words per row: 8 KiB of data; an int64 temporary of 64 KiB per lane-row
LANES = 2
_SLICE_ROWS = 256  # rows per step: bounds the int64 temporaries (~16 MiB) on big writes
_LABEL = b"pd-cluster device hash v1\0"


def one_time_seed(key: bytes, nonce: bytes, head: bytes) -> int:
    """The write's 64-bit generator seed: HMAC of its nonce and head under ``key``."""
    msg = _LABEL + struct.pack("<Q", len(head)) + nonce + head
    return int.from_bytes(hmac.new(key, msg, hashlib.sha256).digest()[:8], "little")


def _words(chunks: Sequence[torch.Tensor]) -> tuple[torch.Tensor, int]:
    """The bytes of ``chunks`` in order as rows of 16-bit words (int64), and their length."""
    flat = [c.reshape(-1).view(torch.uint8) for c in chunks if c.numel()]
    data = torch.cat(flat) if flat else torch.zeros(0, dtype=torch.uint8)
    n = data.numel()
    pad = (-n) % (2 * ROW) if n else 2 * ROW
    if pad:
        data = torch.cat([data, data.new_zeros(pad)])
    # little-endian 16-bit words without a view of int16 (its sign): lo + 256 * hi
    pairs = data.view(-1, 2).to(torch.int64)
    words = pairs[:, 0] + (pairs[:, 1] << 8)
    return words.view(-1, ROW), n


def device_tag(chunks: Sequence[torch.Tensor], seed: int) -> bytes:
    """The tag (8 bytes) of the bytes of ``chunks`` (uint8 tensors of one device, taken in
    order) under the one-time ``seed``. Both ends call this with the same seed."""
    rows, n = _words(chunks)
    device = rows.device
    gen = torch.Generator(device="cpu").manual_seed(seed & ((1 << 63) - 1))
    r = torch.randint(1, P, (LANES, ROW), generator=gen, dtype=torch.int64).to(device)
    s = torch.randint(1, P, (LANES, rows.shape[0] + 1), generator=gen,
                      dtype=torch.int64).to(device)
    acc = torch.zeros(LANES, dtype=torch.int64, device=device)
    for lo in range(0, rows.shape[0], _SLICE_ROWS):
        part = rows[lo:lo + _SLICE_ROWS]
        for lane in range(LANES):
            # w < 2^16, r < 2^31: each product < 2^47, reduced before the row's sum
            inner = (part * r[lane]).remainder_(P).sum(1).remainder_(P)  # < 2^31 per row
            outer = (inner * s[lane, lo:lo + part.shape[0]]).remainder_(P).sum()
            acc[lane] = (acc[lane] + outer) % P
    acc = (acc + (n % P) * s[:, -1]) % P  # the length: padding is not data
    a, b = acc.tolist()  # the one sync with the device
    return struct.pack("<II", a, b)


def block_rows(layer: torch.Tensor, block_ids: Sequence[int]) -> list[torch.Tensor]:
    """Each part's ``block_ids`` of ``layer`` ([parts, blocks, ...]) as [n, bytes] uint8,
    gathered where the layer is, in nixl_layout.block_chunks' order (part by part)."""
    flat = layer.reshape(layer.shape[0], layer.shape[1], -1).view(torch.uint8)
    idx = torch.as_tensor(list(block_ids), dtype=torch.int64, device=flat.device)
    return [flat[p].index_select(0, idx) for p in range(flat.shape[0])]
