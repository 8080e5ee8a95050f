"""Prompts waiting for one engine's prefill, as an M/G/1 queue: requests arrive Poisson at
``lam`` per second and are prefilled one after another, each taking its service time S from a
sample. Utilisation rho = lam E[S], mean wait Wq = lam E[S^2] / (2 (1 - rho))
(Pollaczek-Khinchine); a request waits with probability rho, and then for an exponential time
of mean Wq / rho. Its TTFT is that wait plus its own S."""
from __future__ import annotations

import math

import numpy as np


class PrefillQueue:
    def __init__(self, service: np.ndarray):
        self.service = service
        self.es = float(service.mean())
        self.es2 = float((service ** 2).mean())

    def wait(self, lam: float) -> tuple[float, float]:
        """(rho, mean wait) at ``lam`` requests/s."""
        rho = lam * self.es
        if rho >= 1:
            return rho, math.inf
        return rho, lam * self.es2 / (2 * (1 - rho))

    def ttft(self, lam: float, q: float) -> float:
        """The TTFT (s) that a share ``q`` of the requests exceed."""
        rho, wq = self.wait(lam)
        if math.isinf(wq):
            return math.inf
        wait_q = 0.0 if q >= rho or rho == 0 else (wq / rho) * math.log(rho / q)
        return wait_q + float(np.quantile(self.service, 1 - q))

    def ttft_ok(self, lam: float, target_s: float) -> np.ndarray:
        """Per request of the sample: the probability its TTFT meets ``target_s``."""
        rho, wq = self.wait(lam)
        slack = target_s - self.service
        if math.isinf(wq):
            return np.zeros_like(slack)
        if rho == 0 or wq == 0:
            return (slack >= 0).astype(float)
        return np.where(slack >= 0, 1 - rho * np.exp(-np.maximum(slack, 0) * rho / wq), 0.0)
