"""scripts/bench_planner_real.py --smoke: the SLO controller (planner.enabled) deciding on its
own over a real 3-slot cluster of the built-in model while a load shifts phase. At least one
decision is made (a switch to prefill under long prompts), every output equals offline greedy
generation, no request is lost, and no engine holds a request, KV block or KV hold after."""
from __future__ import annotations

import importlib.util

import pytest

from pd_cluster.serving.cluster.testing import REPO_ROOT

pytestmark = pytest.mark.timeout(600)  # a Ray cluster's start-up on 2 shared cores


def _script():
    spec = importlib.util.spec_from_file_location(
        "bench_planner_real", REPO_ROOT / "scripts" / "bench_planner_real.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_controller_switches_a_real_cluster_losslessly(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("PD_CLUSTER_STATE_DIR", str(tmp_path))
    bench = _script()
    r = bench.run(bench.parse_args(["--smoke"]))
    bench.report(r)
    out = capsys.readouterr().out
    assert sum(r["metric"].values()) >= 1, out
    assert r["decisions"] and r["decisions"][0]["action"] == "switch", out
    assert r["lost"] == [] and r["differ"] == [], out
    assert r["leaks"] == [], out
    assert "real_outputs_equal=True requests_lost=0 leaks=none" in out
