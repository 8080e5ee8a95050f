"""The planner's policy and arithmetic without engines: the profile table's file round trip
and fits, the capacity model, `plan` and its YAML, the controller's hysteresis (no flapping
under steady load near a threshold; it follows a real shift), the simulator's bookkeeping,
and the config section."""
from __future__ import annotations

import json

import numpy as np
import pytest
import yaml

from pd_cluster.planner.actuator import Actuator, EngineView, Observation
from pd_cluster.planner.capacity import Capacities
from pd_cluster.planner.controller import Controller
from pd_cluster.planner.perf_model import PerfModel, Slo
from pd_cluster.planner.plan import best_split, make_plan, plan_config
from pd_cluster.planner.profile_table import (DecodePoint, PrefillPoint, Profile, ProfileKey,
                                             TransferPoint)
from pd_cluster.planner.scenarios import Phase, make_trace, run_controlled, run_fixed, score
from pd_cluster.planner.simulator import Simulator
from pd_cluster.planner.workload import Workload
from pd_cluster.serving.cluster.cluster_config import ClusterConfig
from pd_cluster.serving.cluster.config_sections import PlannerConfig
from pd_cluster.serving.cluster.schema import ConfigError

SLO = Slo(2.0, 0.05, 90)


def synthetic_profile() -> Profile:
    """Costs shaped like bench-50m on one core (prefill ~0.5 ms/token, decode ~10 ms/step)."""
    return Profile(
        key=ProfileKey(model="synthetic", dtype="float32", device="cpu x1", pipe="zmq/tcp"),
        prefill=[PrefillPoint(tokens=n, seconds=0.005 + 5e-4 * n + 2e-7 * n * n,
                              kv_bytes=24576 * n) for n in (128, 512, 2048)],
        decode=[DecodePoint(batch=b, context=c, seconds=0.008 + 4e-4 * b + 1.5e-7 * b * c)
                for b in (1, 8, 32) for c in (128, 2048)],
        transfer=[TransferPoint(kv_bytes=24576 * n, seconds=0.002 + 24576 * n / 1e9)
                  for n in (128, 2048)])


def test_profile_file_round_trip_and_fits(tmp_path):
    prof = synthetic_profile()
    path = tmp_path / "p.json"
    prof.save(path)
    back = Profile.load(path)
    assert back == prof
    # the fits recover the generating costs (exact data: no noise)
    assert back.prefill_seconds(1000) == pytest.approx(0.005 + 0.5 + 0.2, rel=1e-6)
    assert back.decode_step_seconds(16, 1000) == pytest.approx(0.008 + 0.0064 + 0.0024, rel=1e-6)
    assert back.kv_bytes(10) == pytest.approx(245760)
    assert back.transfer_rate() == pytest.approx(1e9, rel=1e-6)


def test_profile_load_names_the_bad_field(tmp_path):
    data = json.loads(synthetic_profile().model_dump_json())
    data["prefill"][0]["seconds"] = -1
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"prefill\.0\.seconds"):
        Profile.load(path)
    with pytest.raises(FileNotFoundError, match="--profile"):
        Profile.load(tmp_path / "missing.json")


def test_noisy_grid_never_predicts_falling_costs():
    prof = synthetic_profile().model_copy(update={"decode": [
        DecodePoint(batch=1, context=100, seconds=0.010),
        DecodePoint(batch=2, context=100, seconds=0.009)]})  # noise: slower at batch 1
    assert prof.decode_step_seconds(64, 100) >= prof.decode_step_seconds(1, 100) > 0


def test_capacity_model_is_monotone_and_planned_split_follows_the_workload():
    prof = synthetic_profile()
    long_prompts = PerfModel(prof, Workload.from_lengths(1536, 32, 0.25), SLO)
    long_answers = PerfModel(prof, Workload.from_lengths(128, 384, 0.25), SLO)
    assert long_prompts.ttft(0.5) < long_prompts.ttft(1.0)
    assert long_answers.tpot(2.0) < long_answers.tpot(4.0)
    a, b = make_plan(long_prompts, 8), make_plan(long_answers, 8)
    assert a.n_prefill > a.n_decode and b.n_decode > b.n_prefill
    # the predicted percentile latencies at the planned rate are within the targets
    assert a.ttft_s <= SLO.ttft_s + 1e-6 and a.tpot_s <= SLO.tpot_s + 1e-6
    assert 0 < a.goodput <= a.rate
    assert best_split(1.0, 3.0, 8) == (6, 2)
    assert best_split(1.0, 3.0, 8, (1, 4, 1, 7)) == (4, 4)


def test_plan_rejects_targets_nothing_meets():
    model = PerfModel(synthetic_profile(), Workload.from_lengths(2048, 32), Slo(0.1, 0.05))
    with pytest.raises(ValueError, match="--slo-ttft-ms"):
        make_plan(model, 4)


def test_plan_yaml_is_a_valid_cluster_config():
    model = PerfModel(synthetic_profile(), Workload.from_lengths(700, 200, 0.25), SLO)
    plan = make_plan(model, 6)
    data = plan_config(plan, {"model": "tiny-llama", "engine": {"device": "cpu"}}, model)
    cfg = ClusterConfig.from_dict(yaml.safe_load(yaml.safe_dump(data)))
    assert (cfg.prefill.replicas, cfg.decode.replicas) == (plan.n_prefill, plan.n_decode)
    assert cfg.engine["max_num_seqs"] == plan.decode_max_num_seqs
    assert cfg.proxy.slo.tpot_ms == pytest.approx(50.0)


def test_workload_from_jsonl(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text('{"prompt_tokens": 10, "max_tokens": 5}\n\n{"input_len": 3, "output_len": 7}\n')
    w = Workload.from_jsonl(path)
    assert list(w.input_lens) == [10, 3] and list(w.output_lens) == [5, 7]
    path.write_text('{"prompt": "hi"}\n')
    with pytest.raises(ValueError, match=":1: needs one of input_len"):
        Workload.from_jsonl(path)


def test_planner_config_section():
    cfg = ClusterConfig.from_dict({"planner": {"max_prefill": 4, "cooldown_s": 5}})
    assert cfg.planner.engine_budget == 12 and not cfg.planner.enabled
    with pytest.raises(ConfigError, match="planner.min_decode: 3 > max_decode 2"):
        ClusterConfig.from_dict({"planner": {"min_decode": 3, "max_decode": 2}})
    with pytest.raises(ConfigError, match="planner.profile"):
        ClusterConfig.from_dict({"planner": {"enabled": True}})
    with pytest.raises(ConfigError, match="planner.interval: unknown key"):
        ClusterConfig.from_dict({"planner": {"interval": 3}})


class _Applying:
    """An Actuator whose switches take effect at once (the controller sees its own changes)."""

    def __init__(self, n_p: int, n_d: int):
        self.roles = {f"e{i}": "prefill" if i < n_p else "decode" for i in range(n_p + n_d)}
        self.calls: list[tuple] = []

    def engines(self):
        return [EngineView(k, r, "serving") for k, r in self.roles.items()]

    def scale(self, role, count):
        self.calls.append(("scale", role, count))

    def switch_role(self, engine_id, role):
        self.calls.append(("switch", engine_id, role))
        self.roles[engine_id] = role


def _threshold_load():
    """Output length where splits 5:3 and 6:2 of 8 engines take nearly the same rate."""
    prof = synthetic_profile()
    best = None
    for out in range(300, 480, 8):
        caps = Capacities(PerfModel(prof, Workload.from_lengths(700, out, 0.25), SLO))
        r = caps.split(5, 3) / caps.split(6, 2)
        if best is None or abs(r - 1) < abs(best[0] - 1):
            best = (r, out, caps.split(5, 3))
    return best


def _reversals(hysteresis: float, out: int, rate: float) -> tuple[int, list]:
    cfg = PlannerConfig(interval_s=10, cooldown_s=30, max_engines=8, max_prefill=7,
                        max_decode=7, hysteresis=hysteresis)
    act = _Applying(5, 3)
    assert isinstance(act, Actuator)
    ctl = Controller(synthetic_profile(), SLO, cfg, act)
    rng = np.random.default_rng(0)
    for k in range(1, 181):  # half an hour of looks at a steady Poisson load
        arrived = [(int(rng.integers(525, 876)), int(rng.integers(out * 3 // 4, out * 5 // 4 + 1)))
                   for _ in range(rng.poisson(rate * 10))]
        ctl.tick(Observation(k * 10.0, arrived, []))
    dirs = [c[2] for c in act.calls if c[0] == "switch"]
    return sum(a != b for a, b in zip(dirs, dirs[1:])), act.calls


def test_controller_does_not_flap_near_a_threshold():
    """Steady load where 5:3 and 6:2 take nearly the same rate (within 10%): with the default
    hysteresis at most one switch and none undone in half an hour; without it (0), the sampling
    noise alone makes it switch back and forth (what the hysteresis is for)."""
    ratio, out, cap = _threshold_load()
    assert abs(ratio - 1) < 0.1
    flips, calls = _reversals(PlannerConfig().hysteresis, out, 0.9 * cap)
    assert flips == 0 and len(calls) <= 1, calls
    flips, calls = _reversals(0.0, out, 0.9 * cap)
    assert flips >= 2, calls


def test_controller_follows_a_shift_and_counts_decisions():
    prof = synthetic_profile()
    phases = [Phase("prompts", 300, 1.8, 1536, 32), Phase("answers", 300, 16.0, 128, 384)]
    trace = make_trace(phases)
    cfg = PlannerConfig(interval_s=10, cooldown_s=30, max_engines=8, max_prefill=7, max_decode=7)
    sim, decisions = run_controlled(prof, trace, 600, 6, 2, SLO, cfg)
    fixed = run_fixed(prof, trace, 600, 6, 2)
    # phase 1 needs every engine it can get on P (7:1); the shift to long answers moves
    # most of them to D within a few looks
    assert [(d.action, d.role) for d in decisions if d.at < 300] in ([], [("switch", "prefill")])
    shift = [d for d in decisions if d.at >= 300]
    assert shift[0].action == "switch" and shift[0].role == "decode"
    assert shift[0].at <= 340 and shift[0].reason == "decode_capacity"
    assert score(sim, SLO, 300, 600).goodput > 2 * score(fixed, SLO, 300, 600).goodput
    n_p, n_d = [entry[1:] for entry in sim.role_log if entry[0] <= 600][-1]
    assert n_p + n_d == 8 and n_d > n_p  # (after the trace ends, idle engines may go)


def test_simulator_bookkeeping_and_role_switch():
    prof = synthetic_profile()
    sim = Simulator(prof, 1, 1, switch_s=2.0)
    trace = [(0.1 * i, 256, 16) for i in range(20)]
    sim.run(trace, 60.0)
    assert all(r.done is not None for r in sim.requests) and len(sim.requests) == 20
    r = sim.requests[0]  # alone at first: its TTFT is its prefill, its TPOT a batch-1 step
    assert r.ttft == pytest.approx(prof.prefill_seconds(256))
    assert r.tpot >= prof.decode_step_seconds(1, 256)
    sim.switch_role("decode-1", "prefill")
    assert {v.state for v in sim.engines() if v.id == "decode-1"} == {"starting"}  # idle: at once
    sim.run([], 70.0)
    assert sorted(v.role for v in sim.engines()) == ["prefill", "prefill"]
    sim.scale("decode", 1)
    sim.run([], 200.0)
    assert sorted((v.role, v.state) for v in sim.engines()) == [
        ("decode", "serving"), ("prefill", "serving"), ("prefill", "serving")]


def test_live_loop_acts_through_the_actuator_and_counts(tmp_path):
    """The proxy-side loop: a window fed as the proxy would, the controller on its thread,
    each decision counted in /metrics as pd_planner_decisions_total{action, reason}."""
    import threading

    from pd_cluster.planner.live import start_planner
    from pd_cluster.serving.cluster.config_sections import SloConfig
    from pd_cluster.serving.observability.metrics import ProxyMetrics
    path = tmp_path / "p.json"
    synthetic_profile().save(path)
    cfg = PlannerConfig(enabled=True, profile=str(path), interval_s=0.05, cooldown_s=0,
                        max_engines=4, max_prefill=3, max_decode=3)
    act = _Applying(1, 3)
    metrics = ProxyMetrics(lambda: [])
    acted = threading.Event()

    def count(action: str, reason: str) -> None:
        metrics.planner_decisions.labels(action, reason).inc()
        acted.set()
    loop, window = start_planner(cfg, SloConfig(ttft_ms=2000, tpot_ms=50), act, 256, count)
    try:
        for _ in range(200):  # long prompts, short answers: P is the bottleneck
            window.arrived(1536, 16)
        assert acted.wait(10), "the controller made no decision"
    finally:
        loop.stop()
    assert act.calls[0][0] == "switch" and act.calls[0][2] == "prefill"
    assert 'pd_planner_decisions_total{action="switch",reason="prefill_capacity"} 1.0' in \
        metrics.render().decode()


def test_a_look_that_raises_is_counted_and_the_loop_goes_on(tmp_path):
    """A look that raises (the live actuator once lacked a field every look needed) is
    counted in pd_planner_look_failures_total{error}, and the loop keeps looking."""
    import threading

    from pd_cluster.planner.live import start_planner
    from pd_cluster.serving.cluster.config_sections import SloConfig
    from pd_cluster.serving.observability.metrics import ProxyMetrics
    path = tmp_path / "p.json"
    synthetic_profile().save(path)
    cfg = PlannerConfig(enabled=True, profile=str(path), interval_s=0.02, cooldown_s=0,
                        max_engines=4, max_prefill=3, max_decode=3)

    class _Broken(_Applying):
        def engines(self):
            raise AttributeError("'EngineView' object has no attribute 'load'")
    metrics = ProxyMetrics(lambda: [])
    failed = threading.Semaphore(0)

    def count_failure(error: str) -> None:
        metrics.planner_look_failures.labels(error).inc()
        failed.release()
    loop, window = start_planner(cfg, SloConfig(ttft_ms=2000, tpot_ms=50), _Broken(1, 3), 256,
                                 None, count_failure)
    try:
        for _ in range(200):
            window.arrived(1536, 16)
        assert failed.acquire(timeout=10) and failed.acquire(timeout=10), "no failed looks"
    finally:
        loop.stop()
    assert 'pd_planner_look_failures_total{error="AttributeError"}' in metrics.render().decode()


def test_window_rate_once_old_looks_are_dropped():
    """A steady 0.2 req/s seen for longer than the window keeps: the rate stays 0.2, the oldest
    look kept covering from the one dropped before it, not from the start; without a shift
    the lengths are every arrival kept (a steady estimate), not the newest 40 alone."""
    from pd_cluster.planner.window import WorkloadWindow
    w = WorkloadWindow(span=20, longest=120, min_arrivals=40)
    for k in range(1, 31):
        w.add(Observation(k * 10.0, [(100, 10)] * 2, []))
        assert w.rate(k * 10.0) == pytest.approx(0.2)
    assert len(w.lengths(300.0)) == 24  # every look kept (12 of them)
    fast = WorkloadWindow(span=20, longest=120, min_arrivals=40)
    for k in range(1, 31):
        fast.add(Observation(k * 10.0, [(100, 10)] * 10, []))
    assert len(fast.lengths(300.0)) == 120 and fast.shifts == []


def test_window_restarts_at_a_shift_and_not_on_noise():
    """A 50/50 mix (Poisson counts) for 300 s: no shift is seen, the estimate holds every
    arrival of the last 300 s; then long answers only: the lengths restart exactly at the
    change (no look of the mix lingers), and a change of rate alone keeps the lengths."""
    from pd_cluster.planner.window import WorkloadWindow
    rng = np.random.default_rng(0)
    w = WorkloadWindow(span=20, longest=300, min_arrivals=40)

    def mix(n: int) -> list[tuple[int, int]]:
        return [(1536, 32) if rng.random() < 0.5 else (128, 384) for _ in range(n)]
    for k in range(1, 31):
        w.add(Observation(k * 10.0, mix(rng.poisson(8)), []))
    assert w.shifts == [] and not w.settling()
    assert len(w.lengths(300.0)) > 200
    for k in range(31, 41):
        w.add(Observation(k * 10.0, [(128, 384)] * int(rng.poisson(8)), []))
    assert w.shifts and w.mix_anchor == 300.0
    assert set(w.lengths(400.0)) == {(128, 384)}
    before = len(w.lengths(400.0))
    for k in range(41, 51):  # the same lengths at 4x the rate
        w.add(Observation(k * 10.0, [(128, 384)] * int(rng.poisson(32)), []))
    assert w.anchor == 400.0 and w.mix_anchor == 300.0  # the rate restarts at its change
    assert len(w.lengths(500.0)) > before and w.rate(500.0) == pytest.approx(3.2, rel=0.1)


def test_status_shows_the_last_decision_and_the_cooldown():
    """What `pd-cluster status` prints from a controller that just switched engines: the
    roles now, the targets, the decision with its reason and age, and when the next change
    may come (the cooldown's end)."""
    from pd_cluster.planner.status import controller_status, status_lines
    cfg = PlannerConfig(interval_s=10, cooldown_s=60, max_engines=8, max_prefill=7,
                        max_decode=7)
    act = _Applying(6, 2)
    ctl = Controller(synthetic_profile(), SLO, cfg, act)
    rng = np.random.default_rng(0)
    k = 0
    while ctl.last is None and k < 30:  # long answers at a rate 6:2 cannot take
        k += 1
        ctl.tick(Observation(k * 10.0, [(128, int(rng.integers(288, 481)))
                                        for _ in range(rng.poisson(120))], []))
    assert ctl.last is not None and ctl.last.action == "switch"
    st = controller_status(ctl, k * 10.0 + 5)
    assert st["engines"] == {"prefill": {"serving": 6 - ctl.last.count},
                             "decode": {"serving": 2 + ctl.last.count}}
    assert st["last"]["ago_s"] == 5 and st["last"]["reason"] == "decode_capacity"
    assert st["next_action"] == "cooldown" and st["next_action_in_s"] == 55
    json.dumps(st)  # it crosses HTTP
    lines = status_lines(st)
    assert lines[0].startswith("planner: on, every 10s, cooldown 60s")
    assert f"{2 + ctl.last.count} decode" in lines[0]
    assert "TTFT 2000 ms, TPOT 50 ms at p90" in lines[1]
    assert lines[3].startswith(f"planner last decision (1 in all): switch {ctl.last.count} "
                               f"decode (") and "decode_capacity, 5s ago" in lines[3]
    assert lines[4] == "planner next action: earliest in 55s (cooldown)"
    # an engine still switching: nothing before it serves
    act.engines = lambda: [EngineView("e0", "prefill", "draining")]
    st = controller_status(ctl, k * 10.0 + 70)
    assert st["next_action"] == "after the change under way"
    assert "(1 draining)" in status_lines(st)[0]


def test_prefill_pool_takes_more_than_its_engines_alone():
    """k prefill engines fed by least-queued routing are one M/G/k queue: at k = 1 exactly the
    M/G/1 of ``ttft``; more engines take more than k times one engine's share."""
    from pd_cluster.planner.perf_model import _erlang_c
    assert _erlang_c(2, 1.0) == pytest.approx(1 / 3)  # M/M/2 at half load
    m = PerfModel(synthetic_profile(), Workload.from_lengths(1536, 32, 0.25), SLO)
    for lam in (0.1, 0.5, 0.9 / m.es):
        assert m.pool_ttft(lam, 1) == pytest.approx(m.ttft(lam))
    assert m.pool_capacity(1) == pytest.approx(m.prefill_capacity(), rel=1e-6)
    caps = [m.pool_capacity(k) for k in range(1, 9)]
    assert all(b > a for a, b in zip(caps, caps[1:]))
    assert caps[3] > 4 * caps[0] and caps[7] < 8 / m.es


def test_best_split_of_pooled_capacities_is_the_brute_force_one():
    prof = synthetic_profile()
    for n_in, n_out in ((1536, 32), (128, 384), (700, 200)):
        caps = Capacities(PerfModel(prof, Workload.from_lengths(n_in, n_out, 0.25), SLO))
        for n, bounds in ((8, (1, 7, 1, 7)), (16, (1, 15, 1, 15)), (8, (1, 3, 1, 7))):
            got = caps.best_split(n, bounds)
            best = max(caps.split(p, n - p) for p in range(bounds[0], bounds[1] + 1)
                       if bounds[2] <= n - p <= bounds[3])
            assert caps.split(*got) == pytest.approx(best)


def test_controller_steady_on_a_mixed_load_in_the_simulator():
    """Half long prompts, half long answers, Poisson, for 30 minutes from an empty 8-engine
    cluster at 5:3 near its capacity: the controller settles on one split and never moves an
    engine back (the estimate covers every arrival since the last tested shift; undoing a
    switch takes twice the hysteresis)."""
    prof = synthetic_profile()
    mixed = Phase("mixed", 1800, 1.0, 1536, 32, mix_share=0.5, mix_input_len=128,
                  mix_output_len=384)
    caps = Capacities(PerfModel(prof, Workload.from_pairs(mixed.workload_pairs()), SLO))
    bp, bd = caps.best_split(8, (1, 7, 1, 7))
    rate = 0.9 * caps.split(bp, bd)
    trace = make_trace([Phase("mixed", 1800, rate, 1536, 32, mix_share=0.5, mix_input_len=128,
                              mix_output_len=384)], seed=3)
    cfg = PlannerConfig(interval_s=10, cooldown_s=30, max_engines=8, max_prefill=7, max_decode=7)
    sim, decisions = run_controlled(prof, trace, 1800, 4, 4, SLO, cfg)
    switches = [d.role for d in decisions if d.action == "switch" and d.at < 1800]
    assert len(switches) <= 2 and len(set(switches)) <= 1, decisions
    assert [d for d in decisions if d.at < 1800 and d.action == "scale_down"] == []


def test_switch_and_new_engines_in_one_look_and_slow_scale_down():
    """A shift from long prompts to long answers on 3 prefill and 1 decode engines with room
    for 2 more: one look switches prefill engines to decode and starts new decode engines for
    what the switch leaves short (the simulator counts engines switching to a role as its
    own: no extra engines); an idle cluster loses an engine only after scale_down_after_s."""
    prof = synthetic_profile()
    sim = Simulator(prof, 1, 1)
    sim.switch_role("prefill-0", "decode")  # idle: switching at once
    sim.scale("decode", 2)  # the switching engine counts: nothing to start
    assert len(sim.engines()) == 2
    cfg = PlannerConfig(interval_s=10, cooldown_s=30, max_engines=6, max_prefill=5,
                        max_decode=5, scale_down_after_s=120)
    act = _Applying(3, 1)
    ctl = Controller(prof, SLO, cfg, act)
    for k in range(1, 7):
        ctl.tick(Observation(k * 10.0, [(1536, 32)] * 4, []))
    for k in range(7, 10):
        ctl.tick(Observation(k * 10.0, [(128, 384)] * 200, []))
    kinds = [c[0] for c in act.calls]
    assert kinds[0] == "switch" and kinds[-1] == "scale", act.calls  # the same look
    assert ("switch", "e0", "decode") in act.calls
    role, count = act.calls[-1][1:]
    assert count > sum(r == role for r in act.roles.values())  # engines added to the switched
    idle = Controller(prof, SLO, cfg, _Applying(3, 3))
    made = [idle.tick(Observation(k * 10.0, [(700, 100)], [])) for k in range(1, 30)]
    downs = [d.at for d in made if d is not None and d.action == "scale_down"]
    assert downs and downs[0] >= 120 and all(b - a >= 120 for a, b in zip(downs, downs[1:]))
