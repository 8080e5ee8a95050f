"""The SLO controller: every interval it takes what the cluster measured (arrival rate,
prompt and output lengths, TTFT and TPOT of finished requests) from a window that restarts at a
tested shift of the workload (window.py: a steady estimate of a mix, a shift followed at once),
predicts what each count of engines of each role takes within the targets from the profile
(capacity.py: the prefill engines as one M/G/k pool, as the least-queued routing makes them),
and makes at most one change through the Actuator: switch engines to the split that takes the
highest rate (and, in the same look, start new engines for a role still short after it, room in
the budget), start new engines, or remove an idle one.

It never flaps: a change must raise predicted capacity by ``hysteresis`` (twice that to undo
a switch made within ten cooldowns; or answer a measured miss of one target while the other
has room), the same change must be called for on two looks in a row (but for a switch right
after a tested shift that at least doubles the capacity of an overloaded split), nothing
happens during a switch or within ``cooldown_s`` of the last change, a change is not undone
within three cooldowns on a measured miss alone, and an engine is removed only after
``scale_down_after_s`` of room to spare. Each decision is logged with its reason and handed to
``on_decision`` (the proxy counts it in /metrics)."""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from pd_cluster.driver.messages import ROLE_DECODE, ROLE_PREFILL
from pd_cluster.planner.actuator import Actuator, Observation, RequestSample
from pd_cluster.planner.capacity import Capacities
from pd_cluster.planner.perf_model import PerfModel, Slo
from pd_cluster.planner.profile_table import Profile
from pd_cluster.planner.window import WorkloadWindow
from pd_cluster.planner.workload import Workload
from pd_cluster.serving.cluster.config_sections import PlannerConfig

logger = logging.getLogger(__name__)

MIN_SAMPLES = 8  # finished requests in the window before the controller trusts its lengths
_MEASURED_SLACK = 0.8  # the other target counts as having room below this share of it


@dataclass(frozen=True)
class Decision:
    action: str  # scale_up, scale_down, switch
    role: str  # the role that gains (scale_up, switch) or loses (scale_down) engines
    reason: str  # prefill_capacity, decode_capacity, rebalance, measured_ttft, measured_tpot, idle
    detail: str
    at: float
    count: int = 1  # engines added, removed or switched
    engine_ids: tuple[str, ...] = ()  # the engines switched


@dataclass
class ControllerState:
    """What `pd-cluster status` shows: the split in force and why."""
    n_prefill: int = 0
    n_decode: int = 0
    rate: float = 0.0
    prefill_capacity: float = 0.0  # req/s per engine within the TTFT target (pool / count)
    decode_capacity: float = 0.0
    measured_ttft: float | None = None
    measured_tpot: float | None = None
    last: Decision | None = None
    decisions: int = 0


class Controller:
    def __init__(self, profile: Profile, slo: Slo, config: PlannerConfig, actuator: Actuator,
                 max_num_seqs: int = 256, on_decision: Callable[[Decision], None] | None = None,
                 started: float = 0.0):
        self.profile, self.slo, self.config, self.actuator = profile, slo, config, actuator
        self.max_num_seqs = max_num_seqs
        self.on_decision = on_decision
        # The newest 20 s (two looks at least) are tested for a shift; without one the
        # estimate takes up to 5 minutes (a mixed workload needs hundreds of requests).
        self.window = WorkloadWindow(max(2 * config.interval_s, 20.0),
                                     max(30 * config.interval_s, 300.0), min_arrivals=20,
                                     started=started)
        self._measured_s = max(12 * config.interval_s, 120.0)  # measured TTFT/TPOT: this long
        self.started = started
        self.last_action_at = -math.inf
        self.last: Decision | None = None
        self.pending: tuple[str, str] | None = None  # the change called for on the last look
        self.idle_since: float | None = None  # room to spare on every look since then
        self._decisive = False  # this look's switch follows a tested shift, far past noise
        self.looked_at: float | None = None  # the last look's time (`pd-cluster status`)
        self.state = ControllerState()

    # ---- one look ------------------------------------------------------------------------
    def tick(self, obs: Observation) -> Decision | None:
        """Take one observation; make (and return) at most one change (a switch and the new
        engines the role it feeds still needs count as one: the first is returned)."""
        self.window.add(obs)
        self.looked_at = obs.now
        views = self.actuator.engines()
        if any(v.state != "serving" for v in views):
            self.pending = None  # a change is under way: judge only its result
            return None
        n_p = sum(v.role == ROLE_PREFILL for v in views)
        n_d = sum(v.role == ROLE_DECODE for v in views)
        lengths = self.window.lengths(obs.now)
        rate = self.window.rate(obs.now)
        st = self.state
        st.n_prefill, st.n_decode, st.rate = n_p, n_d, rate
        if len(lengths) < MIN_SAMPLES or n_p == 0 or n_d == 0 or self.window.settling():
            return None
        caps = Capacities(PerfModel(self.profile, Workload.from_pairs(lengths), self.slo,
                                    self.max_num_seqs))
        st.prefill_capacity, st.decode_capacity = caps.prefill(n_p) / n_p, caps.per_decode
        # measured targets: only requests that arrived after the last change (the split in
        # force, not the backlog of the one before)
        recent = [x for x in self.window.samples(self._measured_s, obs.now)
                  if x.arrived_at >= self.last_action_at]
        st.measured_ttft, st.measured_tpot = self._measured(recent)
        changes = self._propose(n_p, n_d, rate, caps, len(recent) >= MIN_SAMPLES, obs.now)
        if not changes or changes[0][0] != "scale_down":
            self.idle_since = None
        elif self.idle_since is None:
            self.idle_since = obs.now
        if changes and changes[0][0] == "scale_down" and \
                obs.now - self.idle_since < self.config.scale_down_after_s:
            changes = []  # not idle for long enough yet
        if not changes or obs.now - self.last_action_at < self.config.cooldown_s:
            self.pending = self.pending if changes else None
            return None
        action, role, _, reason, _ = changes[0]
        if self.pending != (action, role) and not self._decisive:
            self.pending = (action, role)  # act only when the next look agrees
            return None
        if self._undoes_last(action, role, reason, obs.now):
            return None
        moved = {ROLE_PREFILL: 0, ROLE_DECODE: 0}  # engines the changes before moved so far
        made = [self._act(*change, obs.now, views, moved) for change in changes]
        return made[0]

    def _measured(self, samples: list[RequestSample]) -> tuple[float | None, float | None]:
        q = self.slo.percentile / 100
        ttft = [s.ttft for s in samples]
        tpot = [s.tpot for s in samples if s.tpot is not None]
        return (float(np.quantile(ttft, q)) if ttft else None,
                float(np.quantile(tpot, q)) if tpot else None)

    def _propose(self, n_p: int, n_d: int, rate: float, caps: Capacities, settled: bool,
                 now: float) -> list[tuple[str, str, int, str, str]]:
        """The changes called for: a switch (and new engines for the role still short after
        it), new engines, a move on a measured miss, or an idle engine to remove."""
        cfg, h = self.config, self.config.hysteresis
        self._decisive = False
        n = n_p + n_d
        cap_p, cap_d = caps.prefill(n_p), caps.decode(n_d)
        cap = min(cap_p, cap_d)
        short = ROLE_PREFILL if cap_p <= cap_d else ROLE_DECODE
        why = f"rate {rate:.3g}/s, capacity P {n_p}: {cap_p:.3g}, D {n_d}: {cap_d:.3g} req/s"
        reason = "prefill_capacity" if short == ROLE_PREFILL else "decode_capacity"
        # 1. a better split of the engines there are, all the way there in one change (first:
        # a switch serves after a drain, a new engine only once its weights are loaded)
        bounds = (cfg.min_prefill, cfg.max_prefill, cfg.min_decode, cfg.max_decode)
        try:
            bp, bd = caps.best_split(n, bounds)
        except ValueError:
            return []
        gain = ROLE_PREFILL if bp > n_p else ROLE_DECODE
        # undoing a recent switch takes twice the margin: a noisy estimate (few requests of
        # a mixed workload) must not swing engines back and forth
        margin = 2 * h if self._reverses(gain, now) else h
        best = caps.split(bp, bd)
        changes = []
        if bp != n_p and best > cap * (1 + margin) and rate > 0:
            changes.append(("switch", gain, abs(bp - n_p),
                            reason if gain == short else "rebalance",
                            f"{why}; best split {bp}P:{bd}D"))
            # the first change since the workload shifted (the window's test: 4 standard
            # errors), the split in force overloaded and the best taking twice what it does:
            # waiting a look to confirm would only add its delay to the backlog
            shifts = self.window.shifts
            self._decisive = (bool(shifts) and shifts[-1] > self.last_action_at
                              and cap < rate and best > 2 * cap)
            n_p, n_d, cap = bp, bd, best
            short = ROLE_PREFILL if caps.prefill(bp) <= caps.decode(bd) else ROLE_DECODE
        # 2. short of capacity with room to grow: new engines for the limiting role
        room = min(cfg.engine_budget - n, self._room(short, n_p, n_d))
        if cap < rate * (1 + h) and room > 0:
            have = n_p if short == ROLE_PREFILL else n_d
            need = caps.fewest(short, rate * (1 + h), have + room) - have
            changes.append(("scale_up", short, max(1, min(need, room)),
                            "prefill_capacity" if short == ROLE_PREFILL else "decode_capacity",
                            why))
        if changes:
            return changes
        # 3. a measured miss of one target while the other has room
        miss = self._measured_miss() if settled else None
        p2, d2 = (n_p + 1, n_d - 1) if miss == ROLE_PREFILL else (n_p - 1, n_d + 1)
        if (miss is not None and self._can_move_to(miss, n_p, n_d, rate, caps)
                and caps.split(p2, d2) * (1 + h) >= best):  # step 2 would not undo it
            if n < cfg.engine_budget and self._room(miss, n_p, n_d) > 0:
                return [("scale_up", miss, 1, _MISS_REASON[miss], why)]
            return [("switch", miss, 1, _MISS_REASON[miss], why)]
        # 4. idle: one engine fewer still leaves twice the headroom
        if n > cfg.min_prefill + cfg.min_decode and miss is None:
            for role in (ROLE_PREFILL, ROLE_DECODE):
                p2, d2 = (n_p - 1, n_d) if role == ROLE_PREFILL else (n_p, n_d - 1)
                if (p2 >= cfg.min_prefill and d2 >= cfg.min_decode
                        and caps.split(p2, d2) > 2 * rate * (1 + 2 * h)):
                    return [("scale_down", role, 1, "idle", why)]
        return []

    def _measured_miss(self) -> str | None:
        st, slo = self.state, self.slo
        if st.measured_ttft is None or st.measured_tpot is None:
            return None
        if st.measured_ttft > slo.ttft_s and st.measured_tpot < _MEASURED_SLACK * slo.tpot_s:
            return ROLE_PREFILL
        if st.measured_tpot > slo.tpot_s and st.measured_ttft < _MEASURED_SLACK * slo.ttft_s:
            return ROLE_DECODE
        return None

    def _room(self, role: str, n_p: int, n_d: int) -> int:
        """Engines ``role`` may still gain within its bound."""
        cfg = self.config
        return cfg.max_prefill - n_p if role == ROLE_PREFILL else cfg.max_decode - n_d

    def _can_move_to(self, role: str, n_p: int, n_d: int, rate: float,
                     caps: Capacities) -> bool:
        """Moving one engine to ``role`` keeps the other role within its predicted capacity."""
        cfg = self.config
        if role == ROLE_PREFILL:
            return (n_p < cfg.max_prefill and n_d - 1 >= cfg.min_decode
                    and caps.decode(n_d - 1) >= rate)
        return n_d < cfg.max_decode and n_p - 1 >= cfg.min_prefill and caps.prefill(n_p - 1) >= rate

    def _reverses(self, role: str, now: float) -> bool:
        """A switch to ``role`` would undo the last change (a switch the other way, within
        ten cooldowns)."""
        last = self.last
        return (last is not None and last.action == "switch" and last.role != role
                and now - last.at < 10 * self.config.cooldown_s)

    def _undoes_last(self, action: str, role: str, reason: str, now: float) -> bool:
        last = self.last
        if last is None or not reason.startswith("measured"):
            return False
        inverse = (last.action == "switch" and action == "switch" and last.role != role) or \
            ({last.action, action} == {"scale_up", "scale_down"} and last.role == role)
        return inverse and now - last.at < 3 * self.config.cooldown_s

    # ---- acting --------------------------------------------------------------------------
    def _act(self, action: str, role: str, count: int, reason: str, detail: str, now: float,
             views: list, moved: dict[str, int]) -> Decision:
        engine_ids: tuple[str, ...] = ()
        have = sum(v.role == role for v in views) + moved[role]
        if action == "scale_up":
            self.actuator.scale(role, have + count)
        elif action == "scale_down":
            self.actuator.scale(role, have - count)
        else:  # the donor's least loaded engines switch
            donor = ROLE_DECODE if role == ROLE_PREFILL else ROLE_PREFILL
            pool = sorted((v for v in views if v.role == donor), key=lambda v: v.load)
            engine_ids = tuple(v.id for v in pool[:count])
            for engine_id in engine_ids:
                self.actuator.switch_role(engine_id, role)
            moved[role] += len(engine_ids)
            moved[donor] -= len(engine_ids)
        decision = Decision(action, role, reason, detail, now, count, engine_ids)
        logger.info("planner: %s %d %s%s (%s): %s", action, count, role,
                    f" ({', '.join(engine_ids)})" if engine_ids else "", reason, detail)
        self.last, self.last_action_at, self.pending = decision, now, None
        self.idle_since = None  # each removal waits for its own stretch of room to spare
        self.state.last = decision
        self.state.decisions += 1
        if self.on_decision is not None:
            self.on_decision(decision)
        return decision


_MISS_REASON = {ROLE_PREFILL: "measured_ttft", ROLE_DECODE: "measured_tpot"}
