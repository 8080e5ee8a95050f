"""The disk tier on a shared machine: its folder and files are this user's alone (0700 /
0600), a planted symlink, a file of another user or one others may write is never indexed
nor restored (skipped and counted), and its files are keyed to every shard of the checkpoint:
a shard touched or replaced under the same path makes the old KV a miss."""
from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest

from pd_cluster.engine.kv_tiers.disk import HEADER, DiskTier
from pd_cluster.engine.kv_tiers.setup import checkpoint_fingerprint
from tests.test_kv_tiers_disk import BS, conversations, generate, tiered_llm

OTHER_UID = 54321  # a user that is not us (the tests run as root here: chown to it)
FP = b"A" * 16


def _tier(path: Path, capacity: int = 8) -> DiskTier:
    return DiskTier(str(path), capacity * (HEADER.size + 4 * BS + 64) / 2**30, FP, BS,
                    payload_bytes=64)


def _tok(i: int) -> tuple[int, ...]:
    return (i,) * BS


def _fill(tier: DiskTier, hashes: range) -> None:
    for h in hashes:
        tier.admit(h, _tok(h))
        tier.write(h, _tok(h), bytes([h]) * 64)
    assert tier.wait_idle(10.0)


def _chown_or_skip(path: Path) -> None:
    try:
        os.chown(path, OTHER_UID, OTHER_UID, follow_symlinks=False)
    except PermissionError:
        pytest.skip("cannot chown here (not root)")


def test_folder_0700_and_files_0600(tmp_path: Path) -> None:
    os.umask(old := os.umask(0o022))  # the usual umask: files would be 0644
    tier = _tier(tmp_path / "new" / "kv")
    try:
        _fill(tier, range(1, 3))
        assert stat.S_IMODE(tier.dir.stat().st_mode) == 0o700
        assert [stat.S_IMODE(f.stat().st_mode) for f in tier.dir.iterdir()] == [0o600] * 2
    finally:
        tier.close()
    assert old == os.umask(old)


def test_folder_of_another_user_is_refused_by_name(tmp_path: Path) -> None:
    (tmp_path / "kv").mkdir(mode=0o755)
    _chown_or_skip(tmp_path / "kv")
    with pytest.raises(ValueError, match="kv_offloading_disk.path.*uid 54321"):
        _tier(tmp_path / "kv")


def test_planted_and_foreign_files_are_never_indexed_nor_restored(tmp_path: Path) -> None:
    kv = tmp_path / "kv"
    tier = _tier(kv)
    try:
        _fill(tier, range(1, 6))
    finally:
        tier.close()
    # 1: a symlink to a valid block file elsewhere; 2: another user's; 3: writable by others
    elsewhere = tmp_path / "elsewhere.kvb"
    shutil.move(tier.file_of(1), elsewhere)
    tier.file_of(1).symlink_to(elsewhere)
    _chown_or_skip(tier.file_of(2))
    tier.file_of(3).chmod(0o666)
    again = _tier(kv)
    try:
        assert sorted(again.hashes()) == [4, 5]
        assert again.unsafe_files == 3
        assert again.stats()["kv_offload_disk_unsafe_files"] == 3
        # one swapped for another user's after it was indexed: a miss, never restored
        _chown_or_skip(again.file_of(4))
        assert again.read(4, _tok(4)) is None
        assert again.misses == 1 and again.unsafe_files == 4
        assert again.read(5, _tok(5)) == bytearray([5]) * 64
    finally:
        again.close()
    assert elsewhere.read_bytes()[-64:] == bytes([1]) * 64  # the symlink's target untouched


def test_a_planted_symlink_is_not_written_through(tmp_path: Path) -> None:
    tier = _tier(tmp_path / "kv")
    victim = tmp_path / "victim"
    victim.write_text("precious")
    try:
        # the writer's temporary file name, planted as a symlink before the write
        tmp = tier.file_of(7).with_name(f"{tier.file_of(7).stem}.{os.getpid()}.tmp")
        tmp.symlink_to(victim)
        _fill(tier, range(7, 8))
        assert tier.write_errors == 1 and not tier.has(7, _tok(7))
    finally:
        tier.close()
    assert victim.read_text() == "precious"


def _sharded(path: Path) -> Path:
    from pd_cluster.checkpoints.maker import make_model
    out = make_model(path, arch="llama", seed=0, vocab_size=512, hidden_size=64, num_layers=2,
                     num_heads=4, num_kv_heads=2, intermediate_size=128,
                     tie_word_embeddings=False, max_position_embeddings=2048,
                     max_shard_size="100KB")
    assert len(_shards(out)) >= 2
    return out


def _shards(model: Path) -> list[Path]:
    return sorted(Path(model).glob("*.safetensors"))


def test_fingerprint_covers_every_shard(tmp_path: Path) -> None:
    model = _sharded(tmp_path / "m")
    first = checkpoint_fingerprint(model)
    assert checkpoint_fingerprint(model) == first
    last = _shards(model)[-1]
    st = last.stat()
    os.utime(last, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # touched
    touched = checkpoint_fingerprint(model)
    assert touched != first
    last.write_bytes(last.read_bytes() + b"\0")  # replaced (another size)
    assert checkpoint_fingerprint(model) not in (first, touched)


@pytest.mark.timeout(300)
def test_a_second_shard_changed_makes_old_disk_kv_a_miss(tmp_path: Path) -> None:
    model = str(_sharded(tmp_path / "m"))
    llm = tiered_llm(model, tmp_path / "kv")
    try:
        [(turn2, hashes)] = conversations(llm, model, 1)
        llm.engine.check_no_leaks()
    finally:
        llm.close()
    last = _shards(Path(model))[-1]
    st = last.stat()  # a fine-tune saved under the same path: same config, a new shard
    os.utime(last, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    again = tiered_llm(model, tmp_path / "kv")
    try:
        assert not set(hashes) & set(again.engine.block_manager.lower_cached_hashes())
        # (the weights' bytes did not change: the output is still HF's, computed afresh)
        assert generate(again, model, turn2)[1] == 0
        assert again.engine.stats()["kv_offload_hit_blocks_disk"] == 0
        again.engine.check_no_leaks()
    finally:
        again.close()
