"""The planner against real engines (the built-in model, in-process, CPU): `pd-cluster profile`
then `plan` round trip to a launchable YAML, and the simulator's prediction against a small
real P/D run measured right after the profile.

Tolerance (stated in docs/deployment.md): the simulator's mean TTFT and TPOT of requests run
one at a time on a 1P1D pair are within a factor of 2 of the measured ones. Requests one at a
time keep the in-process pair honest (P and D step in one thread here: overlapping work would
be serialised in the real run but not in the simulation); it checks the costs the simulator
is built from, not queueing (that is arithmetic, tested in test_planner.py)."""
from __future__ import annotations

import statistics
import time

import pytest
import yaml

from connectors.transfer_params import RecvKV, SendKV
from pd_cluster.cli import main
from pd_cluster.planner.profile_table import Profile
from pd_cluster.planner.profiler import ProfileSetup, _engine
from pd_cluster.planner.simulator import Simulator
from pd_cluster.sampling_params import SamplingParams
from pd_cluster.serving.cluster.cluster_config import load_config
from pd_cluster.serving.cluster.model_source import check_model

pytestmark = pytest.mark.timeout(300)

GRID = ["--prompt-lengths", "16,48,96", "--batch-sizes", "1,2",
        "--context-lengths", "16,112"]
PROMPT, OUTPUT = 80, 12


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("planner") / "tiny.json"
    assert main(["profile", "--grid", "tiny", *GRID, "--out", str(path)]) == 0
    return path


def test_profile_then_plan_writes_a_launchable_config(profile_path, tmp_path, capsys):
    prof = Profile.load(profile_path)
    # the pipe the link took under the default (auto): shm on one host, zmq without /dev/shm
    assert prof.key.model == "tiny-llama" and prof.key.pipe in ("shm/tcp", "zmq/tcp")
    assert [p.tokens for p in prof.prefill] == [16, 48, 96]
    assert all(p.kv_bytes > 0 for p in prof.prefill)
    assert len(prof.decode) == 4 and len(prof.transfer) == 3
    out = tmp_path / "plan.yaml"
    assert main(["plan", "--profile", str(profile_path), "--input-len", "80", "--output-len",
                 "12", "--slo-ttft-ms", "500", "--slo-tpot-ms", "100", "--slots", "3",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "plan: " in printed and "predicted: " in printed and "not modelled" in printed
    cfg = load_config(out)
    assert cfg.prefill.replicas + cfg.decode.replicas == 3
    assert cfg.planner.profile == str(profile_path) and not cfg.planner.enabled
    assert yaml.safe_load(out.read_text())["proxy"]["slo"]["ttft_ms"] == 500


def test_plan_cli_errors_are_one_line(profile_path, capsys):
    assert main(["plan", "--profile", str(profile_path), "--slo-ttft-ms", "500",
                 "--slo-tpot-ms", "100"]) == 2
    assert "error: --input-len and --output-len" in capsys.readouterr().err
    assert main(["plan", "--profile", "/nonexistent.json", "--input-len", "4",
                 "--output-len", "4", "--slo-ttft-ms", "1", "--slo-tpot-ms", "1"]) == 2


def _run_one_at_a_time(n: int) -> list[tuple[float, float]]:
    """(TTFT, TPOT) of n requests through an in-process 1P1D pair, one after the other."""
    setup = ProfileSetup(model=check_model("tiny-llama"), model_name="tiny-llama",
                         engine_args={"device": "cpu"}, kv_transfer={"kv_transfer_timeout": 10})
    d, p = _engine(setup, "consumer"), _engine(setup, "producer")
    out = []
    try:
        endpoint = d.kv_endpoint()
        p.connect_kv_peer(endpoint)
        for i in range(n + 1):  # the first one warms both engines up (not counted)
            rid, prompt = f"r{i}", [5 + (i * 13 + j * 7) % 400 for j in range(PROMPT)]
            d.add_request(rid, prompt, SamplingParams(max_tokens=OUTPUT, ignore_eos=True),
                          RecvKV())
            while rid not in d.scheduler.remote_waiting:
                d.step()
            t0 = time.perf_counter()
            p.add_request(rid, prompt, SamplingParams(max_tokens=1, ignore_eos=True),
                          SendKV(to=endpoint))
            first = last = 0.0
            deadline = time.monotonic() + 60
            while not last:
                assert time.monotonic() < deadline, "the pair did not finish in time"
                if p.has_unfinished_requests():
                    if any(o.finished for o in p.step()) and not first:
                        first = time.perf_counter()
                for o in d.step():
                    if o.finished:
                        last = time.perf_counter()
            if i:
                out.append((first - t0, (last - first) / (OUTPUT - 1)))
        p.check_no_leaks()
        d.check_no_leaks()
    finally:
        p.close()
        d.close()
    return out


def test_simulator_predicts_a_small_real_run(profile_path):
    measured = _run_one_at_a_time(4)
    sim = Simulator(Profile.load(profile_path), 1, 1)
    sim.run([(10.0 * k, PROMPT, OUTPUT) for k in range(4)], 60.0)
    pred_ttft = statistics.mean(r.ttft for r in sim.requests)
    pred_tpot = statistics.mean(r.tpot for r in sim.requests)
    real_ttft = statistics.mean(m[0] for m in measured)
    real_tpot = statistics.mean(m[1] for m in measured)
    print(f"TTFT predicted {pred_ttft * 1e3:.1f} ms, measured {real_ttft * 1e3:.1f} ms; "
          f"TPOT predicted {pred_tpot * 1e3:.2f} ms, measured {real_tpot * 1e3:.2f} ms")
    assert 0.5 <= pred_ttft / real_ttft <= 2.0
    assert 0.5 <= pred_tpot / real_tpot <= 2.0
