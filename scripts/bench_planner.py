#!/usr/bin/env python
"""The P:D ratio under a shifting load, in the simulator (issue 40): a fixed budget of engine
slots, Poisson arrivals in three phases (long prompts and short answers; short prompts and
long answers; a mix of both), each phase's rate --load x the capacity `pd-cluster plan`
predicts for that phase at its best split. Compared, side by side on one trace:

  (a) best fixed per phase   every split simulated on each phase alone; the best (hindsight)
  (a') best single fixed     every split over the whole run; the best one
  (b) plan from phase 1      the split `plan` picks from phase 1's workload, whole run
  (c) controller             starts at (b), switches roles as it sees fit (planner defaults:
                             interval 10 s, cooldown 30 s, hysteresis 0.15; 2 s per switch
                             after the engine drains)

Per slot budget: SLO attainment and goodput (requests meeting TTFT and TPOT targets per
second) per phase and over the run, and the ratios the issue targets: controller / (a) per
phase (target >= 0.9) and controller / (a') over the run (target >= 1.3). The profile: the
one measured on this machine for llama-58m (bench-50m) on one core
(scripts/profiles/llama-58m-cpu.json; `pd-cluster profile --model ... --out` makes another).
The last line: ``planner_goodput_vs_best_fixed=X`` (over the run, the smallest budget).

  python scripts/bench_planner.py                 # 8, 16 and 64 slots
  python scripts/bench_planner.py --smoke         # 8 slots, short phases (tests)
  python scripts/bench_planner.py --real [--smoke]  # the controller on a real cluster
                                                  # (scripts/bench_planner_real.py)
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pd_cluster.planner.perf_model import PerfModel, Slo  # noqa: E402
from pd_cluster.planner.plan import make_plan  # noqa: E402
from pd_cluster.planner.profile_table import Profile  # noqa: E402
from pd_cluster.planner.scenarios import (  # noqa: E402
    Phase, make_trace, phase_bounds, run_controlled, run_fixed, score)
from pd_cluster.planner.workload import Workload  # noqa: E402
from pd_cluster.serving.cluster.config_sections import PlannerConfig  # noqa: E402

DEFAULT_PROFILE = Path(__file__).resolve().parent / "profiles" / "llama-58m-cpu.json"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--profile", type=Path, default=DEFAULT_PROFILE)
    p.add_argument("--slots", default="8,16,64", help="engine-slot budgets, comma list")
    p.add_argument("--phase-s", type=float, default=600.0, help="simulated seconds per phase")
    # 1.0: where the split matters. At 0.8 one mostly-decode split serves every phase within
    # the SLO (the ceiling over the whole run is 1.00-1.09x), so no policy can show 1.3x there.
    p.add_argument("--load", type=float, default=1.0, help="each phase's rate as a share of "
                   "its predicted capacity at its best split")
    p.add_argument("--slo-ttft-ms", type=float, default=4000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=60.0)
    p.add_argument("--percentile", type=float, default=90.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="8 slots, 60 s phases")
    args = p.parse_args(argv)
    if args.smoke:
        args.slots, args.phase_s = "8", 60.0
    return args


def phases_for(profile: Profile, slo: Slo, slots: int, phase_s: float, load: float
               ) -> list[Phase]:
    shapes = [Phase("long-prompt", phase_s, 1.0, 1536, 32),
              Phase("long-answer", phase_s, 1.0, 128, 384),
              Phase("mixed", phase_s, 1.0, 1536, 32, mix_share=0.5, mix_input_len=128,
                    mix_output_len=384)]
    out = []
    for ph in shapes:
        model = PerfModel(profile, Workload.from_pairs(ph.workload_pairs()), slo)
        rate = make_plan(model, slots).rate * load
        out.append(Phase(ph.name, phase_s, rate, ph.input_len, ph.output_len, ph.range_ratio,
                         ph.mix_share, ph.mix_input_len, ph.mix_output_len))
    return out


def splits(slots: int) -> list[int]:
    """Prefill counts to try: all of them up to 16 slots, else every slots/16-th."""
    step = max(1, slots // 16)
    return sorted(set(range(1, slots, step)) | {slots - 1})


def bench(profile: Profile, slo: Slo, slots: int, args: argparse.Namespace) -> float:
    phases = phases_for(profile, slo, slots, args.phase_s, args.load)
    bounds = phase_bounds(phases)
    end = bounds[-1][1]
    trace = make_trace(phases, args.seed)
    print(f"\n== {slots} slots: " + ", ".join(
        f"{p.name} {p.rate:.3g} req/s" for p in phases) + f"; {len(trace)} requests")
    # (a) per phase alone (its own arrivals of the trace, from an empty cluster), every split
    per_phase = []
    for ph, (a, b) in zip(phases, bounds):
        tr = [(t - a, n_in, n_out) for t, n_in, n_out in trace if a <= t < b]
        best = max(((score(run_fixed(profile, tr, ph.duration_s, n, slots - n), slo, 0,
                           ph.duration_s), n) for n in splits(slots)),
                   key=lambda x: x[0].goodput)
        per_phase.append(best)
    # (a') whole run, every split
    whole = {n: run_fixed(profile, trace, end, n, slots - n) for n in splits(slots)}
    best_n = max(whole, key=lambda n: score(whole[n], slo, 0, end).goodput)
    # (b) plan from phase 1
    m1 = PerfModel(profile, Workload.from_pairs(phases[0].workload_pairs()), slo)
    plan1 = make_plan(m1, slots)
    planned = run_fixed(profile, trace, end, plan1.n_prefill, plan1.n_decode)
    # (c) controller
    cfg = PlannerConfig(interval_s=10.0, cooldown_s=30.0, min_prefill=1, min_decode=1,
                        max_prefill=slots - 1, max_decode=slots - 1, max_engines=slots)
    ctl, decisions = run_controlled(profile, trace, end, plan1.n_prefill, plan1.n_decode,
                                    slo, cfg)
    rows = [("best fixed per phase", None), (f"best single fixed {best_n}P:{slots - best_n}D",
                                             whole[best_n]),
            (f"plan from phase 1 {plan1.n_prefill}P:{plan1.n_decode}D", planned),
            ("controller", ctl)]
    print(f"{'':34s}" + "".join(f"{p.name:>22s}" for p in phases) + f"{'whole run':>22s}")
    for name, sim in rows:
        cells = []
        for k, (a, b) in enumerate(bounds):
            s, n = (per_phase[k][0], per_phase[k][1]) if sim is None else (score(sim, slo, a, b),
                                                                          None)
            tag = f" {n}P" if n is not None else ""
            cells.append(f"{s.attainment * 100:5.1f}% {s.goodput:7.3g}/s{tag:>4s}")
        if sim is None:
            met = sum(x[0].met for x in per_phase)
            whole_cell = f"{'':6s} {met / end:7.3g}/s    "
        else:
            s = score(sim, slo, 0, end)
            whole_cell = f"{s.attainment * 100:5.1f}% {s.goodput:7.3g}/s    "
        print(f"{name:34s}" + "".join(f"{c:>22s}" for c in cells) + f"{whole_cell:>22s}")
    ctl_phase = [score(ctl, slo, a, b).goodput for a, b in bounds]
    ratios = [c / max(b[0].goodput, 1e-9) for c, b in zip(ctl_phase, per_phase)]
    overall = score(ctl, slo, 0, end).goodput / max(score(whole[best_n], slo, 0, end).goodput,
                                                    1e-9)
    vs_plan = score(ctl, slo, 0, end).goodput / max(score(planned, slo, 0, end).goodput, 1e-9)
    print("controller / best fixed per phase: " + ", ".join(f"{r:.2f}" for r in ratios)
          + " (target >= 0.9 each)")
    # What any policy could gain at most over one fixed split: the best split of each phase
    # from its start, no switching cost. Below 1.3 the target cannot be met on this load
    # (each split it loses to serves the phases well enough).
    ceiling = sum(x[0].met for x in per_phase) / max(score(whole[best_n], slo, 0, end).met, 1)
    print(f"controller / best single fixed over the run: {overall:.2f} (target >= 1.3; "
          f"ceiling: best fixed per phase / best single fixed = {ceiling:.2f}); "
          f"controller / plan from phase 1: {vs_plan:.2f}")
    print(f"decisions: {len(decisions)}: " + "; ".join(
        f"t={d.at:.0f}s {d.action} {d.count} to {d.role} ({d.reason})" for d in decisions))
    return overall


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--real" in argv:  # the mechanics on a real cluster: scripts/bench_planner_real.py
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import bench_planner_real
        return bench_planner_real.main([a for a in argv if a != "--real"])
    args = parse_args(argv)
    profile = Profile.load(args.profile)
    slo = Slo(args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3, args.percentile)
    print(f"profile {args.profile.name}: {profile.key.model} {profile.key.dtype} on "
          f"{profile.key.device}; targets TTFT {args.slo_ttft_ms:g} ms, TPOT "
          f"{args.slo_tpot_ms:g} ms at p{args.percentile:g}; load {args.load:g}; phases "
          f"{args.phase_s:g} s")
    t0 = time.perf_counter()
    results = {int(s): bench(profile, slo, int(s), args) for s in args.slots.split(",")}
    print(f"\n(simulated in {time.perf_counter() - t0:.1f} s)")
    smallest = min(results)
    print("planner_goodput_vs_best_fixed=" + ",".join(
        f"{s}:{r:.2f}" for s, r in sorted(results.items())) + f" (first: {smallest} slots)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
