"""Scripts that tests run as subprocesses (benchmarks' --smoke runs), two at a time.

Most of such a run is one process's start-up (imports, a model, a Ray cluster) on one thread,
and the figures are not read, so a second run uses the machine's other core. A test names its
run with ``@pytest.mark.script_run(key, argv, timeout=..., first=False)`` (``{dir}`` in argv: a
folder of its own) and takes the ``script_runs`` fixture (conftest.py); when the first such
test starts, every selected test's run is queued in the tests' order (one marked ``first``
ahead of them), and each test waits for its own. The runs before a test's were waited for by
the tests before it, so a test waits for its own run alone (its bound stays its own). The runs
go on while the tests between them run: keep the tests that use this in adjacent modules
(tests/test_bench_*.py), with little else between.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from pd_cluster.serving.cluster.testing import REPO_ROOT

SIDE_BY_SIDE = 2
MARK = "script_run"


@dataclass
class ScriptResult:
    returncode: int
    stdout: str
    stderr: str
    dir: Path  # the run's own folder ({dir} in its argv)


@dataclass
class _Spec:
    argv: list[str]
    timeout: float
    first: bool = False  # started before the others (the longest: no lone run at the end)


def spec_of(item: pytest.Item) -> tuple[str, _Spec] | None:
    mark = item.get_closest_marker(MARK)
    if mark is None:
        return None
    key, argv = mark.args
    return key, _Spec(list(argv), float(mark.kwargs.get("timeout", 400.0)),
                      bool(mark.kwargs.get("first", False)))


class ScriptRuns:
    """Runs the specs in the order given, SIDE_BY_SIDE at once, each in its own session (its
    children go with it when it is killed)."""

    def __init__(self, root: Path, specs: dict[str, _Spec]):
        self.root = root
        self.specs = specs
        self.procs: dict[str, subprocess.Popen] = {}
        self.stopping = False
        self.lock = threading.Lock()
        self.pool = ThreadPoolExecutor(SIDE_BY_SIDE)
        # At most one run goes first: the others keep the tests' order, so when a test starts,
        # the runs of the tests before it are done and a worker is free for its own.
        first = [k for k, spec in specs.items() if spec.first][:SIDE_BY_SIDE - 1]
        order = first + [k for k in specs if k not in first]
        self.results: dict[str, Future] = {k: self.pool.submit(self._run, k) for k in order}

    def _run(self, key: str) -> ScriptResult:
        spec, run_dir = self.specs[key], self.root / key.replace("/", "_")
        run_dir.mkdir(parents=True)
        argv = [sys.executable, *(a.replace("{dir}", str(run_dir)) for a in spec.argv)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        env.pop("RAY_ADDRESS", None)  # each script starts its own Ray where it needs one
        with open(run_dir / "stdout", "w") as out, open(run_dir / "stderr", "w") as err:
            with self.lock:
                if self.stopping:
                    return ScriptResult(-1, "", "not run: the session ended first", run_dir)
                proc = self.procs[key] = subprocess.Popen(
                    argv, cwd=REPO_ROOT, env=env, stdout=out, stderr=err, text=True,
                    start_new_session=True)
            try:
                proc.wait(spec.timeout)
            except subprocess.TimeoutExpired:
                _kill(proc)
        return ScriptResult(proc.returncode, (run_dir / "stdout").read_text(),
                            (run_dir / "stderr").read_text(), run_dir)

    def result(self, item: pytest.Item) -> ScriptResult:
        """The run the test ``item`` names (a killed run's return code is negative)."""
        found = spec_of(item)
        assert found is not None, f"{item.nodeid} has no @pytest.mark.{MARK}"
        key, spec = found
        return self.results[key].result(timeout=spec.timeout + 60)

    def close(self) -> None:
        """Nothing left running at the session's end (a test failed before its run ended)."""
        with self.lock:
            self.stopping = True
            for proc in self.procs.values():
                _kill(proc)
        self.pool.shutdown(wait=True, cancel_futures=True)


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def selected_specs(items: list[pytest.Item]) -> dict[str, _Spec]:
    """The runs the selected tests name, in the tests' order (after -k, -m, node ids)."""
    specs: dict[str, _Spec] = {}
    for item in items:
        found = spec_of(item)
        if found is not None:
            specs.setdefault(*found)
    return specs
