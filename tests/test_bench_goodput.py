"""scripts/bench_goodput.py --smoke: pd-cluster's side of the goodput-at-equal-compute grid
(the shape `serve` picks and a colocated engine on every core, told the SLO, a discarded
warm-up, Poisson arrivals, goodput per SLO cell from the detailed results) runs to its report
on a tiny model. vLLM's side needs its own venv: not run here."""
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
    lines = run.stdout.splitlines()
    for side in ("pd", "colocated"):
        assert any(ln.startswith(f"  {side} ") and "rate 4:" in ln and "failed 0" in ln
                   for ln in lines), out
        assert any(ln.startswith(f"  {side} ") and "warm-up (2 requests, discarded)" in ln
                   for ln in lines), out
        result = json.loads((run.dir / f"{side}-4.json").read_text())
        assert len(result["ttfts"]) == 6 and all(n == 8 for n in result["output_lens"])
        # one row per server under the grid's header; every request meets the smoke's SLO
        row = next(ln for ln in lines if ln.startswith(f"{' ' * 10}{side} "))
        assert float(row.split()[1]) > 0, row


def test_goodput_counts_only_requests_within_both_targets(tmp_path) -> None:
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    from bench_goodput import figures
    path = tmp_path / "r.json"
    path.write_text(json.dumps({
        "duration": 10.0, "ttfts": [0.5, 0.5, 5.0, 0.5], "output_lens": [3, 3, 3, 0],
        "itls": [[0.01, 0.01], [0.03, 0.03], [0.01, 0.01], []],
        "errors": ["", "", "", "boom"]}))
    f = figures(path, ttfts_s=[4.0, 8.0], tpots_ms=[20.0, 40.0])
    # TPOT 10 ms / 30 ms / 10 ms (TTFT 5 s: out at 4 s); the failed request counts nowhere.
    assert f["goodput"] == {(4.0, 20.0): 0.1, (4.0, 40.0): 0.2, (8.0, 20.0): 0.2,
                            (8.0, 40.0): 0.3} and f["failed"] == 1


def test_the_ratio_line_says_where_neither_server_serves_a_cell(capsys) -> None:
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    from bench_goodput import report
    cells = [(4.0, 40.0), (4.0, 60.0), (8.0, 40.0), (8.0, 60.0)]
    theirs = {"goodput": dict(zip(cells, [0.0, 0.0, 0.0, 0.2])), "ttft_p50": 1000.0,
              "tpot_p50": 50.0}
    ours = {"goodput": dict(zip(cells, [0.0, 0.1, 0.0, 0.3])), "ttft_p50": 500.0,
            "tpot_p50": 40.0}
    report({"vllm-all": {0.5: theirs}, "colocated": {0.5: ours}}, [0.5], [4.0, 8.0],
           [40.0, 60.0])
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert "colocated@0.5/4s/40ms=n/a" in line and "colocated@0.5/4s/60ms=inf" in line
    assert "colocated@0.5/8s/60ms=1.50" in line
