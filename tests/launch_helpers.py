"""Running `pd-cluster` as a user does (a subprocess whose output is read on a thread), and
the module-scoped cluster launched in the test process that the cluster tests share."""
from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from pd_cluster.serving.cluster.testing import (REPO_ROOT, ensure_ray, local_config,
                                                stream_completion)  # noqa: F401 (re-exported)

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


def launched_cluster(tmp_path_factory: pytest.TempPathFactory, config: str, name: str,
                     **sections: dict[str, Any]) -> Iterator[Any]:
    """For a module fixture to ``yield from``: configs/<config>.yaml with ``sections``
    overriding it, launched in this process in its own Ray namespace and state dir; shut down
    at the module's end."""
    from pd_cluster.serving.cluster.launcher import launch  # imports Ray: only when used

    mp = pytest.MonkeyPatch()
    mp.setenv("PD_CLUSTER_STATE_DIR", str(tmp_path_factory.mktemp("state")))
    try:
        ensure_ray()
        c = launch(local_config(config, f"test-{name}-{os.getpid()}", **sections),
                   progress=False)
        try:
            yield c
        finally:
            c.shutdown()
    finally:
        mp.undo()
