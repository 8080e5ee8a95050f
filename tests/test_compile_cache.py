"""The compiled-model cache (engine/compile_cache.py, engine/artifact_store.py): a key that
covers the thread count, the C++ GEMM op and the CPU's features; artifacts read only when they
are this user's and private; pruning by age and size. No compile runs here (``_compile`` is
replaced): test_compile.py compiles and loads real artifacts."""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from pd_cluster.engine import artifact_store, compile_cache
from pd_cluster.engine import compiled_model as compiled_model_module
from pd_cluster.engine.artifact_store import Limits, prune, read_artifact, write_artifact
from pd_cluster.engine.compile_cache import artifact_key
from pd_cluster.engine.compiled_model import CompiledModel
from pd_cluster.models.layers import cpu_gemm
from pd_cluster.models.loader import load_model
from pd_cluster.private_files import UnsafePath

CPU = torch.device("cpu")
OTHER_UID = 54321  # a user that is not us (we run as root in CI: chown works)


@pytest.fixture
def model(tiny_model) -> Any:
    model_dir = tiny_model(arch="llama", num_layers=1)
    hf = json.loads((Path(model_dir) / "config.json").read_text())
    return load_model(model_dir, hf, torch.float32, CPU)


@pytest.fixture
def inductor_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(path))
    return path


def key(m: Any) -> str:
    return artifact_key(m.model, m.spec, 0, 1, CPU)


# ---- the key ----------------------------------------------------------------------------------
@pytest.fixture
def threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_the_key_covers_the_thread_count(model, threads: None) -> None:
    torch.set_num_threads(1)
    one = key(model)
    torch.set_num_threads(2)
    assert key(model) != one  # inductor's C++ says num_threads(2) now
    torch.set_num_threads(1)
    assert key(model) == one


def test_the_key_covers_the_cpu_features(model, monkeypatch: pytest.MonkeyPatch) -> None:
    base = key(model)
    monkeypatch.setattr(compile_cache, "cpu_features", lambda: "aarch64: asimd fp sve")
    arm = key(model)
    monkeypatch.setattr(compile_cache, "cpu_features", lambda: "aarch64: asimd fp")
    assert len({base, arm, key(model)}) == 3  # one ARM CPU's build is not another's


def test_the_key_covers_the_cpp_gemm_op(model, monkeypatch: pytest.MonkeyPatch) -> None:
    unpacked = key(model)
    monkeypatch.setattr(cpu_gemm, "cpp_op_loaded", lambda: True)
    cpu_gemm.prepare_model(model.model, torch.float32, CPU, "packed")
    packed = [m for m in model.model.modules() if getattr(m, "packed", None) is not None]
    assert packed and all(m.packed_cpp for m in packed)
    with_op = key(model)
    for m in packed:
        m.packed_cpp = False  # the kernels failed to build: the graph calls the Python op
    assert len({unpacked, with_op, key(model)}) == 3


# ---- owner and mode checks --------------------------------------------------------------------
@dataclass
class Calls:
    saves: list[bool] = field(default_factory=list)  # each compile's ``save``
    loaded: list[bytes] = field(default_factory=list)  # each artifact unpickled


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Calls:
    """CompiledModel's compile (it saves b"fresh") and unpickling, recorded instead of run."""
    seen = Calls()

    def compile_(self: CompiledModel, device: torch.device, save: bool) -> None:
        seen.saves.append(save)
        if save:
            write_artifact(self.path, b"fresh")
    monkeypatch.setattr(CompiledModel, "_compile", compile_)
    monkeypatch.setattr(compiled_model_module, "_deserialize",
                        lambda data, decoder: seen.loaded.append(data) or object())
    # Inductor's ISA probe (builds test libraries, ~15 s here) is not what these tests check.
    monkeypatch.setattr(compiled_model_module, "skip_known_isa_probe", lambda: None)
    monkeypatch.setattr(compiled_model_module, "remember_isa_probe", lambda: None)
    return seen


def plant(model: Any, inductor_dir: Path) -> Path:
    """An artifact where ``model``'s would be."""
    path = compile_cache.artifact_dir() / f"{key(model)}{artifact_store.SUFFIX}"
    write_artifact(path, b"planted pickle")
    return path


@pytest.mark.parametrize("how", ["group-writable", "foreign-owned", "symlink"])
def test_an_unsafe_artifact_is_not_loaded(model, inductor_dir: Path, calls: Calls, how: str,
                                          caplog: pytest.LogCaptureFixture) -> None:
    path = plant(model, inductor_dir)
    if how == "group-writable":
        path.chmod(0o660)
    elif how == "foreign-owned":
        os.chown(path, OTHER_UID, OTHER_UID)
    else:
        target = path.with_name("elsewhere")
        path.rename(target)
        path.symlink_to(target)
    with caplog.at_level(logging.WARNING, logger="pd_cluster.engine.artifact_store"):
        CompiledModel(model, CPU)
    assert calls.saves == [True] and calls.loaded == []  # compiled afresh, saved over it
    assert "not using the compiled-model cache" in caplog.text
    assert path.read_bytes() == b"fresh" and not path.is_symlink()
    assert oct(path.stat().st_mode & 0o777) == oct(0o600) and path.stat().st_uid == os.geteuid()
    CompiledModel(model, CPU)  # the next start loads that one
    assert calls.saves == [True] and calls.loaded == [b"fresh"]


@pytest.mark.parametrize("which", ["artifacts", "inductor"])
def test_a_shared_cache_folder_is_neither_read_nor_written(
        model, inductor_dir: Path, calls: Calls, which: str, caplog: pytest.LogCaptureFixture
        ) -> None:
    path = plant(model, inductor_dir)
    (path.parent if which == "artifacts" else inductor_dir).chmod(0o777)  # anyone may write
    with caplog.at_level(logging.WARNING, logger="pd_cluster.engine.artifact_store"):
        for _ in range(2):
            CompiledModel(model, CPU)
    assert calls.saves == [False, False] and calls.loaded == []  # compiled, never saved
    assert path.read_bytes() == b"planted pickle"
    warnings = [r for r in caplog.records if "writable by other users" in r.getMessage()]
    assert len(warnings) == 1  # once per process


def test_read_and_write_keep_artifacts_private(tmp_path: Path) -> None:
    path = tmp_path / f"k{artifact_store.SUFFIX}"
    assert read_artifact(path) is None
    write_artifact(path, b"data")
    assert oct(path.stat().st_mode & 0o777) == oct(0o600)
    os.utime(path, (1, 1))
    assert read_artifact(path) == b"data"
    assert time.time() - path.stat().st_mtime < 3600  # its use recorded, for pruning
    os.chown(path, OTHER_UID, -1)
    with pytest.raises(UnsafePath, match="owned by uid"):
        read_artifact(path)


# ---- pruning ----------------------------------------------------------------------------------
DAY = 86400.0


def entry(folder: Path, name: str, size: int, age_days: float, now: float) -> Path:
    path = folder / f"{name}{artifact_store.SUFFIX}"
    write_artifact(path, b"x" * size)
    os.utime(path, (now - age_days * DAY, now - age_days * DAY))
    return path


def test_prune_drops_old_then_least_recently_used_and_keeps_the_newest(tmp_path: Path) -> None:
    now = time.time()
    newest = entry(tmp_path, "newest", 600, 0.5, now)
    recent = entry(tmp_path, "recent", 300, 1, now)
    older = entry(tmp_path, "older", 300, 2, now)
    stale = entry(tmp_path, "stale", 10, 40, now)
    leftover = tmp_path / f".newest{artifact_store.SUFFIX}.1.2.tmp"
    leftover.write_bytes(b"torn")
    os.utime(leftover, (now - 2 * DAY, now - 2 * DAY))
    writing = tmp_path / f".recent{artifact_store.SUFFIX}.3.4.tmp"  # a write under way
    writing.write_bytes(b"half")
    removed = prune(tmp_path, Limits(max_bytes=1000, max_age_s=30 * DAY), now)
    assert set(removed) == {older, stale}  # 600 + 300 fit in 1000, the next 300 does not
    assert newest.exists() and recent.exists() and writing.exists()
    assert not leftover.exists()
    # Over the size with one artifact alone: the newest stays all the same.
    assert prune(tmp_path, Limits(max_bytes=0, max_age_s=0), now + 100 * DAY) == [recent]
    assert newest.exists()


def test_prune_skips_an_artifact_another_process_is_using(tmp_path: Path) -> None:
    from filelock import FileLock
    now = time.time()
    entry(tmp_path, "newest", 10, 0, now)
    busy = entry(tmp_path, "busy", 10, 99, now)
    lock = FileLock(f"{busy}.lock")  # another holder (flock is per open file)
    with lock:
        assert prune(tmp_path, Limits(max_bytes=1 << 30, max_age_s=DAY), now) == []
    assert busy.exists()
    assert prune(tmp_path, Limits(max_bytes=1 << 30, max_age_s=DAY), now) == [busy]
    assert not Path(f"{busy}.lock").exists()


def test_a_compile_prunes_the_cache_once_per_process(model, inductor_dir: Path, calls: Calls,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(artifact_store.MAX_DAYS_ENV, raising=False)
    folder = compile_cache.artifact_dir()
    old = entry(folder, "old", 10, 60, time.time())
    CompiledModel(model, CPU)
    assert not old.exists() and calls.saves == [True]  # default: 30 days
    old = entry(folder, "old", 10, 60, time.time())
    CompiledModel(model, CPU)
    assert old.exists() and calls.loaded == [b"fresh"]  # pruned once per process


def test_pruning_limits_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(artifact_store.MAX_GB_ENV, raising=False)
    monkeypatch.delenv(artifact_store.MAX_DAYS_ENV, raising=False)
    assert artifact_store.limits_from_env() == Limits(2 << 30, 30 * DAY)
    monkeypatch.setenv(artifact_store.MAX_GB_ENV, "0.5")
    monkeypatch.setenv(artifact_store.MAX_DAYS_ENV, "7")
    assert artifact_store.limits_from_env() == Limits(1 << 29, 7 * DAY)
    for bad in ("-1", "lots", "nan"):
        monkeypatch.setenv(artifact_store.MAX_DAYS_ENV, bad)
        with pytest.raises(ValueError, match=artifact_store.MAX_DAYS_ENV):
            artifact_store.limits_from_env()


def test_a_truncated_kernel_in_inductors_cache_is_removed_and_only_there(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A compile killed while inductor wrote a .so leaves it short; the next compile's import
    error names it: that file goes (so the retry rebuilds it), nothing outside the cache."""
    from pd_cluster.engine.compile_cache import drop_corrupt_kernel
    cache = tmp_path / "inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
    short = cache / "pg" / "abc.main.so"
    short.parent.mkdir(parents=True)
    short.write_bytes(b"\x7fELF")
    outside = tmp_path / "other.so"
    outside.write_bytes(b"\x7fELF")
    try:
        raise ImportError(f"{outside}: file too short")
    except ImportError as e:
        assert drop_corrupt_kernel(e) is None
    assert outside.exists()
    try:
        try:
            raise ImportError(f"{short}: file too short")
        except ImportError as inner:
            raise RuntimeError("InductorError: the compile failed") from inner
    except RuntimeError as e:
        assert drop_corrupt_kernel(e) == short.resolve()
    assert not short.exists()
    assert drop_corrupt_kernel(RuntimeError("a graph break")) is None
