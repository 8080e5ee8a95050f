"""scripts/bench_vs_vllm.py --smoke: pd-cluster's side of the comparison with vLLM (offline
child, a 1P1D and a colocated cluster, closed-loop and streamed loads) runs to its last line
on a tiny model. vLLM's side needs its own venv and minutes: it is not run here; the figures
are meaningless here."""
from __future__ import annotations

import subprocess
import sys

import pytest

from pd_cluster.serving.cluster.testing import REPO_ROOT
from tests.script_runs import ScriptRuns


@pytest.mark.timeout(900)  # a benchmark subprocess (its own bound: 600 s)
@pytest.mark.script_run("bench_vs_vllm.py", ["scripts/bench_vs_vllm.py", "--smoke"],
                        timeout=600, first=True)  # the longest smoke: not alone at the end
def test_bench_vs_vllm_smoke(script_runs: ScriptRuns, request: pytest.FixtureRequest) -> None:
    run = script_runs.result(request.node)  # two at a time with the other benchmarks' smokes
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    lines = run.stdout.strip().splitlines()
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
