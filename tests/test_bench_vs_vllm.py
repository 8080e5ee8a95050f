"""scripts/bench_vs_vllm.py --smoke: pd-cluster's side of the comparison with vLLM (offline
child, a 1P1D and a colocated cluster, closed-loop and streamed loads) runs to its last line
on a tiny model. vLLM's side needs its own venv and minutes: it is not run here; the figures
are meaningless here."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pd_cluster.serving.cluster.testing import REPO_ROOT


@pytest.mark.timeout(900)  # a benchmark subprocess (its own bound: 600 s)
def test_bench_vs_vllm_smoke() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, "scripts/bench_vs_vllm.py", "--smoke"], cwd=REPO_ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    lines = proc.stdout.strip().splitlines()
    assert lines[-1].startswith("vs_vllm_offline=n/a vs_vllm_served_tok_s=n/a"), out
    for figure in ("offline pd", "served  pd", "served  colocated", "stream  colocated"):
        assert any(figure in ln for ln in lines), (figure, out)
    # where each engine thread's time went while serving (decode-0 produced the tokens)
    split = [ln for ln in lines if ln.startswith("  [pd] decode-0:") and "output steps" in ln]
    assert split and " 0 tokens" not in split[0], out


def test_bench_vs_vllm_rejects_unknown_parts() -> None:
    proc = subprocess.run([sys.executable, "scripts/bench_vs_vllm.py", "--parts", "nope",
                           "--skip-vllm"], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "unknown part(s) ['nope']" in proc.stderr
