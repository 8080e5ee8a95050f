"""scripts/bench_goodput.py --smoke: pd-cluster's side of the goodput-at-equal-compute
comparison (a 1P1D cluster told a TPOT target, Poisson arrivals, goodput from the detailed
results) runs to its report on a tiny model. vLLM's side needs its own venv: not run here."""
from __future__ import annotations

import json
import sys

import pytest

from pd_cluster.serving.cluster.testing import REPO_ROOT
from tests.script_runs import ScriptRuns


@pytest.mark.timeout(900)  # a benchmark subprocess (its own bound: 600 s)
@pytest.mark.script_run("bench_goodput.py", ["scripts/bench_goodput.py", "--smoke",
                                             "--log-dir", "{dir}"], timeout=600)
def test_bench_goodput_smoke(script_runs: ScriptRuns, request: pytest.FixtureRequest) -> None:
    run = script_runs.result(request.node)  # two at a time with the other benchmarks' smokes
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    assert any(ln.startswith("  pd@1000") and "failed 0" in ln
               for ln in run.stdout.splitlines()), out
    assert "rate 4, TPOT<=1000ms: pd-cluster" in run.stdout, out
    result = json.loads((run.dir / "pd@1000-4.json").read_text())
    assert len(result["ttfts"]) == 6 and all(n == 8 for n in result["output_lens"])


def test_goodput_counts_only_requests_within_both_targets(tmp_path) -> None:
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    from bench_goodput import figures
    path = tmp_path / "r.json"
    path.write_text(json.dumps({
        "duration": 10.0, "ttfts": [0.5, 0.5, 5.0, 0.5], "output_lens": [3, 3, 3, 0],
        "itls": [[0.01, 0.01], [0.03, 0.03], [0.01, 0.01], []],
        "errors": ["", "", "", "boom"]}))
    f = figures(path, ttft_s=4.0, tpots_ms=[20.0, 40.0])
    # TPOT 10 ms / 30 ms / 10 ms (TTFT 5 s: out); the failed request counts nowhere.
    assert f["goodput"] == {20.0: 0.1, 40.0: 0.2} and f["failed"] == 1
