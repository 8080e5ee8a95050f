"""private_files: folders and files only this user may touch; host_facts: the CPU's features."""
from __future__ import annotations

import os

import pytest

from pd_cluster.host_facts import cpu_features
from pd_cluster.private_files import UnsafePath, check_private_file, open_private, private_dir


def test_private_dir_made_0700_and_world_writable_refused(tmp_path):
    d = private_dir(tmp_path / "a" / "b")
    assert d.is_dir() and (d.stat().st_mode & 0o777) == 0o700
    os.chmod(d, 0o777)
    with pytest.raises(UnsafePath, match="writable by other users"):
        private_dir(d)


def test_symlinked_dir_refused(tmp_path):
    (tmp_path / "real").mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(UnsafePath, match="not a plain folder"):
        private_dir(tmp_path / "link")


def test_open_private_creates_0600_never_follows_or_truncates(tmp_path):
    path = tmp_path / "f"
    os.close(open_private(path))
    assert (path.stat().st_mode & 0o777) == 0o600
    path.write_bytes(b"kept")
    os.close(open_private(path))
    assert path.read_bytes() == b"kept"  # no truncation on open
    victim = tmp_path / "victim"
    victim.write_bytes(b"theirs")
    (tmp_path / "planted").symlink_to(victim)
    with pytest.raises(UnsafePath, match="symlink"):
        open_private(tmp_path / "planted")
    assert victim.read_bytes() == b"theirs"


def test_check_private_file_refuses_group_writable(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"x")
    os.chmod(path, 0o620)
    with pytest.raises(UnsafePath, match="writable by other users"):
        check_private_file(path)
    os.chmod(path, 0o600)
    assert check_private_file(path) == path


def test_other_owner_refused(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("changing a file's owner needs root")
    path = tmp_path / "f"
    path.write_bytes(b"x")
    os.chown(path, 12345, 12345)
    with pytest.raises(UnsafePath, match="owned by uid 12345"):
        check_private_file(path)


def test_cpu_features_names_machine_and_sorted_flags():
    machine, _, flags = cpu_features().partition(": ")
    assert machine and flags
    if os.path.exists("/proc/cpuinfo"):
        assert flags.split() == sorted(flags.split())
