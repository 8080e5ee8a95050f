"""Simulated runs for the benchmark and the tests: a phased Poisson trace, a fixed split or
the controller over it, and the score (SLO attainment and goodput, per phase and overall)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pd_cluster.planner.controller import Controller, Decision
from pd_cluster.planner.perf_model import Slo
from pd_cluster.planner.profile_table import Profile
from pd_cluster.planner.simulator import Simulator
from pd_cluster.serving.cluster.config_sections import PlannerConfig


@dataclass(frozen=True)
class Phase:
    name: str
    duration_s: float
    rate: float  # requests/s, Poisson
    input_len: int
    output_len: int
    range_ratio: float = 0.25  # lengths uniform in len x (1 +- range_ratio)
    # a mixed phase: this share of requests takes (mix_input_len, mix_output_len) instead
    mix_share: float = 0.0
    mix_input_len: int = 1
    mix_output_len: int = 1

    def workload_pairs(self, n: int = 512, seed: int = 1) -> list[tuple[int, int]]:
        """A sample of the phase's (prompt, output) lengths (what `plan` sizes for)."""
        rng = np.random.default_rng(seed)
        return [self._draw(rng) for _ in range(n)]

    def _draw(self, rng: np.random.Generator) -> tuple[int, int]:
        mixed = self.mix_share > 0 and rng.random() < self.mix_share
        n_in, n_out = ((self.mix_input_len, self.mix_output_len) if mixed
                       else (self.input_len, self.output_len))

        def draw(n: int) -> int:
            r = self.range_ratio
            return int(rng.integers(max(1, int(n * (1 - r))), max(1, int(n * (1 + r))) + 1))
        return draw(n_in), draw(n_out)


def make_trace(phases: list[Phase], seed: int = 0) -> list[tuple[float, int, int]]:
    """Poisson arrivals phase after phase: (time, prompt tokens, output tokens)."""
    rng = np.random.default_rng(seed)
    out, t0 = [], 0.0
    for ph in phases:
        t = t0 + rng.exponential(1 / ph.rate)
        while t < t0 + ph.duration_s:
            out.append((t, *ph._draw(rng)))
            t += rng.exponential(1 / ph.rate)
        t0 += ph.duration_s
    return out


@dataclass
class Score:
    requests: int
    met: int  # both targets met
    duration_s: float

    @property
    def attainment(self) -> float:
        return self.met / self.requests if self.requests else 1.0

    @property
    def goodput(self) -> float:
        return self.met / self.duration_s


def score(sim: Simulator, slo: Slo, start: float, end: float) -> Score:
    """Requests that arrived in [start, end): how many met both targets (unfinished: missed)."""
    reqs = [r for r in sim.requests if start <= r.arrival < end]
    met = sum(1 for r in reqs if r.done is not None and r.ttft <= slo.ttft_s
              and (r.tpot is None or r.tpot <= slo.tpot_s))
    return Score(len(reqs), met, end - start)


def phase_bounds(phases: list[Phase]) -> list[tuple[float, float]]:
    edges = np.cumsum([0.0] + [p.duration_s for p in phases])
    return [(float(a), float(b)) for a, b in zip(edges[:-1], edges[1:])]


def run_fixed(profile: Profile, trace: list, until: float, n_prefill: int, n_decode: int,
              max_num_seqs: int = 256) -> Simulator:
    sim = Simulator(profile, n_prefill, n_decode, max_num_seqs)
    sim.run(trace, until + _TAIL_S)
    return sim


def run_controlled(profile: Profile, trace: list, until: float, n_prefill: int, n_decode: int,
                   slo: Slo, config: PlannerConfig, max_num_seqs: int = 256,
                   switch_s: float = 2.0) -> tuple[Simulator, list[Decision]]:
    sim = Simulator(profile, n_prefill, n_decode, max_num_seqs, switch_s=switch_s)
    decisions: list[Decision] = []
    ctl = Controller(profile, slo, config, sim, max_num_seqs, on_decision=decisions.append)
    sim.run(trace, until + _TAIL_S, on_tick=lambda: ctl.tick(sim.observe()),
            interval_s=config.interval_s)
    return sim, decisions


_TAIL_S = 120.0  # after the last arrival: requests in flight finish (arrivals stop at until)
