"""DistServe-style capacity arithmetic over a measured profile.

Prefill engine (TTFT): requests arrive Poisson at rate lam per engine and are prefilled one
after another (prefill_queue.PrefillQueue, M/G/1); TTFT = wait + its own prefill S (the first
token comes from P).
Decode engine (TPOT): a request stays out_len steps; by Little's law the mean batch m solves
m = lam (E[X] + E[out] T(m + 1)), T the profiled step time at the workload's mean decode
context; TPOT of a request = T(m + 1) + X / (out - 1), X its KV transfer tail (it delays the
second token). A batch past max_num_seqs, or no fixed point, is overload.

Left out (say so wherever a plan is shown): prompts batched together on P (serial here:
pessimistic for short prompts on a GPU), prefills on D (disaggregation auto), prefix-cache
hits, preemption and KV-memory limits, chunked prefill interleaving, the proxy's own overhead,
bursts beyond Poisson, and batch fluctuation around its mean (TPOT percentiles come from the
spread of prompt and output lengths only)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pd_cluster.planner.prefill_queue import PrefillQueue
from pd_cluster.planner.profile_table import Profile
from pd_cluster.planner.workload import Workload

LIMITATIONS = ("prompts prefilled one at a time on P; no prefills on D; no prefix-cache hits; "
               "no preemption or KV-memory limit; decode batch at its mean (no fluctuation); "
               "Poisson arrivals; proxy overhead not counted")


@dataclass(frozen=True)
class Slo:
    ttft_s: float
    tpot_s: float
    percentile: float = 90.0

    def __post_init__(self) -> None:
        if self.ttft_s <= 0:
            raise ValueError(f"--slo-ttft-ms: must be > 0, got {self.ttft_s * 1e3}")
        if self.tpot_s <= 0:
            raise ValueError(f"--slo-tpot-ms: must be > 0, got {self.tpot_s * 1e3}")
        if not 0 < self.percentile < 100:
            raise ValueError(f"--percentile: must be in (0, 100), got {self.percentile}")


class PerfModel:
    """Predictions for one workload on one engine of each role; ``prefill_scale`` and
    ``decode_scale`` stretch the profile's times (the controller's correction from what it
    measures)."""

    def __init__(self, profile: Profile, workload: Workload, slo: Slo, max_num_seqs: int = 256,
                 prefill_scale: float = 1.0, decode_scale: float = 1.0):
        self.profile, self.workload, self.slo = profile, workload, slo
        self.max_num_seqs = max_num_seqs
        self.decode_scale = decode_scale
        self.service = np.array([profile.prefill_seconds(n) for n in workload.input_lens]
                                ) * prefill_scale
        self.queue = PrefillQueue(self.service)
        self.es, self.es2 = self.queue.es, self.queue.es2
        self.transfer = np.array([profile.transfer_seconds(n) for n in workload.input_lens])
        self.ctx = workload.decode_context()
        self.q = 1 - slo.percentile / 100
        self._service_q = float(np.quantile(self.service, 1 - self.q))

    # ---- prefill ---------------------------------------------------------------------------
    def ttft(self, lam: float, percentile: float | None = None) -> float:
        """The percentile TTFT (s) on a prefill engine taking ``lam`` requests/s (default:
        the targets' percentile)."""
        return self.queue.ttft(lam, self.q if percentile is None else 1 - percentile / 100)

    def pool_ttft(self, lam: float, engines: int) -> float:
        """The percentile TTFT (s) when ``engines`` prefill engines share ``lam`` requests/s,
        each request going to the engine with the least queued (the proxy's least_loaded and
        cache_aware routing; the simulator's too): M/G/k, a request waits with the Erlang C
        probability, then for an exponential time of mean (1 + cs^2) / 2 x E[S] / (k (1 -
        rho)) (the M/M/k wait scaled for the service time's spread; at k = 1 exactly the
        M/G/1 of ``ttft``). k engines in one pool take far more than k times one engine's
        share within a TTFT target: a prompt rarely waits while another engine is free."""
        if engines < 1:
            return math.inf
        a = lam * self.es
        rho = a / engines
        if rho >= 1:
            return math.inf
        wait_q = 0.0
        if rho > 0:
            waits = _erlang_c(engines, a)
            mean = self.es2 / (2 * self.es * engines * (1 - rho))  # (1 + cs^2) / 2 x M/M/k
            wait_q = 0.0 if self.q >= waits else mean * math.log(waits / self.q)
        return wait_q + self._service_q

    def pool_capacity(self, engines: int) -> float:
        """Highest requests/s ``engines`` prefill engines take together within the TTFT target
        at the percentile (routed to the least queued: ``pool_ttft``)."""
        if engines < 1:
            return 0.0
        return bisect_largest(lambda lam: self.pool_ttft(lam, engines) <= self.slo.ttft_s,
                       engines / self.es)

    def ttft_ok(self, lam: float) -> np.ndarray:
        """Per request of the sample: the probability its TTFT meets the target."""
        return self.queue.ttft_ok(lam, self.slo.ttft_s)

    # ---- decode ----------------------------------------------------------------------------
    def step(self, batch: float) -> float:
        return self.profile.decode_step_seconds(batch, self.ctx) * self.decode_scale

    def mean_batch(self, lam: float) -> float:
        """Mean requests decoding on one engine at ``lam`` requests/s (inf: overload)."""
        ex, eout = float(self.transfer.mean()), self.workload.mean_output
        return batch_fixed_point(lambda m: lam * (ex + eout * self.step(m + 1)),
                                 self.max_num_seqs)

    def tpots(self, lam: float) -> np.ndarray:
        m = self.mean_batch(lam)
        if math.isinf(m):
            return np.full(len(self.transfer), math.inf)
        gaps = np.maximum(self.workload.output_lens - 1, 1)
        return self.step(m + 1) + self.transfer / gaps

    def tpot(self, lam: float, percentile: float | None = None) -> float:
        q = self.q if percentile is None else 1 - percentile / 100
        tpots = self.tpots(lam)
        return math.inf if math.isinf(tpots[0]) else float(np.quantile(tpots, 1 - q))

    # ---- capacity --------------------------------------------------------------------------
    def prefill_capacity(self) -> float:
        """Highest requests/s one prefill engine takes within the TTFT target at the percentile."""
        return bisect_largest(lambda lam: self.ttft(lam) <= self.slo.ttft_s, 1 / self.es)

    def decode_capacity(self) -> float:
        """Highest requests/s one decode engine takes within the TPOT target at the percentile."""
        hi = self.max_num_seqs / max(self.workload.mean_output * self.step(1), 1e-9)
        return bisect_largest(lambda lam: self.tpot(lam) <= self.slo.tpot_s, hi)

    def goodput(self, rate: float, n_prefill: int, n_decode: int) -> float:
        """Predicted requests/s meeting both targets at ``rate`` over the whole cluster."""
        if n_prefill < 1 or n_decode < 1 or rate <= 0:
            return 0.0
        ok_t = self.ttft_ok(rate / n_prefill)
        ok_d = (self.tpots(rate / n_decode) <= self.slo.tpot_s).astype(float)
        return rate * float((ok_t * ok_d).mean())


def batch_fixed_point(little, max_num_seqs: int) -> float:
    """The mean decode batch m = little(m) (Little's law: arrivals x time in the batch, which
    grows with the batch), iterated from 0; inf past ``max_num_seqs`` or when it keeps
    climbing (overload)."""
    m = nxt = 0.0
    for _ in range(200):
        nxt = little(m)
        if nxt > max_num_seqs:
            return math.inf
        if abs(nxt - m) < 1e-6:
            return nxt
        m = nxt
    return math.inf if nxt > m + 1e-3 else m


def _erlang_c(servers: int, load: float) -> float:
    """The probability that an arrival waits in M/M/``servers`` at ``load`` erlangs (< servers),
    through the Erlang B recursion (stable for any size)."""
    b = 1.0
    for k in range(1, servers + 1):
        b = load * b / (k + load * b)
    return b / (1 - load / servers * (1 - b))


def bisect_largest(ok, hi: float, iters: int = 40) -> float:
    """Largest x in [0, hi) with ok(x) (ok monotone: true then false); 0 if ok(tiny) fails."""
    lo = 0.0
    if not ok(hi * 1e-6):
        return 0.0
    for _ in range(iters):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo
