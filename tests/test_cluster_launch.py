"""`pd-cluster launch` as a user runs it: a subprocess, real HTTP, then Ctrl-C (or detach + stop).

Afterwards nothing may be left: no proxy port, no engine processes, no Ray instance.
"""
from __future__ import annotations

import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from pd_cluster.serving.launcher import ClusterState
from pd_cluster.serving.ray_runtime import pid_alive
from pd_cluster.serving.testing import REPO_ROOT, wait_until

URL_RE = re.compile(r"serving on (http://[0-9.]+:\d+)")


class Launcher:
    """A `python -m pd_cluster.cli ...` subprocess whose output is read on a thread."""

    def __init__(self, args: list[str], env: dict[str, str]):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pd_cluster.cli", *args], cwd=REPO_ROOT, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True)  # our SIGINT goes to the launcher only, as we choose
        self.lines: queue.Queue[str] = queue.Queue()
        self.output: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.append(line)
            self.lines.put(line)

    def wait_for_url(self, timeout: float = 180.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=1.0)
            except queue.Empty:
                if self.proc.poll() is not None:
                    break
                continue
            m = URL_RE.search(line)
            if m:
                return m.group(1)
        self.kill()
        raise AssertionError("launcher never printed its URL:\n" + "".join(self.output))

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


def _env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    monkeypatch.setenv("PD_CLUSTER_STATE_DIR", str(tmp_path))  # ClusterState.load here too
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    env.update(PD_CLUSTER_STATE_DIR=str(tmp_path), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH"))
                                          if p))
    return env


def _cli(args: list[str], env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pd_cluster.cli", *args], cwd=REPO_ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout)


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
        assert launcher.proc.wait(timeout=60) == 0, "".join(launcher.output)
    finally:
        launcher.kill()
    out = "".join(launcher.output)
    assert "stopped in" in out, out
    assert _port_closed(url), "proxy port still open"
    assert _port_closed(gcs), "the launcher's Ray instance is still running"
    wait_until(lambda: not any(pid_alive(p) for p in pids), 30, "engine processes to exit")
    assert ClusterState.load(ns) is None


def test_launch_detach_status_stop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = _env(tmp_path, monkeypatch)
    ns = f"test-detach-{os.getpid()}"
    done = _cli(["launch", "--config", "configs/local.yaml", "--port", "0", "--namespace", ns,
                 "--detach", "--no-progress", "--set", "engine.num_kv_blocks=256"], env,
                timeout=240)
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
