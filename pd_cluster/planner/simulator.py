"""A discrete-event P/D cluster driven by a profile, implementing the Actuator (and the
ObservationSource) so the controller runs against it unchanged.

Events: arrivals (a trace of (time, prompt tokens, output tokens)), prefills one at a time per
prefill engine (FIFO, routed to the engine with the fewest queued prompt tokens), the KV
transfer tail, decode steps in batches of at most ``max_num_seqs`` (routed to the engine with
the fewest requests), controller looks, and engines starting, draining and switching roles.
A decode engine runs a stretch of steps as one event (until the next finish, or until a
request joins: then the stretch is cut at the next step boundary), so hours of traffic on 64
engines take seconds. Times come from the profile's fits, exactly as perf_model predicts them:
what the simulator adds is the dynamics (queues, bursts, batches that come and go,
transitions). A draining engine finishes its work in place (prefills ship, decodes run to
their end), then takes ``switch_s`` (a role switch: re-handshake) or leaves (scale down); a new
engine serves after ``start_s`` (weights loaded)."""
from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from pd_cluster.driver.messages import ROLE_DECODE, ROLE_PREFILL
from pd_cluster.planner.actuator import EngineView, Observation, RequestSample
from pd_cluster.planner.profile_table import Profile


@dataclass
class SimRequest:
    arrival: float
    input_len: int
    output_len: int
    first: float | None = None  # first token (P's prefill done)
    done: float | None = None
    left: int = 0  # decode steps still to run

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.arrival

    @property
    def tpot(self) -> float | None:
        if self.done is None or self.output_len < 2:
            return None
        return (self.done - self.first) / (self.output_len - 1)


@dataclass
class SimEngine:
    id: str
    role: str
    state: str = "serving"  # serving | draining | starting
    next_role: str | None = None  # after draining: switch to it (None: leave)
    queue: deque = field(default_factory=deque)  # prefill: waiting requests
    queued_tokens: int = 0
    busy: bool = False
    running: list = field(default_factory=list)  # decode: requests in the batch
    joining: list = field(default_factory=list)  # decode: joining at the next step boundary
    stretch: tuple[float, float, int] | None = None  # decode: (start, step seconds, steps)
    version: int = 0  # stale stretch-end events carry an older one

    def load(self) -> float:
        if self.role == ROLE_PREFILL:
            return len(self.queue) + self.busy
        return len(self.running) + len(self.joining)

    def idle(self) -> bool:
        return not (self.queue or self.busy or self.running or self.joining)


class Simulator:
    """``run(trace, until)``; the controller ticks through ``on_tick`` every ``interval_s``."""

    def __init__(self, profile: Profile, n_prefill: int, n_decode: int, max_num_seqs: int = 256,
                 start_s: float = 30.0, switch_s: float = 2.0):
        self.profile, self.max_num_seqs = profile, max_num_seqs
        self.start_s, self.switch_s = start_s, switch_s
        self.now = 0.0
        self._events: list = []
        self._seq = itertools.count()
        self._ids = itertools.count()
        self._engines: dict[str, SimEngine] = {}
        for role, n in ((ROLE_PREFILL, n_prefill), (ROLE_DECODE, n_decode)):
            for _ in range(n):
                self._new_engine(role, "serving")
        self.requests: list[SimRequest] = []
        self.waiting_decode: deque = deque()  # KV arrived, no decode engine with room
        self._arrived: list[tuple[int, int]] = []
        self._finished: list[RequestSample] = []
        self.role_log: list[tuple[float, int, int]] = [(0.0, n_prefill, n_decode)]

    # ---- the Actuator ----------------------------------------------------------------------
    def engines(self) -> list[EngineView]:
        return [EngineView(e.id, e.role, e.state, e.load()) for e in self._engines.values()]

    def scale(self, role: str, count: int) -> None:
        mine = [e for e in self._engines.values() if e.role == role and e.next_role is None
                and not (e.state == "draining")]
        # engines switching to ``role`` count as its own (as on a live cluster, where a switch
        # has finished when the call returns); they are not the ones to remove
        coming = sum(e.next_role == role for e in self._engines.values())
        for _ in range(count - len(mine) - coming):
            e = self._new_engine(role, "starting")
            self._at(self.now + self.start_s, self._started, e.id)
        for e in sorted(mine, key=lambda e: e.load())[:max(len(mine) + coming - count, 0)]:
            self._drain(e, None)

    def switch_role(self, engine_id: str, role: str) -> None:
        e = self._engines[engine_id]
        if e.role != role and e.state == "serving":
            self._drain(e, role)

    # ---- the ObservationSource -------------------------------------------------------------
    def observe(self) -> Observation:
        obs = Observation(self.now, self._arrived, self._finished)
        self._arrived, self._finished = [], []
        return obs

    # ---- running ---------------------------------------------------------------------------
    def run(self, trace: list[tuple[float, int, int]], until: float,
            on_tick: Callable[[], None] | None = None, interval_s: float = 10.0) -> None:
        """Play ``trace`` (arrival time, prompt tokens, output tokens), looking every
        ``interval_s`` with ``on_tick``; stop at ``until`` (unfinished requests stay so)."""
        for t, n_in, n_out in trace:
            self._at(t, self._arrive, SimRequest(t, int(n_in), int(n_out)))
        if on_tick is not None:
            for k in range(1, int(until / interval_s) + 1):
                self._at(k * interval_s, on_tick)
        while self._events and self._events[0][0] <= until:
            t, _, fn, args = heapq.heappop(self._events)
            self.now = t
            fn(*args)
        self.now = until

    def _at(self, t: float, fn: Callable, *args) -> None:
        heapq.heappush(self._events, (t, next(self._seq), fn, args))

    def _new_engine(self, role: str, state: str) -> SimEngine:
        e = SimEngine(f"{role}-{next(self._ids)}", role, state)
        self._engines[e.id] = e
        return e

    def _log_roles(self) -> None:
        live = [e for e in self._engines.values() if e.state == "serving"]
        self.role_log.append((self.now, sum(e.role == ROLE_PREFILL for e in live),
                              sum(e.role == ROLE_DECODE for e in live)))

    def _serving(self, role: str) -> list[SimEngine]:
        return [e for e in self._engines.values() if e.role == role and e.state == "serving"]

    # ---- prefill ---------------------------------------------------------------------------
    def _arrive(self, r: SimRequest) -> None:
        self.requests.append(r)
        self._arrived.append((r.input_len, r.output_len))
        self._route_prefill(r)

    def _route_prefill(self, r: SimRequest) -> None:
        pool = self._serving(ROLE_PREFILL)
        if not pool:  # every prefill engine is switching: the nearest one to serve takes it
            pool = [e for e in self._engines.values() if e.role == ROLE_PREFILL
                    or e.next_role == ROLE_PREFILL] or list(self._engines.values())
        e = min(pool, key=lambda e: e.queued_tokens)
        e.queue.append(r)
        e.queued_tokens += r.input_len
        self._next_prefill(e)

    def _next_prefill(self, e: SimEngine) -> None:
        if e.busy or not e.queue or e.role != ROLE_PREFILL or e.state == "starting":
            return
        r = e.queue[0]
        e.busy = True
        self._at(self.now + self.profile.prefill_seconds(r.input_len), self._prefilled, e, r)

    def _prefilled(self, e: SimEngine, r: SimRequest) -> None:
        e.queue.popleft()
        e.queued_tokens -= r.input_len
        e.busy = False
        r.first = self.now
        if r.output_len <= 1:
            self._finish(r)
        else:
            r.left = r.output_len - 1
            self._at(self.now + self.profile.transfer_seconds(r.input_len), self._kv_arrived, r)
        self._next_prefill(e)
        self._maybe_drained(e)

    # ---- decode ----------------------------------------------------------------------------
    def _kv_arrived(self, r: SimRequest) -> None:
        pool = [e for e in self._serving(ROLE_DECODE) if e.load() < self.max_num_seqs]
        if not pool:
            self.waiting_decode.append(r)
            return
        e = min(pool, key=lambda e: e.load())
        self._cut_stretch(e)
        e.joining.append(r)
        if e.stretch is None:
            self._start_stretch(e)

    def _ctx(self, e: SimEngine) -> float:
        return sum(r.input_len + r.output_len - r.left for r in e.running) / len(e.running)

    def _start_stretch(self, e: SimEngine) -> None:
        e.running.extend(e.joining)
        e.joining.clear()
        while self.waiting_decode and len(e.running) < self.max_num_seqs and e.state == "serving":
            e.running.append(self.waiting_decode.popleft())
        if not e.running:
            e.stretch = None
            return
        steps = min(r.left for r in e.running)
        step = self.profile.decode_step_seconds(len(e.running), self._ctx(e) + steps / 2)
        e.stretch = (self.now, step, steps)
        e.version += 1
        self._at(self.now + steps * step, self._end_stretch, e, e.version)

    def _cut_stretch(self, e: SimEngine) -> None:
        """A request joins: the stretch ends at the next step boundary (it joins there)."""
        if e.stretch is None:
            return
        start, step, steps = e.stretch
        done = min(int((self.now - start) / step) + 1, steps)
        if done < steps:
            e.stretch = (start, step, done)
            e.version += 1
            self._at(start + done * step, self._end_stretch, e, e.version)

    def _end_stretch(self, e: SimEngine, version: int) -> None:
        if version != e.version:
            return
        steps = e.stretch[2]
        keep = []
        for r in e.running:
            r.left -= steps
            if r.left <= 0:
                self._finish(r)
            else:
                keep.append(r)
        e.running = keep
        e.stretch = None
        self._start_stretch(e)
        self._maybe_drained(e)

    def _finish(self, r: SimRequest) -> None:
        r.done = self.now
        self._finished.append(RequestSample(r.input_len, r.output_len, r.ttft, r.tpot, r.arrival))

    # ---- transitions -----------------------------------------------------------------------
    def _drain(self, e: SimEngine, next_role: str | None) -> None:
        e.state, e.next_role = "draining", next_role
        if e.role == ROLE_PREFILL:  # queued prompts not yet started go to the other engines
            waiting = list(e.queue)[1:] if e.busy else list(e.queue)
            for r in waiting:
                e.queue.remove(r)
                e.queued_tokens -= r.input_len
            if self._serving(ROLE_PREFILL):
                for r in waiting:
                    self._route_prefill(r)
            else:
                e.queue.extend(waiting)
                e.queued_tokens += sum(r.input_len for r in waiting)
        self._log_roles()
        self._maybe_drained(e)

    def _maybe_drained(self, e: SimEngine) -> None:
        if e.state != "draining" or not e.idle():
            return
        if e.next_role is None:
            del self._engines[e.id]
        else:
            e.state, e.role, e.next_role = "starting", e.next_role, None
            self._at(self.now + self.switch_s, self._started, e.id)
        self._log_roles()

    def _started(self, engine_id: str) -> None:
        e = self._engines.get(engine_id)
        if e is None or e.state != "starting":
            return
        e.state = "serving"
        self._log_roles()
        if e.role == ROLE_PREFILL:
            self._next_prefill(e)
        elif e.stretch is None:
            self._start_stretch(e)
