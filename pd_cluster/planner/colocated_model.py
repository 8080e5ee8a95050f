"""Capacity arithmetic for one colocated engine: prefill and decode on the same cores, prompt
chunks mixed into the running decodes' steps under the TPOT target (the engine's prompt
budget, engine/prompt_budget.py).

A step of a mixed engine costs the decode batch's own step T (weights read once, each
request's KV) plus the chunk's compute; the budget lets a step with a chunk last up to the
TPOT target tau, so a prompt gets the share 1 - T / tau of the time while it prefills and
takes S / (1 - T / tau) instead of its S alone. Prompts queue for that share one after another
(prefill_queue.PrefillQueue over the stretched service). Decode: the engine prefills a
fraction f = lam E[S] / (1 - T / tau) of the time in steps of tau and decodes the rest in
steps of T, so a request's mean TPOT is 1 / (f / tau + (1 - f) / T) and the mean batch m
solves m = lam E[out] TPOT (Little's law). Overload: f >= 1, T >= tau, or a batch past
max_num_seqs. Times come from a profile measured at the colocated engine's thread count.

Left out (say so wherever a plan is shown): the engine's TTFT pacing (chunks wider than the
TPOT budget when queued prompts need them), chunk sizes rounded to blocks, a mixed step's own
overheads beyond prefill + decode, and the same simplifications as perf_model.py."""
from __future__ import annotations

import math

import numpy as np

from pd_cluster.planner.perf_model import Slo, batch_fixed_point, bisect_largest
from pd_cluster.planner.prefill_queue import PrefillQueue
from pd_cluster.planner.profile_table import Profile
from pd_cluster.planner.workload import Workload

LIMITATIONS = ("chunks paced by the TPOT target only (no TTFT pacing); a mixed step costs "
               "its prefill plus its decode; decode batch at its mean; Poisson arrivals")


class ColocatedModel:
    """Predictions for one workload on one colocated engine whose profile is ``profile``."""

    def __init__(self, profile: Profile, workload: Workload, slo: Slo, max_num_seqs: int = 256):
        self.profile, self.workload, self.slo = profile, workload, slo
        self.max_num_seqs = max_num_seqs
        self.service = np.array([profile.prefill_seconds(n) for n in workload.input_lens])
        self.es = float(self.service.mean())
        self.ctx = workload.decode_context()
        self.q = 1 - slo.percentile / 100

    def step(self, batch: float) -> float:
        return self.profile.decode_step_seconds(batch, self.ctx)

    def _prefill_share(self, batch: float) -> float:
        """The share of a step a prompt chunk may take beside ``batch`` decodes."""
        return 1 - self.step(batch) / self.slo.tpot_s

    def _tpot_at(self, lam: float, batch: float) -> float:
        share = self._prefill_share(batch + 1)
        f = lam * self.es / share if share > 0 else math.inf
        if f >= 1:
            return math.inf
        return 1 / (f / self.slo.tpot_s + (1 - f) / self.step(batch + 1))

    def mean_batch(self, lam: float) -> float:
        """Mean requests decoding at ``lam`` requests/s (inf: overload)."""
        eout = self.workload.mean_output
        return batch_fixed_point(lambda m: lam * eout * self._tpot_at(lam, m),
                                 self.max_num_seqs)

    def tpot(self, lam: float) -> float:
        """Mean TPOT (s) at ``lam`` requests/s (every request's, at the mean batch)."""
        m = self.mean_batch(lam)
        return math.inf if math.isinf(m) else self._tpot_at(lam, m)

    def _queue(self, lam: float) -> PrefillQueue | None:
        m = self.mean_batch(lam)
        share = 0.0 if math.isinf(m) else self._prefill_share(m + 1)
        return PrefillQueue(self.service / share) if share > 0 else None

    def ttft(self, lam: float, percentile: float | None = None) -> float:
        q = self.q if percentile is None else 1 - percentile / 100
        queue = self._queue(lam)
        return math.inf if queue is None else queue.ttft(lam, q)

    def capacity(self) -> float:
        """Highest requests/s within both targets at the percentile."""
        def ok(lam: float) -> bool:
            return self.tpot(lam) <= self.slo.tpot_s and self.ttft(lam) <= self.slo.ttft_s
        return bisect_largest(ok, 1 / self.es)

    def goodput(self, rate: float) -> float:
        """Predicted requests/s meeting both targets at ``rate``."""
        queue = self._queue(rate)
        if rate <= 0 or queue is None or self.tpot(rate) > self.slo.tpot_s:
            return 0.0
        return rate * float(queue.ttft_ok(rate, self.slo.ttft_s).mean())
