"""Deterministic block hashes (the same in every process, each block hashed once per request)
and the block manager's cache events."""
from __future__ import annotations

import subprocess
import sys

import pytest

from pd_cluster.engine.block_hash import block_hash, hash_blocks
from pd_cluster.engine.block_manager import BlockManager
from pd_cluster.request import Request
from pd_cluster.sampling_params import SamplingParams

BS = 4


def test_hashes_are_chained_and_cover_full_blocks_only() -> None:
    tokens = list(range(10))
    hashes = hash_blocks(tokens, BS)
    assert len(hashes) == 2  # 10 tokens: two full blocks, the trailing 2 have no hash
    assert hashes[0] == block_hash(None, tokens[:4])
    assert hashes[1] == block_hash(hashes[0], tokens[4:8])
    # Same tokens under another parent: another hash (the chain covers the whole prefix).
    assert hash_blocks(tokens[4:8], BS) != [hashes[1]]
    assert hash_blocks(tokens[4:8], BS, parent=hashes[0]) == [hashes[1]]
    assert all(0 <= h < 1 << 64 for h in hashes)
    with pytest.raises(ValueError, match="block_size"):
        hash_blocks(tokens, 0)
    with pytest.raises(ValueError, match="token_ids"):
        block_hash(None, [1 << 40])


def test_hashes_equal_across_processes() -> None:
    """Python's hash(None) differs between processes on 3.11: block hashes must not."""
    code = ("from pd_cluster.engine.block_hash import hash_blocks; "
            "print(hash_blocks(list(range(50, 70)), 4))")
    runs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True, env={"PYTHONHASHSEED": seed, "PATH": ""}).stdout.strip()
            for seed in ("1", "2")}
    assert runs == {str(hash_blocks(list(range(50, 70)), 4))}


def _run(bm: BlockManager, rid: str, tokens: list[int]) -> Request:
    r = Request(rid, tokens, SamplingParams(max_tokens=4))
    r.num_computed_tokens = bm.allocate(r)
    r.num_computed_tokens = r.num_tokens
    bm.cache_full_blocks(r)
    return r


def test_cache_events_stored_removed_and_snapshot() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = _run(bm, "a", list(range(9)))  # 2 full blocks + 1 partial
    ev = bm.take_events()
    assert ev.stored == hash_blocks(list(range(9)), BS) and ev.removed == [] and not ev.reset
    assert sorted(bm.cached_hashes()) == sorted(ev.stored)
    assert bm.take_events().stored == []  # taken once
    bm.free(a)
    b = _run(bm, "b", list(range(100, 116)))  # 4 blocks: evicts both cached blocks
    ev = bm.take_events()
    assert sorted(ev.removed) == sorted(hash_blocks(list(range(9)), BS))
    assert ev.stored == hash_blocks(list(range(100, 116)), BS)
    bm.free(b)
    bm.check_no_leaks()


def test_cache_events_overflow_is_a_reset() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS, max_pending_events=3)
    r = _run(bm, "a", list(range(20)))  # 5 stored events > 3
    ev = bm.take_events()
    assert ev.reset and ev.stored == [] and ev.removed == []
    assert sorted(bm.cached_hashes()) == sorted(hash_blocks(list(range(20)), BS))
    assert not bm.take_events().reset  # the next batch starts clean
    bm.free(r)
    bm.check_no_leaks()


def _admit(mgr: BlockManager, r: Request) -> int:
    assert mgr.can_allocate(r)
    r.num_computed_tokens = mgr.allocate(r)
    return r.num_computed_tokens


def _compute_all(mgr: BlockManager, r: Request) -> None:
    r.num_computed_tokens = r.num_tokens
    mgr.cache_full_blocks(r)


def test_each_block_is_hashed_once_per_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """Admission asks for the prefix hits three times (num_cached_tokens, can_allocate,
    allocate) and caching asks again as blocks fill: every full block is hashed once."""
    import pd_cluster.engine.prefix_match as bm
    real, calls = bm.chain_hash, []
    monkeypatch.setattr(bm, "chain_hash",
                        lambda parent, tokens: calls.append(tokens) or real(parent, tokens))
    mgr = BlockManager(num_blocks=16, block_size=BS)
    a = Request("a", list(range(100, 113)), SamplingParams(max_tokens=8))
    assert mgr.num_cached_tokens(a) == 0
    _admit(mgr, a)
    _compute_all(mgr, a)
    a.output_token_ids += [7, 8, 9]  # the fourth block fills with output
    _compute_all(mgr, a)
    assert len(calls) == 4 and len(set(calls)) == 4
    calls.clear()
    # the same prompt: its own hashes (once each), three blocks hit
    b = Request("b", list(range(100, 113)), SamplingParams(max_tokens=8))
    assert mgr.num_cached_tokens(b) == 3 * BS
    assert _admit(mgr, b) == 3 * BS
    assert len(calls) == 3
    for r in (a, b):
        mgr.free(r)
    mgr.check_no_leaks()
