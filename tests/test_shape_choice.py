"""The shape a cluster takes from the SLO: the colocated engine's capacity model, the
comparison with the best P/D split on the same cores, `mode: auto` in a config (explicit mode
and replica counts win; profiles measured at the wrong thread count or a missing workload are
errors naming the key), and `pd-cluster plan --colocated-profile`."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pd_cluster.planner.colocated_model import ColocatedModel
from pd_cluster.planner.perf_model import PerfModel, Slo
from pd_cluster.planner.profile_table import (DecodePoint, PrefillPoint, Profile, ProfileKey,
                                             TransferPoint)
from pd_cluster.planner.shape import compare_shapes
from pd_cluster.planner.workload import Workload
from pd_cluster.serving.cluster.cluster_config import parse_config
from pd_cluster.serving.cluster.schema import ConfigError

SLO = Slo(4.0, 0.04, 90)
LONG_PROMPTS = Workload.from_lengths(2048, 128, 0.25)


def profile(threads: int, prefill_speedup: float = 1.0, decode_speedup: float = 1.0) -> Profile:
    """bench-50m-shaped costs on one core, divided by how a second thread speeds each up."""
    return Profile(
        key=ProfileKey(model="synthetic", dtype="bfloat16", device=f"cpu x{threads}",
                       pipe="zmq/tcp"),
        prefill=[PrefillPoint(tokens=n, seconds=(0.005 + 5e-4 * n + 2e-8 * n * n)
                              / prefill_speedup, kv_bytes=24576 * n) for n in (128, 512, 2048)],
        decode=[DecodePoint(batch=b, context=c, seconds=(0.008 + 4e-4 * b + 1.5e-7 * b * c)
                            / decode_speedup) for b in (1, 8, 32) for c in (128, 2048)],
        transfer=[TransferPoint(kv_bytes=24576 * n, seconds=0.002 + 24576 * n / 1e9)
                  for n in (128, 2048)])


def test_colocated_model_holds_its_targets_up_to_its_capacity():
    colo = ColocatedModel(profile(2, 1.9, 1.6), LONG_PROMPTS, SLO)
    cap = colo.capacity()
    assert cap > 0
    for rate in (0.25 * cap, 0.9 * cap):
        assert colo.tpot(rate) <= SLO.tpot_s and colo.ttft(rate) <= SLO.ttft_s
        assert 0 < colo.goodput(rate) <= rate
    assert colo.ttft(0.25 * cap) < colo.ttft(0.9 * cap)  # the queue grows with the load
    assert colo.tpot(0.25 * cap) < colo.tpot(0.9 * cap)  # so does the prompts' share of steps
    # past the rate the cores can prefill at all, nothing meets the targets
    assert colo.goodput(1.01 / colo.es) == 0.0 and colo.tpot(1.01 / colo.es) == float("inf")


def test_a_small_node_goes_colocated_when_two_threads_pay_and_pd_when_they_do_not():
    pd_model = PerfModel(profile(1), LONG_PROMPTS, SLO)
    scaling = compare_shapes(pd_model, ColocatedModel(profile(2, 1.9, 1.6), LONG_PROMPTS, SLO),
                             engines=2, cores=2)
    assert scaling.mode == "colocated" and scaling.colocated_rate > scaling.pd_rate > 0
    assert scaling.line.startswith("colocated: one engine on 2 cores serves ")
    assert f"1P1D {scaling.pd_rate:.3g}" in scaling.line
    flat = compare_shapes(pd_model, ColocatedModel(profile(2, 1.05, 1.0), LONG_PROMPTS, SLO),
                          engines=2, cores=2)
    assert flat.mode == "disaggregated" and flat.pd_rate >= flat.colocated_rate
    assert flat.line.startswith("disaggregated (1P1D): serves ")


def test_profiles_of_different_models_are_not_compared():
    other = profile(2).model_copy(update={"key": profile(2).key.model_copy(
        update={"model": "other"})})
    with pytest.raises(ValueError, match="same model"):
        compare_shapes(PerfModel(profile(1), LONG_PROMPTS, SLO),
                       ColocatedModel(other, LONG_PROMPTS, SLO), engines=2, cores=2)


def _auto(tmp_path: Path, colocated: Profile, **extra) -> dict:
    profile(1).save(tmp_path / "pd.json")
    colocated.save(tmp_path / "colo.json")
    data = {"planner": {"profile": str(tmp_path / "pd.json"),
                        "colocated_profile": str(tmp_path / "colo.json"),
                        "input_len": 2048, "output_len": 128},
            "proxy": {"slo": {"ttft_ms": 4000.0, "tpot_ms": 40.0}},
            "kv_transfer": {"host": "127.0.0.1"}}
    data.update(extra)
    return data


def test_auto_config_takes_the_shape_the_profiles_choose_with_its_line(tmp_path):
    cfg = parse_config(_auto(tmp_path, profile(2, 1.9, 1.6)))
    assert cfg.mode == "colocated" and cfg.shape_note.startswith("colocated: one engine on 2")
    (spec,) = cfg.engine_specs()
    assert spec.role == "colocated" and spec.num_cpus == 2
    assert spec.engine_args["tpot_target_ms"] == 40.0  # mixes within the SLO it was chosen for
    # what the proxy re-validates from is the chosen shape, not `auto` again
    assert parse_config(cfg.to_dict()).mode == "colocated"
    pd = parse_config(_auto(tmp_path, profile(2, 1.05, 1.0)))
    assert pd.mode == "disaggregated" and pd.shape_note.startswith("disaggregated (1P1D)")
    assert [s.role for s in pd.engine_specs()] == ["prefill", "decode"]


def test_explicit_mode_and_replicas_win_over_the_profiles(tmp_path):
    forced = parse_config(_auto(tmp_path, profile(2, 1.9, 1.6), mode="disaggregated"))
    assert forced.mode == "disaggregated" and forced.shape_note is None
    counted = parse_config(_auto(tmp_path, profile(2, 1.9, 1.6), decode={"replicas": 1}))
    assert counted.mode == "disaggregated" and "replicas" in counted.shape_note
    # no profiles: a config that describes no P/D part is one engine on the two cores P/D
    # would split (serve's default on a small node); one that does stays P/D
    bare = parse_config({"engine": {"device": "cpu"}})
    assert bare.mode == "colocated" and bare.shape_note.startswith(
        "colocated: one engine on 2 cores, where P/D would give")
    (spec,) = bare.engine_specs()
    assert spec.num_cpus == 2 and spec.role == "colocated"
    for described in ({"kv_transfer": {"host": "127.0.0.1"}}, {"prefill": {"num_cpus": 2}},
                      {"engine": {"device": "cuda"}}):
        cfg = parse_config(described)
        assert cfg.mode == "disaggregated" and "no profiles" in cfg.shape_note, described


def test_auto_names_the_key_a_comparison_lacks(tmp_path):
    with pytest.raises(ConfigError, match=r"planner\.colocated_profile: measured on cpu x1"):
        parse_config(_auto(tmp_path, profile(1)))  # the colocated table at one thread
    data = _auto(tmp_path, profile(2, 1.9, 1.6))
    del data["planner"]["output_len"]
    with pytest.raises(ConfigError, match=r"planner\.output_len"):
        parse_config(data)
    data = _auto(tmp_path, profile(2, 1.9, 1.6))
    data["planner"]["profile"] = str(tmp_path / "missing.json")
    with pytest.raises(ConfigError, match=r"planner\.profile: no file"):
        parse_config(data)


def test_plan_prints_the_shape_comparison_and_writes_the_winner(tmp_path, capsys):
    from pd_cluster.cli import main
    profile(1).save(tmp_path / "pd.json")
    profile(2, 1.9, 1.6).save(tmp_path / "colo.json")
    out = tmp_path / "cluster.yaml"
    rc = main(["plan", "--profile", str(tmp_path / "pd.json"), "--colocated-profile",
               str(tmp_path / "colo.json"), "--input-len", "2048", "--output-len", "128",
               "--range-ratio", "0.25", "--slo-ttft-ms", "4000", "--slo-tpot-ms", "40",
               "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "shape: colocated: one engine on 2 cores serves " in text, text
    cfg = parse_config(yaml.safe_load(out.read_text()))
    assert cfg.mode == "colocated" and cfg.colocated.replicas == 1
    assert cfg.colocated.num_cpus == 2 and cfg.proxy.slo.tpot_ms == 40.0


def test_plan_writes_the_colocated_shape_when_no_pd_split_meets_the_ttft(tmp_path, capsys):
    from pd_cluster.cli import main
    profile(1).save(tmp_path / "pd.json")  # a 2048-token prefill: 1.1 s on one core
    profile(2, 1.9, 1.6).save(tmp_path / "colo.json")  # 0.6 s on two
    out = tmp_path / "cluster.yaml"
    args = ["plan", "--profile", str(tmp_path / "pd.json"), "--input-len", "2048",
            "--output-len", "128", "--slo-ttft-ms", "1000", "--slo-tpot-ms", "40"]
    assert main([*args, "--colocated-profile", str(tmp_path / "colo.json"),
                 "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "P/D: --slo-ttft-ms: 1000 ms is below" in text, text
    assert "shape: colocated: one engine on 2 cores serves " in text, text
    assert parse_config(yaml.safe_load(out.read_text())).mode == "colocated"
    assert main(args) != 0  # P/D alone: the error as before, one line
    assert "--slo-ttft-ms: 1000 ms is below" in capsys.readouterr().err
