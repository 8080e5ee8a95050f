"""The CPU kernels' build cache (kernels/build_cache.py, kernels/cpu_build.py): keyed by the
CPU's features on every architecture, private folders, no unsafe ``.so`` loaded, old builds
pruned but never one in use."""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest

from kernels import build_cache, cpu_build


def fake_build(root: Path, key: str, age_s: float = 0.0) -> Path:
    build = root / f"{build_cache.PREFIX}{key}"
    build.mkdir(mode=0o700, parents=True)
    (build / f"{build.name}.so").write_bytes(b"\x7fELF")
    stamp = time.time() - age_s
    os.utime(build, (stamp, stamp))
    return build


def test_key_follows_the_cpu_features_on_aarch64_too(monkeypatch) -> None:
    """The key hashes host_facts.cpu_features(): x86 "flags" and aarch64 "Features" alike, so
    a -march=native build is never reused on a CPU with other features (SIGILL)."""
    monkeypatch.setattr(cpu_build, "cpu_features", lambda: "aarch64: asimd fp sve")
    sve = cpu_build.build_key("native")
    monkeypatch.setattr(cpu_build, "cpu_features", lambda: "aarch64: asimd fp")
    assert cpu_build.build_key("native") != sve


def test_prune_keeps_the_newest_and_drops_old_ones(tmp_path) -> None:
    root = tmp_path / "cache"
    builds = [fake_build(root, f"{i:016x}", age_s=100.0 * i) for i in range(6)]
    current = fake_build(root, "current0000000000", age_s=10_000.0)  # oldest, but ours
    removed = build_cache.prune(root, current.name, keep=3)
    assert sorted(removed) == sorted(b.name for b in builds[3:])
    assert all(b.exists() for b in builds[:3]) and current.exists()
    assert not any(p.name.startswith(builds[5].name) for p in root.iterdir())  # locks too


def test_prune_drops_builds_unused_for_long(tmp_path) -> None:
    root = tmp_path / "cache"
    fresh, stale = fake_build(root, "a" * 16), fake_build(root, "b" * 16, age_s=40 * 86400.0)
    assert build_cache.prune(root, "none", keep=8) == [stale.name]
    assert fresh.exists()


def test_prune_never_removes_a_build_in_use_or_being_built(tmp_path) -> None:
    """Another process's locks (an open file description of its own: flock conflicts across
    descriptions, even in one process): one loaded build (shared ``.inuse``), one being built
    (``.flock``)."""
    root = tmp_path / "cache"
    loaded, building, idle = (fake_build(root, c * 16, age_s=40 * 86400.0) for c in "abc")
    with build_cache.build_lock(loaded, timeout_s=5.0):
        in_use = build_cache.hold_in_use(loaded)
    try:
        with build_cache.build_lock(building, timeout_s=5.0):
            assert build_cache.prune(root, "none", keep=0) == [idle.name]
    finally:
        os.close(in_use)
    assert loaded.exists() and building.exists()
    assert sorted(build_cache.prune(root, "none", keep=0)) == [loaded.name, building.name]


def test_an_unsafe_library_is_not_loaded_but_rebuilt(tmp_path, caplog) -> None:
    """A ``.so`` others may write (or a symlink to one) is removed with its folder before
    loading; ``seal`` leaves our own builds writable by us alone, so they pass next time."""
    build = fake_build(tmp_path / "cache", "c" * 16)
    so = build / f"{build.name}.so"
    so.chmod(0o666)
    with caplog.at_level(logging.WARNING):
        build_cache.prepare(build)
    assert build.is_dir() and not so.exists()  # an empty private folder: torch builds anew
    assert "writable by other users" in caplog.text
    target = tmp_path / "elsewhere.so"
    target.write_bytes(b"\x7fELF")
    so.symlink_to(target)
    build_cache.prepare(build)
    assert not os.path.lexists(so) and target.exists()
    so.write_bytes(b"\x7fELF")
    so.chmod(0o775)  # as the compiler leaves it under umask 002
    build_cache.seal(build)
    build_cache.prepare(build)
    assert so.exists() and so.stat().st_mode & 0o777 == 0o755


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another user")
def test_a_library_owned_by_another_user_is_not_loaded(tmp_path) -> None:
    build = fake_build(tmp_path / "cache", "d" * 16)
    so = build / f"{build.name}.so"
    os.chown(so, 12345, -1)
    build_cache.prepare(build)
    assert not so.exists()


def test_an_unsafe_cache_folder_is_refused_loudly(tmp_path, monkeypatch, caplog) -> None:
    """A cache folder other users may write: no build is loaded from it, one warning names
    why, and the engine's stats say failed (attention_backend auto then uses torch)."""
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    monkeypatch.setenv("PD_CLUSTER_KERNEL_CACHE", str(shared))
    monkeypatch.setattr(cpu_build, "_state", {})
    with caplog.at_level(logging.WARNING):
        assert not cpu_build.load_cpu_kernels()
    assert "writable by other users" in cpu_build.load_error()
    assert "CPU kernels unavailable" in caplog.text
    assert cpu_build.kernel_stats() == {"cpu_kernels": f"failed: {cpu_build.load_error()}",
                                        "cpu_kernels_loaded": 0}
    assert list(shared.iterdir()) == []


def test_kernel_stats_off_when_disabled_or_not_tried(monkeypatch) -> None:
    monkeypatch.setattr(cpu_build, "_state", {})
    assert cpu_build.kernel_stats() == {"cpu_kernels": "off", "cpu_kernels_loaded": 0}
    monkeypatch.setenv("PD_CLUSTER_CPU_KERNELS", "0")
    assert not cpu_build.load_cpu_kernels()
    assert cpu_build.kernel_stats()["cpu_kernels"] == "off"


def _open_count(path: Path) -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}") == str(path)
        except OSError:
            pass
    return n


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc")
def test_a_lock_won_on_a_pruned_lock_file_is_taken_again(tmp_path) -> None:
    """A process waiting on a build's lock while the pruner removes the build (and unlinks
    the lock file) must not build under a lock that no longer guards the path: it re-takes
    the lock at the path."""
    import fcntl
    import threading

    from pd_cluster.private_files import open_private
    build = fake_build(tmp_path / "cache", "e" * 16)
    lock = build.parent / f"{build.name}.flock"
    pruner = open_private(lock)
    fcntl.flock(pruner, fcntl.LOCK_EX)
    entered, leave = threading.Event(), threading.Event()

    def waiter() -> None:
        with build_cache.build_lock(build, timeout_s=30.0):
            entered.set()
            leave.wait(30.0)

    thread = threading.Thread(target=waiter, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30.0
    while _open_count(lock) < 2:  # the waiter holds the old file open, polling its lock
        assert time.monotonic() < deadline, "the waiter never opened the lock file"
        time.sleep(0.01)
    lock.unlink()  # as prune() does, still holding the lock
    os.close(pruner)
    try:
        assert entered.wait(30.0)
        probe = open_private(lock)  # the file now at the path: the waiter must hold it
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(probe)
    finally:
        leave.set()
        thread.join(30.0)


def test_sources_compile_from_the_build_folder_whichever_checkout_loads(tmp_path,
                                                                        monkeypatch) -> None:
    """Two checkouts with the same sources (a clone and a worktree) share a build key: both
    compile the copies in the build folder, so the build's commands (and ninja's view of them)
    are the same from either, and a load from the other does not rebuild."""
    builds = tmp_path / "cache"
    build = fake_build(builds, "k")
    staged = []
    for checkout in ("a", "b"):
        (tmp_path / checkout).mkdir()
        src, header = tmp_path / checkout / "k.cpp", tmp_path / checkout / "k.h"
        src.write_text('#include "k.h"\n')
        header.write_text("// h\n")
        monkeypatch.setattr(cpu_build, "_SOURCES", [src])
        monkeypatch.setattr(cpu_build, "_HEADERS", [header])
        staged.append(cpu_build.staged_sources(build))
        if checkout == "a":
            mtime = (build / "src" / "k.cpp").stat().st_mtime_ns
    assert staged[0] == staged[1] == [build / "src" / "k.cpp"]
    assert (build / "src" / "k.h").read_text() == "// h\n"
    assert (build / "src" / "k.cpp").stat().st_mtime_ns == mtime  # unchanged: not rewritten
