"""Deterministic chained hashes of full KV blocks.

A block's hash covers its tokens and its parent's hash, so equal hashes mean equal prefixes.
The value must be the same in every process (engines report hashes to the proxy for
cache-aware routing), so it is blake2b over fixed-width bytes, never Python's ``hash()``
(``hash(None)`` is address-based before Python 3.12, and str hashes are salted per process).
"""
from __future__ import annotations

import struct
from collections.abc import Sequence
from hashlib import blake2b

_DIGEST = 8  # 64-bit hashes: collisions are ruled out on a hit by comparing the tokens


def block_hash(parent: int | None, token_ids: Sequence[int]) -> int:
    """Hash of one block: parent's 8 bytes (zeros for the first block) + int32 tokens."""
    h = blake2b(digest_size=_DIGEST)
    h.update((0 if parent is None else parent).to_bytes(_DIGEST, "little"))
    try:  # struct, not numpy: a 16-token block packs in well under a microsecond
        h.update(struct.pack(f"<{len(token_ids)}i", *token_ids))
    except struct.error as e:  # a token id outside int32 is a caller bug, not a wrap
        raise ValueError(f"token_ids: ids must fit in int32 ({e})") from None
    return int.from_bytes(h.digest(), "little")


def hash_blocks(token_ids: Sequence[int], block_size: int, parent: int | None = None
                ) -> list[int]:
    """Chained hashes of the full blocks of ``token_ids`` (a trailing partial block has none)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    out: list[int] = []
    for start in range(0, len(token_ids) // block_size * block_size, block_size):
        parent = block_hash(parent, token_ids[start:start + block_size])
        out.append(parent)
    return out
