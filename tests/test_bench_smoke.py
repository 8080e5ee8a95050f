"""Every benchmark still runs: each scripts/bench_*.py with ``--smoke`` (a tiny load, a few
seconds), as a user runs it, so an interface change cannot break one unnoticed. The figures are
meaningless here; only that the script runs to its last line.

bench_serving.py --smoke runs in tests/test_gpu_check_cpu.py (against the launched cluster);
bench_proxy.py and bench_offline.py have their own tests.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from pd_cluster.serving.cluster.testing import REPO_ROOT

pytestmark = pytest.mark.timeout(600)  # each benchmark script runs as a subprocess

SMOKES = [  # (script, the start of its last line)
    ("bench_kernels.py", "decode_attention_bw_fraction="),  # CPU: the Triton interpreter
    ("bench_pipe.py", "8Mi "),
    ("bench_kv_transfer.py", "kv_transfer_efficiency="),
    ("bench_multiturn.py", "ttft_p50_speedup="),  # 1P1D twice: baseline and prefix-aware
    ("bench_attention.py", "cpu_attention_offline_ratio_vs_torch="),  # both CPU backends
    ("bench_linear.py", "linear_gemm_fraction_eager="),  # eager and compiled, tiny model
    ("bench_linear_kernels.py", "linear_kernels_speedup_vs_torch"),  # CPU GEMM kernels
    ("bench_grammar_backends.py", "vocab"),  # xgrammar vs llguidance vs outlines-core
    ("bench_structured.py", "batch="),  # TPOT with and without a JSON schema
    ("bench_offload.py", "cached_share_host="),  # colocated: off, host, host+disk KV tiers
    ("bench_planner.py", "planner_goodput_vs_best_fixed="),  # simulator only, 8 slots
    ("bench_spec_decode.py", "spec_speedup_grounded_b1="),  # ngram, draft_model; offline, 1P1D
    ("bench_kv_bytes.py", "gpt_oss_ship_ratio_"),  # window shipping and FP8 KV, tiny P/D pair
]
# Two scripts at a time: most of a smoke is one process's start-up (imports, a model, a Ray
# cluster) on one thread, and the figures are not read, so a second one uses the other core.
SIDE_BY_SIDE = 2
SCRIPT_TIMEOUT_S = 400.0


class SmokeRuns:
    """Runs the scripts (in SMOKES' order, the tests' order) SIDE_BY_SIDE at once; a test waits
    for its own script only: the ones before it were started, and waited for, by the tests
    before it."""

    def __init__(self, out_dir: Path, scripts: list[str]):
        self.out_dir = out_dir
        self.procs: dict[str, subprocess.Popen] = {}
        self.stopping = False
        self.lock = threading.Lock()
        self.pool = ThreadPoolExecutor(SIDE_BY_SIDE)
        self.results: dict[str, Future] = {s: self.pool.submit(self._run, s) for s in scripts}

    def _run(self, script: str) -> tuple[int, str, str]:
        out = self.out_dir / script
        with open(f"{out}.out", "w") as stdout, open(f"{out}.err", "w") as stderr:
            with self.lock:
                if self.stopping:
                    return -1, "", "not run: the module ended first"
                proc = self.procs[script] = subprocess.Popen(
                    [sys.executable, f"scripts/{script}", "--smoke"], cwd=REPO_ROOT,
                    env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=stdout, stderr=stderr,
                    text=True, start_new_session=True)  # its children go with it (close)
            try:
                proc.wait(SCRIPT_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self._kill(proc)
        return (proc.returncode, Path(f"{out}.out").read_text(),
                Path(f"{out}.err").read_text())

    def result(self, script: str) -> tuple[int, str, str]:
        return self.results[script].result(timeout=SCRIPT_TIMEOUT_S + 60)

    @staticmethod
    def _kill(proc: subprocess.Popen) -> None:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)

    def close(self) -> None:
        """Nothing left running when the module ends (a test failed or was deselected)."""
        with self.lock:
            self.stopping = True
            for proc in self.procs.values():
                self._kill(proc)
        self.pool.shutdown(wait=True, cancel_futures=True)


@pytest.fixture(scope="module")
def smoke_runs(request: pytest.FixtureRequest,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[SmokeRuns]:
    selected = {item.callspec.params["script"] for item in request.session.items
                if getattr(item, "originalname", None) == "test_bench_smoke"
                and item.path == request.path}  # -k / a node id: only those scripts run
    runs = SmokeRuns(tmp_path_factory.mktemp("bench-smoke"),
                     [s for s, _ in SMOKES if s in selected])
    try:
        yield runs
    finally:
        runs.close()


@pytest.mark.parametrize("script, last_line", SMOKES)
def test_bench_smoke(script: str, last_line: str, smoke_runs: SmokeRuns) -> None:
    returncode, stdout, stderr = smoke_runs.result(script)
    out = stdout + stderr
    assert returncode == 0, out
    assert stdout.strip().splitlines()[-1].lstrip().startswith(last_line), out
    if script == "bench_kv_transfer.py":  # its shm part (issue 42) ran too
        assert "shm_efficiency=" in stdout, out


def test_every_benchmark_has_a_smoke_test() -> None:
    """A new scripts/bench_*.py needs a --smoke run in some test (named in that test file)."""
    tests = {p.name: p.read_text() for p in (REPO_ROOT / "tests").glob("test_*.py")}
    missing = [b.name for b in sorted((REPO_ROOT / "scripts").glob("bench_*.py"))
               if not any(b.name in text and "--smoke" in text for text in tests.values())]
    assert not missing, f"benchmarks without a --smoke test: {missing}"
