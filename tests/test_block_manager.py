"""BlockManager unit tests: ref counts, prefix sharing, prefix-cache lookup, LRU eviction."""
from __future__ import annotations

import itertools

import pytest

from pd_cluster.engine import prefix_match
from pd_cluster.engine.block_manager import BlockManager, BlockTableError
from pd_cluster.request import Request
from pd_cluster.sampling_params import SamplingParams

BS = 4
_ids = itertools.count()


def req(tokens: list[int], rid: str | None = None) -> Request:
    return Request(rid or f"r{next(_ids)}", list(tokens), SamplingParams(max_tokens=8))


def toks(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


def compute_all(bm: BlockManager, r: Request) -> None:
    """What the scheduler does after a forward over every current token."""
    r.num_computed_tokens = r.num_tokens
    bm.cache_full_blocks(r)


def admit(bm: BlockManager, r: Request, use_prefix_cache: bool = True) -> int:
    assert bm.can_allocate(r, use_prefix_cache)
    cached = bm.allocate(r, use_prefix_cache)
    r.num_computed_tokens = cached
    return cached


def refs(bm: BlockManager, r: Request) -> list[int]:
    return [bm.blocks[b].ref_count for b in r.block_ids]


def test_allocate_and_free_ref_counts() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    r = req(toks(9))  # 3 blocks (4 + 4 + 1)
    assert admit(bm, r) == 0
    assert len(r.block_ids) == 3 and len(set(r.block_ids)) == 3
    assert refs(bm, r) == [1, 1, 1]
    assert bm.num_used_blocks == 3 and bm.num_free_blocks == 5
    assert bm.holds(r.request_id)
    with pytest.raises(AssertionError):
        bm.check_no_leaks()
    table = list(r.block_ids)
    bm.free(r)
    assert r.block_ids == [] and not bm.holds(r.request_id)
    assert all(bm.blocks[b].ref_count == 0 for b in table)
    assert bm.num_free_blocks == 8
    bm.free(r)  # freeing an unknown / already freed request is a no-op
    bm.check_no_leaks()


def test_append_slots_grows_table() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    r = req(toks(4))
    admit(bm, r)
    assert len(r.block_ids) == 1
    compute_all(bm, r)
    r.output_token_ids.append(7)  # 5th token needs a 2nd block
    assert bm.can_append(r, 1)
    bm.append_slots(r, 1)
    assert len(r.block_ids) == 2 and refs(bm, r) == [1, 1]
    bm.append_slots(r, 1)  # idempotent: still fits
    assert len(r.block_ids) == 2
    bm.free(r)
    bm.check_no_leaks()


def test_shared_prefix_ref_counts() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    prompt = toks(10)  # blocks: [0..3] [4..7] [8, 9]
    a = req(prompt)
    admit(bm, a)
    compute_all(bm, a)
    b = req(prompt)
    assert admit(bm, b) == 2 * BS  # two full blocks shared, the partial tail is not
    assert b.block_ids[:2] == a.block_ids[:2]
    assert b.block_ids[2] != a.block_ids[2]
    assert refs(bm, a) == [2, 2, 1] and refs(bm, b) == [2, 2, 1]
    assert bm.num_used_blocks == 4
    assert bm.stats.hit_blocks == 2
    bm.free(a)
    assert refs(bm, b) == [1, 1, 1]
    assert bm.num_used_blocks == 3
    bm.free(b)
    bm.check_no_leaks()


def test_last_token_is_never_served_from_cache() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = req(toks(8))  # exactly two full blocks
    admit(bm, a)
    compute_all(bm, a)
    b = req(toks(8))
    assert admit(bm, b) == BS  # only the first block: the model must run on >= 1 token
    assert refs(bm, a) == [2, 1]
    bm.free(a)
    bm.free(b)
    bm.check_no_leaks()


def test_divergent_block_breaks_the_chain() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = req(toks(13))
    admit(bm, a)
    compute_all(bm, a)
    other = toks(13)
    other[5] = 999  # second block differs; the identical third block must not match either
    b = req(other)
    assert admit(bm, b) == BS
    assert b.block_ids[0] == a.block_ids[0] and b.block_ids[1:] != a.block_ids[1:3]
    bm.free(a)
    bm.free(b)
    bm.check_no_leaks()


def test_cached_blocks_found_after_free() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = req(toks(9))
    admit(bm, a)
    compute_all(bm, a)
    a_blocks = list(a.block_ids)
    bm.free(a)
    bm.check_no_leaks()  # cached-but-free blocks count as free
    b = req(toks(9))
    assert bm.can_allocate(b)
    assert admit(bm, b) == 2 * BS
    assert b.block_ids[:2] == a_blocks[:2]
    assert refs(bm, b) == [1, 1, 1]
    assert bm.num_used_blocks == 3
    bm.free(b)
    bm.check_no_leaks()


def test_output_tokens_are_cached_too() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = req(toks(6))
    admit(bm, a)
    compute_all(bm, a)
    a.output_token_ids += [50, 51, 52]  # tokens 0..8; decode computes up to the 8th
    bm.append_slots(a, 3)
    a.num_computed_tokens = 8
    bm.cache_full_blocks(a)
    bm.free(a)
    b = req(toks(6) + [50, 51, 52, 60])
    assert admit(bm, b) == 2 * BS
    bm.free(b)
    bm.check_no_leaks()


def test_prefix_cache_disabled_and_bypass() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    a = req(toks(9))
    admit(bm, a)
    compute_all(bm, a)
    b = req(toks(9))
    assert admit(bm, b) == 0
    assert set(a.block_ids).isdisjoint(b.block_ids)
    bm.free(a)
    bm.free(b)
    bm.check_no_leaks()

    bm = BlockManager(num_blocks=8, block_size=BS)
    a = req(toks(9))
    admit(bm, a)
    compute_all(bm, a)
    b = req(toks(9))
    assert admit(bm, b, use_prefix_cache=False) == 0  # e.g. KV arriving from a remote peer
    assert set(a.block_ids).isdisjoint(b.block_ids)
    bm.free(a)
    bm.free(b)
    bm.check_no_leaks()


def test_lru_least_recently_freed_evicted_first() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    a, b = req(toks(5, 100)), req(toks(5, 200))  # one full block + 1 token each
    for r in (a, b):
        admit(bm, r)
        compute_all(bm, r)
    bm.free(a)  # a's blocks are older in the free queue than b's
    bm.free(b)
    filler = req(toks(5, 300))  # needs 2 blocks: takes a's two, evicting a's cached block
    admit(bm, filler)
    b_again = req(toks(5, 200))
    assert admit(bm, b_again) == BS  # b (freed last) is still cached
    bm.free(filler)
    a_again = req(toks(5, 100))
    assert admit(bm, a_again) == 0  # a (freed first) was evicted
    for r in (b_again, a_again):
        bm.free(r)
    bm.check_no_leaks()


def test_lru_tail_blocks_evicted_before_prefix() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = req(toks(13))  # 3 full blocks + 1-token tail = all 4 blocks
    admit(bm, a)
    compute_all(bm, a)
    bm.free(a)  # released tail first: eviction order = tail, block 2, block 1, block 0
    x = req(toks(2, 700))
    admit(bm, x)  # takes the unhashed tail block
    y = req(toks(2, 800))
    admit(bm, y)  # evicts a's 3rd block (the deepest cached one)
    again = req(toks(13))
    assert bm.can_allocate(again) is False  # needs 4 blocks: 2 cached, nothing else free
    bm.free(x)
    bm.free(y)
    assert admit(bm, again) == 2 * BS  # the first two blocks survived, the 3rd was evicted
    bm.free(again)
    bm.check_no_leaks()


def test_can_allocate_and_can_append_false_when_full() -> None:
    bm = BlockManager(num_blocks=3, block_size=BS)
    a = req(toks(8))
    admit(bm, a)
    b = req(toks(9, 500))  # needs 3 blocks, 1 free
    assert not bm.can_allocate(b)
    c = req(toks(4, 600))
    admit(bm, c)
    assert bm.num_free_blocks == 0
    assert not bm.can_allocate(req(toks(1, 900)))
    compute_all(bm, a)
    assert bm.can_append(a, 0)
    a.output_token_ids.append(1)
    assert not bm.can_append(a, 1)  # 9th token needs a new block
    bm.free(c)
    assert bm.can_append(a, 1)
    bm.append_slots(a, 1)
    assert bm.num_free_blocks == 0
    bm.free(a)
    bm.check_no_leaks()


def test_can_allocate_counts_cached_free_blocks_once() -> None:
    """A prefix hit on a free cached block uses that block; it cannot also count as free."""
    bm = BlockManager(num_blocks=3, block_size=BS)
    a = req(toks(9))
    admit(bm, a)
    compute_all(bm, a)
    bm.free(a)
    b = req(toks(9))  # 2 hits (free, cached) + 1 new block = exactly the pool
    assert bm.can_allocate(b)
    admit(bm, b)
    assert bm.num_free_blocks == 0
    bm.free(b)
    c = req(toks(13))  # 2 hits + 2 new > 3 blocks
    assert not bm.can_allocate(c)
    bm.check_no_leaks()


def test_hash_collision_is_not_a_hit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prefix_match, "chain_hash", lambda parent, tokens: 42)  # every block collides
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = req(toks(9, 100))
    admit(bm, a)
    compute_all(bm, a)
    b = req(toks(9, 200))  # different tokens, same hash
    assert admit(bm, b) == 0
    assert set(a.block_ids).isdisjoint(b.block_ids)
    assert bm.stats.hit_blocks == 0
    c = req(toks(9, 100))  # the genuinely identical first block still hits
    assert admit(bm, c) == BS
    for r in (a, b, c):
        bm.free(r)
    bm.check_no_leaks()


def test_check_no_leaks_raises_when_something_is_held() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    bm.check_no_leaks()
    r = req(toks(3))
    admit(bm, r)
    with pytest.raises(AssertionError, match="leak"):
        bm.check_no_leaks()
    bm.free(r)
    bm.check_no_leaks()
    # A stray reference (e.g. a table dropped without freeing) is caught too.
    bm.blocks[1].ref_count = 1
    with pytest.raises(AssertionError):
        bm.check_no_leaks()
    bm.blocks[1].ref_count = 0
    bm.check_no_leaks()


def test_double_allocate_is_an_error() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    r = req(toks(3))
    admit(bm, r)
    with pytest.raises(BlockTableError, match="allocated twice"):
        bm.allocate(r)
    bm.free(r)
    bm.check_no_leaks()


def test_a_block_released_more_often_than_taken_is_an_error() -> None:
    """Two tables naming one block with a single reference (a corrupted table): the second
    release raises (a named error: the check stays under ``python -O``)."""
    bm = BlockManager(num_blocks=4, block_size=BS)
    r, ghost = req(toks(3)), req(toks(3))
    admit(bm, r)
    bm.tables[ghost.request_id] = [list(r.block_ids)]  # one table per KV cache group
    bm.free(r)
    with pytest.raises(BlockTableError, match="released more often than taken"):
        bm.free(ghost)


def test_trim_returns_rejected_drafts_lookahead_blocks() -> None:
    """Speculation: slots for 1 + 6 drafts, 2 drafts accepted; the blocks past the computed
    tokens go back first in line, and only the computed full blocks are hashed."""
    bm = BlockManager(num_blocks=8, block_size=BS)
    r = req(toks(4))
    admit(bm, r)
    compute_all(bm, r)
    r.output_token_ids.append(7)
    r.num_computed_tokens = 4
    bm.append_slots(r, 7)  # positions 4..10: 3 blocks
    assert len(r.block_ids) == 3
    lookahead = r.block_ids[2]
    r.output_token_ids += [8, 9, 10]  # 2 accepted drafts + the token after them
    r.num_computed_tokens = 4 + 1 + 2
    bm.trim(r)
    assert len(r.block_ids) == 2 and bm.num_free_blocks == 6
    assert next(iter(bm.free_queue)) == lookahead  # handed out again first
    bm.cache_full_blocks(r)
    assert bm.hashed[r.request_id] == 1  # block 2 (tokens 4..7) is not all computed
    bm.free(r)
    bm.check_no_leaks()


def test_a_freed_request_s_blocks_come_back_as_an_ascending_run() -> None:
    """A request gets the blocks the pool would evict next (least recently released first),
    handed out in ascending order: a finished request's blocks (released tail first) return
    as one run of consecutive ids, which a KV transfer moves as one piece."""
    bm = BlockManager(num_blocks=32, block_size=BS, enable_prefix_caching=False)
    a = req(toks(8 * BS))
    admit(bm, a)
    assert a.block_ids == list(range(8))
    filler = req(toks(24 * BS, 500))
    admit(bm, filler)  # the rest of the pool
    bm.free(a)  # released 7, 6, ..., 0: the pool's oldest now
    b = req(toks(5 * BS, 900))
    admit(bm, b)
    assert b.block_ids == [3, 4, 5, 6, 7]  # the five released first, ascending
    b.num_computed_tokens = b.num_tokens
    bm.append_slots(b, 3 * BS)  # grows with the three left, ascending too
    assert b.block_ids == [3, 4, 5, 6, 7, 0, 1, 2]
    for r in (filler, b):
        bm.free(r)
    bm.check_no_leaks()


def test_churned_grants_are_long_runs() -> None:
    """The bench's churned grant (scripts/churned_grant.py) runs the real pool: after a
    serving history a large request's blocks come in a few runs (each block its own run
    when the pool handed them out as released, tail first)."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    from churned_grant import churned_blocks, num_runs
    ids = churned_blocks(2048, 1024, seed=3)
    assert len(ids) == len(set(ids)) == 1024 and all(0 <= i < 2048 for i in ids)
    assert num_runs(ids) < 64
    with pytest.raises(ValueError, match="want"):
        churned_blocks(16, 16)
