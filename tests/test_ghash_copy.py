"""The GHASH kernel (kernels/cpu/ghash_copy.cpp via kernels/ghash_copy.py): its tags are
``cryptography``'s AES-GMAC tags on every path this build has (VPCLMULQDQ, PCLMULQDQ,
bit-serial), whatever the lengths, the split of the stream into calls and the alignment of
the buffers; the fused copy is exact. tests/test_cpu_attention_isa.py runs this module under
the portable and avx512 builds too."""
from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from kernels import cpu_build, ghash_copy

pytestmark = pytest.mark.skipif(not ghash_copy.available(wait=True),
                                reason=f"no GHASH kernel ({cpu_build.load_error()})")

LENGTHS = [0, 1, 15, 16, 17, 63, 64, 65, 255, 256, 257, 4096 + 3, (1 << 20) + 5]


def paths() -> list[int]:
    """Every path this build has (none listed without the kernel: the module is skipped)."""
    return list(range(ghash_copy.best_path() + 1)) if ghash_copy.available(wait=True) else [-1]


# the bit-serial path (~50 MB/s) runs the lengths below 1 MiB
TAG_CASES = [(n, p) for p in paths() for n in LENGTHS if p != 0 or n < 1 << 20]


def openssl_tag(key: bytes, nonce: bytes, chunks: list[bytes]) -> bytes:
    mac = Cipher(algorithms.AES(key), modes.GCM(nonce)).encryptor()
    for c in chunks:
        mac.authenticate_additional_data(c)
    mac.finalize()
    return mac.tag


def random_split(data: bytes, rng: random.Random) -> list[bytes]:
    """``data`` in pieces of random sizes (some empty, some under a block, some large)."""
    out, i = [], 0
    while i < len(data):
        n = rng.choice([0, 1, 5, 15, 16, 17, 31, 64, 100, 257, 4096, 70000])
        out.append(data[i:i + n])
        i += n
    return out


def unaligned(data: bytes, offset: int) -> torch.Tensor:
    """``data`` as a uint8 tensor starting ``offset`` bytes past a 64-byte boundary."""
    base = torch.empty(len(data) + 128, dtype=torch.uint8)
    skip = (-base.data_ptr()) % 64 + offset
    view = base[skip:skip + len(data)]
    if data:
        view.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    return view


@pytest.mark.parametrize("length,path", TAG_CASES)
def test_tag_is_openssls(length: int, path: int) -> None:
    rng = random.Random(length * 7 + path)
    key = rng.randbytes(rng.choice([16, 32]))
    nonce = rng.randbytes(12)
    data = rng.randbytes(length)
    want = openssl_tag(key, nonce, [data])
    whole = ghash_copy.Gmac(key, nonce, path)
    whole.update(unaligned(data, rng.randrange(64)))
    assert whole.tag() == want
    pieces = ghash_copy.Gmac(key, nonce, path)
    for piece in random_split(data, rng):
        pieces.update(unaligned(piece, rng.randrange(64)) if piece else piece)
    assert pieces.tag() == want


@pytest.mark.parametrize("path", paths())
def test_copy_blocks_copies_exactly_and_tags_the_source(path: int) -> None:
    rng = random.Random(path)
    parts, blocks, size = 2, 12, 16 * 7 + 5 if path == 0 else 4096 + 48
    raw = torch.frombuffer(bytearray(rng.randbytes(parts * blocks * size + 3)), dtype=torch.uint8)
    src = raw[3:].view(parts, blocks, size)  # unaligned rows
    dst_raw = torch.zeros(parts * 20 * size + 1, dtype=torch.uint8)
    dst = dst_raw[1:].view(parts, 20, size)
    src_ids, dst_ids = [4, 5, 6, 0, 11, 2], [19, 3, 7, 8, 0, 12]
    key, nonce = os.urandom(32), os.urandom(12)
    head = b"head of a partial block"  # the stream does not start block-aligned
    mac = ghash_copy.Gmac(key, nonce, path)
    mac.update(head)
    mac.copy_blocks(src, dst, src_ids, dst_ids)
    chunks = [head] + [bytes(src[p, s].numpy()) for p in range(parts) for s in src_ids]
    assert mac.tag() == openssl_tag(key, nonce, chunks)
    want = torch.zeros_like(dst)
    want[:, dst_ids] = src[:, src_ids]
    assert torch.equal(dst, want)
    again = ghash_copy.Gmac(key, nonce, path)  # the consumer's hash-only pass over dst
    again.update(head)
    again.hash_blocks(dst, dst_ids)
    assert again.tag() == openssl_tag(key, nonce, chunks)


@pytest.mark.parametrize("path", paths())
@pytest.mark.parametrize("offset", [0, 3])
def test_runs_copy_exactly_aligned_or_not(path: int, offset: int) -> None:
    """Blocks consecutive on both sides go as one stretch (long runs past the prefetch size
    too), line-aligned destinations by streaming stores: the same bytes and tag."""
    rng = random.Random(offset + 10 * path)
    parts, blocks, size = 2, 24, 16 << 10
    raw = torch.frombuffer(bytearray(rng.randbytes(parts * blocks * size + 64)),
                           dtype=torch.uint8)
    lead = (-raw.data_ptr()) % 64 + offset  # rows line-aligned, or 3 bytes past
    src = raw[lead:lead + parts * blocks * size].view(parts, blocks, size)
    dst_raw = torch.zeros(parts * 40 * size + 64, dtype=torch.uint8)
    lead = (-dst_raw.data_ptr()) % 64 + offset
    dst = dst_raw[lead:lead + parts * 40 * size].view(parts, 40, size)
    src_ids = [0, 1, 2, 3, 4, 5, 6, 9, 10, 20, 21, 22, 7]  # runs of 7, 2, 3 and one
    dst_ids = [30, 31, 32, 33, 34, 35, 36, 2, 3, 11, 12, 13, 39]
    key, nonce = os.urandom(32), os.urandom(12)
    mac = ghash_copy.Gmac(key, nonce, path)
    mac.copy_blocks(src, dst, src_ids, dst_ids)
    chunks = [bytes(src[p, s].numpy()) for p in range(parts) for s in src_ids]
    assert mac.tag() == openssl_tag(key, nonce, chunks)
    want = torch.zeros_like(dst)
    want[:, dst_ids] = src[:, src_ids]
    assert torch.equal(dst, want)
    again = ghash_copy.Gmac(key, nonce, path)
    again.hash_blocks(dst, dst_ids)
    assert again.tag() == openssl_tag(key, nonce, chunks)


def test_a_flipped_bit_changes_the_tag() -> None:
    key, nonce = os.urandom(32), os.urandom(12)
    data = bytearray(os.urandom(4096 + 3))
    good = ghash_copy.Gmac(key, nonce)
    good.update(data)
    tag = good.tag()
    for bit in (0, 7, 8 * 1000 + 3, 8 * len(data) - 1):
        flipped = bytearray(data)
        flipped[bit // 8] ^= 1 << (bit % 8)
        bad = ghash_copy.Gmac(key, nonce)
        bad.update(flipped)
        assert bad.tag() != tag
    longer = ghash_copy.Gmac(key, nonce)  # a zero byte more: the length block tells
    longer.update(bytes(data) + b"\0")
    assert longer.tag() != tag


def test_bad_input_is_refused() -> None:
    mac = ghash_copy.Gmac(bytes(16), bytes(12))
    src = torch.zeros(1, 4, 32, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="out of range"):
        mac.copy_blocks(src, torch.zeros(1, 2, 32, dtype=torch.uint8), [0, 1], [0, 2])
    with pytest.raises(RuntimeError, match="differ"):
        mac.copy_blocks(src, torch.zeros(1, 4, 16, dtype=torch.uint8), [0], [0])
    with pytest.raises(ValueError, match="nonce"):
        ghash_copy.Gmac(bytes(16), bytes(8))
    mac.tag()
    with pytest.raises(ValueError, match="finalized"):
        mac.update(b"x")


def test_sealer_uses_the_kernel_with_openssls_tags(monkeypatch: pytest.MonkeyPatch) -> None:
    """written_check.Sealer's fused copy gives the tag its OpenSSL path gives (the wire
    format and the consumer's check are unchanged)."""
    from connectors.pipes import written_check
    from connectors.pipes.shm_pipe import copy_and_seal
    src = torch.randint(0, 256, (2, 40, 16 * 1024), dtype=torch.uint8)
    dst = torch.zeros(2, 64, 16 * 1024, dtype=torch.uint8)
    src_ids = [1, 2, 3, 9, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 0]
    dst_ids = [5, 60, 61, 62, 1, 2, 3, 4, 40, 41, 42, 43, 44, 45, 10]
    key, nonce, head = os.urandom(32), os.urandom(16), b"head"
    fused = written_check.Sealer("mac", key, nonce, head)
    assert fused.fused
    copy_and_seal(src, dst, src_ids, dst_ids, fused)
    tag = fused.tag()
    monkeypatch.setattr(written_check.ghash_copy, "available", lambda: False)
    plain = written_check.Sealer("mac", key, nonce, head)
    assert not plain.fused
    dst2 = torch.zeros_like(dst)
    copy_and_seal(src, dst2, src_ids, dst_ids, plain)
    assert plain.tag() == tag and torch.equal(dst, dst2)
    chunks = [np.ascontiguousarray(src[p, s].numpy()) for p in range(2) for s in src_ids]
    assert written_check.written_code("mac", key, nonce, head, chunks) == tag
