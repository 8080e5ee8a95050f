"""Engines' CPU set-up (pd_cluster/driver/cpu_setup.py): each engine claims cores of its own
and pins its compute threads there, leaving the node's reserved core to the serving path,
and starts with tcmalloc / Intel OpenMP preloaded where the node has them. Checked on the
engine process itself, read back from outside (/proc), for the stand-alone engine process
and the Ray engine actor."""
from __future__ import annotations

import logging
import os
import stat
import tempfile
from pathlib import Path

import pytest

from pd_cluster.driver.cpu_setup import (IOMP, TCMALLOC, claim_cores, claim_order,
                                         find_library, loaded_libraries, lock_dir_default,
                                         node_cores, pin_thread, preload_env)

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")


def test_claim_order_takes_reserved_cores_last() -> None:
    assert claim_order([0, 1, 2, 3], reserve=1) == [3, 2, 1, 0]
    assert claim_order([0, 1, 2, 3], reserve=2) == [3, 2, 1, 0]
    assert claim_order([4, 5, 6], reserve=0) == [6, 5, 4]
    assert claim_order([2, 5], reserve=5) == [5, 2]


def test_prefill_engines_claim_the_serving_cores_first() -> None:
    # 1P1D on 2 cores: whichever engine starts first, P shares core 0 with serving, D has 1.
    assert claim_order([0, 1], reserve=1, serving_first=True) == [0, 1]
    assert claim_order([0, 1], reserve=1) == [1, 0]
    assert claim_order([0, 1, 2, 3], reserve=1, serving_first=True) == [0, 1, 2, 3]
    assert claim_order([0, 1, 2, 3], reserve=2, serving_first=True) == [1, 0, 2, 3]


def test_prefill_and_decode_claims_do_not_depend_on_start_order(tmp_path: Path) -> None:
    cores = node_cores()
    if len(cores) < 2:
        pytest.skip("needs 2 cores")
    for prefill_first in (True, False):
        claims = {}
        for role in (("p", "d") if prefill_first else ("d", "p")):
            claims[role] = claim_cores(1, reserve=1, lock_dir=tmp_path,
                                       serving_first=role == "p")
        assert claims["p"].cores == (cores[0],) and claims["d"].cores == (cores[-1],)
        for claim in claims.values():
            claim.release()


def test_claims_are_exclusive_and_released(tmp_path: Path) -> None:
    cores = node_cores()
    first = claim_cores(1, reserve=1, lock_dir=tmp_path)
    assert first.cores == (cores[-1],)
    rest = claim_cores(len(cores) - 1, reserve=1, lock_dir=tmp_path)
    assert sorted(first.cores + rest.cores) == cores  # every core once, none twice
    none = claim_cores(1, reserve=1, lock_dir=tmp_path)
    assert none.cores == () and "0 of this node's" in none.why_not
    first.release()
    again = claim_cores(1, reserve=1, lock_dir=tmp_path)
    assert again.cores == first.cores
    with pytest.raises(ValueError, match="n:"):
        claim_cores(0)
    again.release()
    rest.release()


OTHER_UID = 54321  # a user that is not us (the tests may run as root: chown to it)


def test_default_lock_folder_is_this_users_and_private(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    claim = claim_cores(1, reserve=1)
    try:
        assert claim.cores, claim.why_not
        root = lock_dir_default()
        assert root == tmp_path / f"pd-cluster-cores-{os.geteuid()}"
        assert stat.S_IMODE(root.stat().st_mode) == 0o700
        for f in root.iterdir():
            assert stat.S_IMODE(f.stat().st_mode) == 0o600
    finally:
        claim.release()


def test_planted_symlink_is_not_followed_and_start_goes_on_unpinned(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "locks"
    root.mkdir(mode=0o700)
    victim = tmp_path / "someone-elses-file"
    victim.write_text("precious")
    for core in node_cores():
        (root / f"core-{core}.lock").symlink_to(victim)
    with caplog.at_level(logging.WARNING, logger="pd_cluster.driver.cpu_setup"):
        claim = claim_cores(1, reserve=1, lock_dir=root)
    assert claim.cores == () and "symlink" in claim.why_not
    assert victim.read_text() == "precious"  # not truncated, not written
    assert any("not pinned" in r.getMessage() for r in caplog.records)


def test_folder_of_another_user_gives_no_pinning_and_no_exception(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    root = lock_dir_default()  # pre-created by someone else, before our first engine
    root.mkdir(mode=0o755)
    try:
        os.chown(root, OTHER_UID, OTHER_UID)
    except PermissionError:
        pytest.skip("cannot chown here (not root): covered by the owner check's own tests")
    with caplog.at_level(logging.WARNING, logger="pd_cluster.driver.cpu_setup"):
        claim = claim_cores(1, reserve=1)
    assert claim.cores == () and f"uid {OTHER_UID}" in claim.why_not
    assert list(root.iterdir()) == []  # nothing created in their folder
    assert any("not pinned" in r.getMessage() for r in caplog.records)


def test_a_refused_affinity_is_a_warning_not_a_crash(caplog: pytest.LogCaptureFixture) -> None:
    import threading

    out = {}
    with caplog.at_level(logging.WARNING, logger="pd_cluster.driver.cpu_setup"):
        t = threading.Thread(target=lambda: out.update(ok=pin_thread((10 ** 6,))))
        t.start()
        t.join(30)
    assert out == {"ok": False}
    assert any("not pinned" in r.getMessage() for r in caplog.records)


def test_preload_env_names_what_is_found() -> None:
    env, missing = preload_env("/x/libother.so")
    found = [p for p in (find_library(TCMALLOC), find_library(IOMP)) if p]
    assert len(found) + len(missing) == 2
    if found:
        assert env["LD_PRELOAD"] == ":".join(found + ["/x/libother.so"])
    else:
        assert env == {}
    assert ("KMP_BLOCKTIME" in env) == (find_library(IOMP) is not None)


def _check_pinned(info: dict, expect_cores: list[int] | None) -> None:
    """The engine thread's affinity, read from /proc, is the cores it claimed, and torch
    runs one thread per core on it; the rest of the process is not pinned (serving path)."""
    pid, tid = info["pid"], info["engine_thread_id"]
    assert info["cores"], info["why_not_pinned"]
    if expect_cores is not None:
        assert info["cores"] == expect_cores
    assert os.sched_getaffinity(tid) == set(info["cores"])
    assert info["torch_threads"] == len(info["cores"])
    assert os.sched_getaffinity(pid) == set(node_cores())  # the main thread floats
    _check_preloaded(pid)


def _check_preloaded(pid: int) -> None:
    if find_library(TCMALLOC):
        assert any(n.startswith("libtcmalloc") for n in loaded_libraries(pid))


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from pd_cluster.checkpoints.maker import make_model
    return str(make_model(tmp_path_factory.mktemp("cpu") / "m", arch="llama", num_layers=2))


@pytest.mark.timeout(600)  # an engine subprocess
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores")
def test_engine_process_pins_its_thread_off_the_reserved_core(model: str, tmp_path: Path
                                                              ) -> None:
    from pd_cluster import SamplingParams
    from pd_cluster.config import EngineConfig
    from pd_cluster.engine.engine_process import EngineProcess

    # Its own TMPDIR: the core locks of engines other tests run at the same time are not ours.
    proc = EngineProcess(EngineConfig(model=model),
                         env={"TMPDIR": str(tmp_path), "OMP_NUM_THREADS": "1"}).wait_ready()
    try:
        _check_pinned(proc.call("cpu_setup"), [node_cores()[-1]])
        proc.add_request("r0", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
        assert len(proc.wait_finished(["r0"], timeout=60)["r0"]["token_ids"]) == 4
        assert proc.call("check_no_leaks") is True
    finally:
        proc.shutdown()


@pytest.mark.timeout(900)  # a Ray cluster
def test_cluster_engine_pins_its_threads(tmp_path_factory: pytest.TempPathFactory) -> None:
    import ray

    from tests.launch_helpers import launched_cluster
    from pd_cluster.serving.cluster.testing import leak_reports

    gen = launched_cluster(tmp_path_factory, "local-colocated", "cpu-setup",
                           colocated={"replicas": 1, "num_cpus": 1})
    cluster = next(gen)
    try:
        (engine,) = cluster.engines.values()
        info = ray.get(engine.cpu_setup.remote(), timeout=60)
        if info["cores"]:
            _check_pinned(info, None)
        else:  # other engines on this node hold every core: it must say so, and not pin
            assert "free" in info["why_not_pinned"]
            assert os.sched_getaffinity(info["engine_thread_id"]) == set(node_cores())
            _check_preloaded(info["pid"])
        assert leak_reports(cluster) == {}
    finally:
        gen.close()
