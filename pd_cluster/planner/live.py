"""The controller on a live cluster: the proxy feeds a RequestWindow (arrivals and finished
requests: the ObservationSource), and a PlannerLoop thread in the proxy's process looks every
``planner.interval_s`` and acts through the Actuator the cluster gives it (the scale
mechanics: engines started, drained, switched). Decisions are counted in /metrics."""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from pd_cluster.planner.actuator import Actuator, Observation, RequestSample
from pd_cluster.planner.controller import Controller, Decision
from pd_cluster.planner.perf_model import Slo
from pd_cluster.planner.profile_table import Profile
from pd_cluster.planner.status import controller_status

logger = logging.getLogger(__name__)


class RequestWindow:
    """Thread safe: the proxy's request handlers record, the planner thread observes."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._lock = threading.Lock()
        self._arrived: list[tuple[int, int]] = []
        self._finished: list[RequestSample] = []

    def now(self) -> float:
        return self._clock()

    def arrived(self, prompt_tokens: int, max_tokens: int) -> None:
        with self._lock:
            self._arrived.append((max(1, prompt_tokens), max(1, max_tokens)))

    def finished(self, prompt_tokens: int, output_tokens: int, ttft_s: float,
                 tpot_s: float | None, arrived_at: float) -> None:
        with self._lock:
            self._finished.append(RequestSample(prompt_tokens, output_tokens, ttft_s, tpot_s,
                                                arrived_at))

    def observe(self) -> Observation:
        with self._lock:
            obs = Observation(self._clock(), self._arrived, self._finished)
            self._arrived, self._finished = [], []
        return obs


class PlannerLoop:
    """The controller's thread: ``start()``, ``stop()`` (bounded join)."""

    def __init__(self, controller: Controller, window: RequestWindow, interval_s: float,
                 on_failure: Callable[[str], None] | None = None):
        self.controller, self.window, self.interval_s = controller, window, interval_s
        self.on_failure = on_failure  # (the exception's type name): counted in /metrics
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pd-planner", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    def status(self) -> dict[str, Any]:
        """The plan in force (planner/status.py), for /cluster/status."""
        return controller_status(self.controller, self.window.now())

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.controller.tick(self.window.observe())
            except Exception as e:  # a failed look (an engine gone mid-switch) must not end it
                logger.exception("planner: a look failed; trying again next interval")
                if self.on_failure is not None:
                    self.on_failure(type(e).__name__)


def start_planner(planner_cfg, slo_cfg, actuator: Actuator, max_num_seqs: int,
                  count: Callable[[str, str], None] | None = None,
                  count_failure: Callable[[str], None] | None = None
                  ) -> tuple[PlannerLoop, RequestWindow]:
    """The controller for a live cluster from its config's ``planner`` and ``proxy.slo``
    sections; ``count(action, reason)`` per decision (the proxy's
    ``pd_planner_decisions_total``), ``count_failure(error)`` per look that raised
    (``pd_planner_look_failures_total``). The caller feeds the window and stops the loop."""
    profile = Profile.load(planner_cfg.profile)
    slo = Slo(slo_cfg.ttft_ms / 1e3, slo_cfg.tpot_ms / 1e3, slo_cfg.percentile)
    window = RequestWindow()

    def on_decision(d: Decision) -> None:
        if count is not None:
            count(d.action, d.reason)
    ctl = Controller(profile, slo, planner_cfg, actuator, max_num_seqs, on_decision,
                     started=window.now())
    loop = PlannerLoop(ctl, window, planner_cfg.interval_s, count_failure)
    loop.start()
    return loop, window
