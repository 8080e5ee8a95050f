"""scripts/bench_offline.py --tensor-parallel-size 2 --smoke: runs, prints TP1 and TP2 side by
side, and the two engines' greedy outputs agree."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


pytestmark = pytest.mark.timeout(600)  # a benchmark subprocess with TP workers


def test_bench_offline_tensor_parallel_smoke() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_offline.py"), "--smoke",
                           "--tensor-parallel-size", "2"], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert any(line.startswith("output_tokens_per_s: tp1=") and " tp2=" in line for line in lines)
    assert any(line.startswith("batch1_decode_ms_per_token: tp1=") for line in lines)
    assert "greedy_outputs_equal=True" in lines
    assert lines[-1].startswith("tp2_throughput_ratio_vs_tp1=")
    float(lines[-1].split("=")[1])
