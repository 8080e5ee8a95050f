"""`pd-cluster launch` as a user runs it: a subprocess, real HTTP, then Ctrl-C (or detach + stop).

Afterwards nothing may be left: no proxy port, no engine processes, no Ray instance.
"""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pd_cluster.serving.cluster.launcher import ClusterState
from pd_cluster.serving.cluster.ray_runtime import pid_alive
from pd_cluster.serving.cluster.testing import REPO_ROOT, wait_until
from tests.launch_helpers import URL_RE, Launcher, _cli, _env

pytestmark = pytest.mark.timeout(900)  # `pd-cluster launch` subprocesses start Ray clusters
DETACH_TEST = "test_launch_detach_status_stop"


@pytest.fixture(scope="module", autouse=True)
def detached_launch(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
                    ) -> Iterator[tuple[Path, subprocess.Popen] | None]:
    """The detach test's `pd-cluster launch --detach`, started with the module: its Ray
    instance and engines come up while the first test's attached launch runs (two launches
    side by side, as the benchmarks' smokes run: each its own Ray, namespace, state dir and
    port; ~20 s of CI time). (state dir, process); None when that test is not selected."""
    if not any(item.name == DETACH_TEST for item in request.session.items):
        yield None
        return
    tmp = tmp_path_factory.mktemp("detach")
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    # A first run on a machine: no ~/.ray/auth_token yet (our token-auth head needs one).
    env.pop("RAY_AUTH_MODE", None)
    env.update(PD_CLUSTER_STATE_DIR=str(tmp), OMP_NUM_THREADS="1", HOME=str(tmp / "home"),
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH"))
                                          if p))
    with open(tmp / "launch.out", "w") as out, open(tmp / "launch.err", "w") as err:
        proc = subprocess.Popen(  # output to files: pipes read only later could fill and stall
            [sys.executable, "-m", "pd_cluster.cli", "launch", "--config", "configs/local.yaml",
             "--port", "0", "--namespace", f"test-detach-{os.getpid()}", "--detach",
             "--no-progress", "--set", "engine.num_kv_blocks=256"],
            cwd=REPO_ROOT, env=env, stdout=out, stderr=err, text=True)
    try:
        yield tmp, proc
    finally:  # the test failed or never ran: no launcher, no Ray head left behind
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("PD_CLUSTER_STATE_DIR", str(tmp))
            state = ClusterState.load(f"test-detach-{os.getpid()}")
        if state is not None and state.head_pid and pid_alive(state.head_pid):
            os.kill(state.head_pid, signal.SIGTERM)


def _port_closed(url: str) -> bool:
    host, port = url.rsplit("//", 1)[1].rsplit(":", 1)
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex((host, int(port))) != 0


def _serve_one(url: str) -> None:
    r = httpx.post(f"{url}/v1/completions", timeout=60, json={
        "model": "tiny-llama", "prompt": "Hello from a user", "max_tokens": 8})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


def _engine_pids(url: str) -> list[int]:
    st = httpx.get(f"{url}/cluster/status", timeout=30).json()
    assert {e["name"] for e in st["engines"]} == {"prefill-0", "decode-0"}
    assert all(e["healthy"] for e in st["engines"])
    return [e["pid"] for e in st["engines"]]


def test_launch_serve_then_ctrl_c_leaves_nothing(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    env = _env(tmp_path, monkeypatch)
    ns = f"test-launch-{os.getpid()}"
    launcher = Launcher(["launch", "--config", "configs/local.yaml", "--port", "0",
                         "--namespace", ns, "--set", "engine.num_kv_blocks=256"], env)
    try:
        url = launcher.wait_for_url()
        _serve_one(url)
        pids = _engine_pids(url)
        status = _cli(["status", "--namespace", ns], env)
        assert status.returncode == 0, status.stderr
        assert re.search(r"decode-0\s+decode\s+ok", status.stdout), status.stdout
        state = ClusterState.load(ns)
        assert state is not None and state.address and not state.detached
        gcs = f"http://{state.address}"

        os.killpg(launcher.proc.pid, signal.SIGINT)  # Ctrl-C in a terminal: the whole group
        os.killpg(launcher.proc.pid, signal.SIGINT)  # ... twice, impatiently: no deadlock
        assert launcher.proc.wait(timeout=60) == 0, "".join(launcher.output)
    finally:
        launcher.kill()
    out = "".join(launcher.output)
    assert "stopped in" in out, out
    assert _port_closed(url), "proxy port still open"
    assert _port_closed(gcs), "the launcher's Ray instance is still running"
    wait_until(lambda: not any(pid_alive(p) for p in pids), 30, "engine processes to exit")
    assert ClusterState.load(ns) is None


def test_launch_detach_status_stop(detached_launch: tuple[Path, subprocess.Popen],
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    tmp_path, launch = detached_launch  # started with the module (the fixture)
    env = _env(tmp_path, monkeypatch)
    env.update(HOME=str(tmp_path / "home"))  # as the launch ran: an empty HOME, no auth mode
    env.pop("RAY_AUTH_MODE", None)
    ns = f"test-detach-{os.getpid()}"
    launch.wait(timeout=240)
    done = subprocess.CompletedProcess(launch.args, launch.returncode,
                                       (tmp_path / "launch.out").read_text(),
                                       (tmp_path / "launch.err").read_text())
    state = ClusterState.load(ns)
    try:
        assert done.returncode == 0, done.stdout + done.stderr
        m = URL_RE.search(done.stdout)
        assert m and state is not None and state.detached and state.head_pid
        url = m.group(1)
        _serve_one(url)  # still serving after the launcher exited
        pids = _engine_pids(url)
        status = _cli(["status", "--namespace", ns], env)
        assert status.returncode == 0 and "prefill-0" in status.stdout, status.stderr
        stop = _cli(["stop", "--namespace", ns], env)
        assert stop.returncode == 0, stop.stdout + stop.stderr
    finally:
        if state is not None and state.head_pid and pid_alive(state.head_pid):
            os.kill(state.head_pid, signal.SIGTERM)  # never leave a Ray head behind
    assert _port_closed(url)
    assert not pid_alive(state.head_pid)
    wait_until(lambda: not any(pid_alive(p) for p in pids), 30, "engine processes to exit")
    assert ClusterState.load(ns) is None
    assert (tmp_path / "home" / ".ray" / "auth_token").is_file()  # made for the head
