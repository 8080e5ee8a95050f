"""The nixl pipe's coalesced descriptors, without NIXL (they run everywhere): a run of blocks
goes as one descriptor only where both the producer's and the consumer's blocks are
consecutive, the descriptors cover exactly the bytes the per-block ones did (so the write's
MAC covers exactly what was written, and one flipped bit still fails it), and blocks outside
the grant or the cache are refused before any descriptor exists."""
from __future__ import annotations

import ctypes
import random

import numpy as np
import pytest
import torch

from connectors.granted_writes import granted_targets
from connectors.pipes.nixl_layout import CacheLayout, block_chunks
from connectors.pipes.written_check import written_code


def _caches(blocks: int = 12, parts: int = 2, layers: int = 2) -> list[torch.Tensor]:
    return [torch.randn(parts, blocks, 4, 2, 8) for _ in range(layers)]


def _pieces(descs: np.ndarray, block: int) -> list[int]:
    """Every block-sized piece's address a descriptor list covers, in order."""
    return [int(a) + i for a, n, _ in descs.tolist() for i in range(0, int(n), block)]


def _runs(descs: np.ndarray, lay_addr: int, block: int) -> list[tuple[int, int]]:
    """(first row, rows) of each descriptor."""
    return [((int(a) - lay_addr) // block, int(n) // block) for a, n, _ in descs.tolist()]


def test_runs_split_where_either_side_is_not_consecutive() -> None:
    src_caches, dst_caches = _caches(), _caches(blocks=30)
    here, there = CacheLayout.of(src_caches), CacheLayout.of(dst_caches)
    block = src_caches[1][0, 0].nbytes
    local, far = here.write_descs(there, 1, [0, 1, 2, 3, 4, 6, 7], [10, 11, 5, 6, 20, 21, 23])
    s0, d0 = src_caches[1].data_ptr(), dst_caches[1].data_ptr()
    # 0-1 -> 10-11, 2-3 -> 5-6 (destination breaks), 4 -> 20, 6 -> 21 (source breaks),
    # 7 -> 23 (destination breaks); then the same for V, 12 / 30 rows on
    assert _runs(local, s0, block) == [(0, 2), (2, 2), (4, 1), (6, 1), (7, 1),
                                       (12, 2), (14, 2), (16, 1), (18, 1), (19, 1)]
    assert _runs(far, d0, block) == [(10, 2), (5, 2), (20, 1), (21, 1), (23, 1),
                                     (40, 2), (35, 2), (50, 1), (51, 1), (53, 1)]
    assert (local[:, 1] == far[:, 1]).all()  # each pair moves as many bytes on both sides
    assert set(local[:, 2].tolist()) == set(far[:, 2].tolist()) == {0}


def test_a_single_block_and_a_whole_layer() -> None:
    caches = _caches()
    layout = CacheLayout.of(caches)
    block = caches[0][0, 0].nbytes
    local, far = layout.write_descs(layout, 0, [5], [9])
    assert _runs(local, caches[0].data_ptr(), block) == [(5, 1), (17, 1)]  # K, then V
    assert _runs(far, caches[0].data_ptr(), block) == [(9, 1), (21, 1)]
    # every block in order on both sides: K runs into V (one tensor), one descriptor
    local, far = layout.write_descs(layout, 0, list(range(12)), list(range(12)))
    assert local.tolist() == far.tolist() == [[caches[0].data_ptr(), caches[0].nbytes, 0]]
    # a consumer with more blocks: its K and V do not meet, two descriptors
    bigger = CacheLayout.of(_caches(blocks=20))
    assert len(layout.write_descs(bigger, 0, list(range(12)), list(range(12)))[1]) == 2


@pytest.mark.parametrize("seed", range(20))
def test_coalesced_descriptors_cover_the_same_bytes_as_block_by_block(seed: int) -> None:
    rng = random.Random(seed)
    src_caches, dst_caches = _caches(blocks=16), _caches(blocks=24, parts=2)
    here, there = CacheLayout.of(src_caches), CacheLayout.of(dst_caches)
    n = rng.randint(1, 16)
    src = sorted(rng.sample(range(16), n)) if seed % 2 else rng.sample(range(16), n)
    start = rng.randint(0, 24 - n)
    dst = list(range(start, start + n)) if seed % 3 else rng.sample(range(24), n)
    local, far = here.write_descs(there, 0, src, dst)
    block = src_caches[0][0, 0].nbytes
    assert _pieces(local, block) == here.descs(0, src)[:, 0].tolist()
    assert _pieces(far, block) == there.descs(0, dst)[:, 0].tolist()
    assert len(local) <= 2 * n


def test_empty_mismatched_and_out_of_range_blocks_are_refused() -> None:
    layout = CacheLayout.of(_caches())
    with pytest.raises(ValueError, match="no block ids"):
        layout.write_descs(layout, 0, [], [])
    with pytest.raises(ValueError, match="differ in number"):
        layout.write_descs(layout, 0, [1, 2], [3])
    for src, dst in (([1, 2], [11, 12]), ([-1], [0]), ([0], [-1])):
        with pytest.raises(ValueError, match="out of range"):
            layout.write_descs(layout, 0, src, dst)
    with pytest.raises(ValueError, match="layer 2 out of range"):
        layout.write_descs(layout, 2, [0], [0])
    with pytest.raises(ValueError, match="differ between"):
        layout.write_descs(CacheLayout.of(_caches(parts=1)), 0, [0], [0])


def test_a_grant_that_does_not_cover_the_run_is_refused_before_any_descriptor() -> None:
    """The producer's run of table entries 2..6 against a grant of entries 2..4: refused
    whole (no partial run), as write_blocks' caller (pd_producer._write_into) does."""
    grant = (2, (7, 8, 9))
    assert granted_targets(grant, 2, 3) == (7, 8, 9)
    with pytest.raises(ValueError, match="outside the grant"):
        granted_targets(grant, 2, 5)
    with pytest.raises(ValueError, match="outside the grant"):
        granted_targets(grant, 4, 2)  # starts inside, runs past its end


def test_the_mac_covers_exactly_the_coalesced_bytes_and_one_flipped_bit_fails() -> None:
    """The write done by hand (memmove per descriptor pair, as NIXL's WRITE would): the
    consumer's code over its granted blocks equals the producer's over its source blocks;
    a flipped bit in a written block fails it."""
    src_caches, dst_caches = _caches(), [torch.zeros(2, 30, 4, 2, 8) for _ in range(2)]
    here, there = CacheLayout.of(src_caches), CacheLayout.of(dst_caches)
    src, dst = [0, 1, 2, 3, 7, 8], [4, 5, 6, 20, 21, 22]
    local, far = here.write_descs(there, 1, src, dst)
    assert len(local) == 2 * 3  # (0-2 -> 4-6), (3 -> 20), (7-8 -> 21-22), K and V
    key, nonce, head = b"k" * 32, b"n" * 16, b"head"
    tag = written_code("mac", key, nonce, head, block_chunks(src_caches[1], src))
    for (s, n, _), (d, m, _) in zip(local.tolist(), far.tolist()):
        assert n == m
        ctypes.memmove(int(d), int(s), int(n))
    assert torch.equal(dst_caches[1][:, dst], src_caches[1][:, src])
    untouched = [b for b in range(30) if b not in dst]
    assert not dst_caches[1][:, untouched].any() and not dst_caches[0].any()
    assert written_code("mac", key, nonce, head, block_chunks(dst_caches[1], dst)) == tag
    dst_caches[1][1, 21].view(-1).view(torch.uint8)[7] ^= 1
    assert written_code("mac", key, nonce, head, block_chunks(dst_caches[1], dst)) != tag
