"""The disk KV tier behind the host tier: a history evicted from device and host comes back
from disk token-exact with HF; corrupt, truncated, deleted and foreign files are misses
(counted, the prefix match ends there, the output stays exact); a restarted engine finds the
files an earlier one wrote; the files' LRU stays within its size. Every engine ends with a
leak check."""
from __future__ import annotations

from pathlib import Path

import pytest

from pd_cluster import LLM, SamplingParams
from pd_cluster.engine.block_hash import hash_blocks
from pd_cluster.engine.kv_tiers.disk import HEADER, DiskTier
from tests.conftest import assert_greedy_matches, hf_greedy, random_prompt

BS = 8
BLOCK_BYTES = 2 * 2 * BS * 2 * 16 * 4  # tiny default model, fp32
FILE_BYTES = HEADER.size + 4 * BS + BLOCK_BYTES
NEW = 8
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)


def tiered_llm(model: str, path: Path, host_blocks: int = 8, disk_blocks: int = 128,
               chunk: int = 2048) -> LLM:
    return LLM(model=model, block_size=BS, num_kv_blocks=16, max_num_batched_tokens=chunk,
               kv_offloading_size=host_blocks * BLOCK_BYTES / 2**30,
               kv_offloading_disk={"path": str(path), "size": disk_blocks * FILE_BYTES / 2**30})


def generate(llm: LLM, model: str, prompt: list[int]) -> tuple[list[int], int]:
    out = llm.generate([prompt], [GREEDY])[0]
    assert_greedy_matches(model, prompt, out.outputs[0].token_ids, hf_greedy(model, prompt, NEW))
    return out.outputs[0].token_ids, out.num_cached_tokens


def conversations(llm: LLM, model: str, n: int) -> list[tuple[list[int], list[int]]]:
    """Turn 1 of ``n`` conversations (40 tokens: 5 full blocks computed), then fillers that
    push them out of the device pool and the small host tier; returns (turn 2's prompt, the
    history's 5 block hashes) per conversation, each of those blocks on disk only."""
    turns = []
    for i in range(n):
        turn1 = random_prompt(40, seed=10 + i)
        out, _ = generate(llm, model, turn1)
        turns.append((turn1 + out + random_prompt(16, seed=30 + i),
                      hash_blocks(turn1 + out, BS)[:5]))
    for seed in (2, 3, 4):
        generate(llm, model, random_prompt(60, seed=seed))
    tiers = llm.engine.block_manager.tiers
    assert tiers.disk.wait_idle(30.0)
    for _, hashes in turns:
        assert all(h in tiers.disk.hashes() and h not in tiers._lru
                   and h not in llm.engine.block_manager.hash_to_block for h in hashes)
    return turns


def test_history_restored_from_disk_and_found_after_restart(tiny_model, tmp_path) -> None:
    model = tiny_model()
    llm = tiered_llm(model, tmp_path / "kv")
    try:
        [(turn2, hashes)] = conversations(llm, model, 1)
        before = llm.engine.stats()
        _, cached = generate(llm, model, turn2)
        after = llm.engine.stats()
        assert cached == 5 * BS
        assert after["kv_offload_hit_blocks_disk"] - before["kv_offload_hit_blocks_disk"] == 5
        assert (after["kv_offload_bytes_restored_disk"]
                - before["kv_offload_bytes_restored_disk"]) == 5 * BLOCK_BYTES
        assert after["kv_offload_saved_blocks_disk"] >= 5 and after["kv_offload_disk_misses"] == 0
        llm.engine.check_no_leaks()
    finally:
        llm.close()
    again = tiered_llm(model, tmp_path / "kv")  # a new engine: the files are indexed at start
    try:
        assert set(hashes) <= set(again.engine.block_manager.lower_cached_hashes())
        _, cached = generate(again, model, turn2)
        assert cached == 5 * BS and again.engine.stats()["kv_offload_hit_blocks_disk"] == 5
        again.engine.check_no_leaks()
    finally:
        again.close()


def test_corrupt_truncated_deleted_files_are_misses(tiny_model, tmp_path) -> None:
    """(With chunked prefill: 16 tokens a step.)"""
    model = tiny_model()
    llm = tiered_llm(model, tmp_path / "kv", chunk=16)
    try:
        (a, ha), (b, hb), (c, hc) = conversations(llm, model, 3)
        disk = llm.engine.block_manager.tiers.disk
        data = bytearray(disk.file_of(ha[2]).read_bytes())
        data[-7] ^= 0x40  # one bit of the payload
        disk.file_of(ha[2]).write_bytes(bytes(data))
        disk.file_of(hb[0]).write_bytes(disk.file_of(hb[0]).read_bytes()[:HEADER.size + 10])
        disk.file_of(hc[3]).unlink()
        assert [generate(llm, model, t)[1] for t in (a, b, c)] == [2 * BS, 0, 3 * BS]
        stats = llm.engine.stats()
        assert stats["kv_offload_disk_misses"] == 3
        assert not ({ha[2], hb[0], hc[3]} & set(disk.hashes()))
        llm.engine.check_no_leaks()
    finally:
        llm.close()


def _tier(path: Path, fingerprint: bytes, capacity: int) -> DiskTier:
    return DiskTier(str(path), capacity * (HEADER.size + 4 * BS + 64) / 2**30, fingerprint,
                    BS, payload_bytes=64)


def test_foreign_files_and_size_bound(tmp_path) -> None:
    tier = _tier(tmp_path, b"A" * 16, capacity=3)
    try:
        tok = lambda i: (i,) * BS  # noqa: E731
        for h in range(1, 5):
            assert tier.admit(h, tok(h)) == ([1] if h == 4 else [])
            tier.write(h, tok(h), bytes([h]) * 64)
        assert tier.wait_idle(10.0)
        assert sorted(p.name for p in tmp_path.iterdir()) == \
            [tier.file_of(h).name for h in (2, 3, 4)]  # the oldest file went
        assert tier.read(3, tok(3)) == bytearray([3]) * 64
        assert tier.read(2, tok(9)) is None and tier.misses == 1  # other tokens: a miss
    finally:
        tier.close()
    other = _tier(tmp_path, b"B" * 16, capacity=3)  # another model's files: not indexed
    try:
        assert other.hashes() == []
        other.admit(3, (3,) * BS)
        assert other.read(3, (3,) * BS) is None and other.misses == 1
    finally:
        other.close()
    same = _tier(tmp_path, b"A" * 16, capacity=3)
    try:
        assert sorted(same.hashes()) == [4]  # 2 dropped (miss), 3 deleted by the foreign miss
    finally:
        same.close()


def test_disk_size_too_small_names_the_field(tmp_path) -> None:
    with pytest.raises(ValueError, match="kv_offloading_disk.size"):
        _tier(tmp_path, b"A" * 16, capacity=0)
