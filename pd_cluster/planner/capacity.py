"""What a count of engines of each role takes within the targets, for the controller: the
prefill engines as one pool (perf_model.PerfModel.pool_capacity: a prompt goes to the least
queued engine, so k engines take far more than k times one engine's share), the decode
engines each their share (a decode batch is per engine); and the split of a number of engines
that takes the highest rate."""
from __future__ import annotations

from pd_cluster.driver.messages import ROLE_PREFILL
from pd_cluster.planner.perf_model import PerfModel


class Capacities:
    """Per look (one workload estimate): ``prefill(n)``, ``decode(n)`` in requests/s, each
    computed once."""

    def __init__(self, model: PerfModel):
        self.model = model
        self.per_decode = model.decode_capacity()
        self._prefill: dict[int, float] = {}

    def prefill(self, n: int) -> float:
        if n not in self._prefill:
            self._prefill[n] = self.model.pool_capacity(n)
        return self._prefill[n]

    def decode(self, n: int) -> float:
        return max(n, 0) * self.per_decode

    def of(self, role: str, n: int) -> float:
        return self.prefill(n) if role == ROLE_PREFILL else self.decode(n)

    def split(self, n_p: int, n_d: int) -> float:
        """The rate ``n_p`` prefill and ``n_d`` decode engines take together."""
        return min(self.prefill(n_p), self.decode(n_d))

    def fewest(self, role: str, rate: float, most: int) -> int:
        """The fewest engines of ``role`` taking ``rate`` (``most`` + 1 if ``most`` do not)."""
        lo, hi = 0, most + 1  # capacity grows with the count: bisect for the first enough
        while lo < hi:
            mid = (lo + hi) // 2
            if mid <= most and self.of(role, mid) >= rate:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def best_split(self, engines: int, bounds: tuple[int, int, int, int]) -> tuple[int, int]:
        """(prefill, decode) of ``engines`` taking the highest rate; ``bounds``: (min_prefill,
        max_prefill, min_decode, max_decode). ValueError when no split fits them."""
        lo_p, hi_p, lo_d, hi_d = bounds
        lo, hi = max(lo_p, engines - hi_d), min(hi_p, engines - lo_d)
        if lo > hi:
            raise ValueError(f"planner: no split of {engines} engines fits the bounds {bounds}")
        # prefill's capacity rises and decode's falls with n_p: the best is where they cross
        a, b = lo, hi
        while a < b:
            mid = (a + b) // 2
            if self.prefill(mid) >= self.decode(engines - mid):
                b = mid
            else:
                a = mid + 1
        candidates = {max(lo, a - 1), a}

        def key(n_p: int) -> tuple[float, float]:  # ties: the more even split of the load
            p, d = self.prefill(n_p), self.decode(engines - n_p)
            return min(p, d), -abs(p - d)
        n_p = max(sorted(candidates), key=key)
        return n_p, engines - n_p
