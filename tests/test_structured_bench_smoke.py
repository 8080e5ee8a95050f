"""The structured-outputs benchmarks still run (``--smoke``: a tiny load, seconds): the grammar
backend comparison and the TPOT with and without a JSON schema."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pd_cluster.serving.cluster.testing import REPO_ROOT


@pytest.mark.parametrize("script, last_line", [
    ("bench_grammar_backends.py", "vocab"),
    ("bench_structured.py", "batch="),
])
def test_structured_bench_smoke(script: str, last_line: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, f"scripts/{script}", "--smoke"], cwd=REPO_ROOT,
                          env=env, capture_output=True, text=True, timeout=400)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert proc.stdout.strip().splitlines()[-1].startswith(last_line), out
