"""What the SLO controller acts through, and what it reads: the one interface between the
policy (controller.py) and a cluster, live (the scale mechanics: engines added, drained,
switched) or simulated (simulator.py). The controller never touches engines otherwise."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

from pd_cluster.driver.messages import ROLE_DECODE, ROLE_PREFILL

ROLES = (ROLE_PREFILL, ROLE_DECODE)
EngineState = Literal["serving", "draining", "starting"]


@dataclass(frozen=True)
class EngineView:
    """One engine as the controller sees it. ``load``: prefill engines, requests queued or
    prefilling; decode engines, requests decoding or waiting for their KV."""
    id: str
    role: str  # prefill | decode (a switching engine: the role it is leaving)
    state: EngineState
    load: float = 0.0


@runtime_checkable
class Actuator(Protocol):
    def engines(self) -> list[EngineView]:
        """Every engine of the cluster now, in any state."""

    def scale(self, role: str, count: int) -> None:
        """Make ``count`` the number of engines of ``role``: start new ones (state starting,
        then serving), or drain some (state draining: no new work, their work finishes or
        moves, then they stop and leave the list). The simulator returns at once (the change
        shows in engines() as time passes); the live cluster's returns when it is done (the
        controller runs on its own thread, and its next look sees the result)."""

    def switch_role(self, engine_id: str, role: str) -> None:
        """Drain the engine's work in its current role, then serve ``role`` (same weights).
        The engine shows as draining, then serving ``role``; returns at once (simulator) or
        when the switch is done (live cluster), as ``scale``."""


@dataclass(frozen=True)
class RequestSample:
    """A finished request as measured at the proxy (times in seconds)."""
    input_len: int
    output_len: int
    ttft: float
    tpot: float | None  # None with one output token
    arrived_at: float = 0.0  # on the clock Observation.now uses


@dataclass
class Observation:
    """What happened since the previous look: the requests that arrived (prompt tokens,
    output tokens asked for: max_tokens, or the model's context left) and those that
    finished. The workload is judged from arrivals (they show a shift at once; finished
    requests lag, and hardly finish at all in an overloaded role)."""
    now: float
    arrived: list[tuple[int, int]] = field(default_factory=list)
    finished: list[RequestSample] = field(default_factory=list)


class ObservationSource(Protocol):
    def observe(self) -> Observation:
        """Arrivals and finished requests since the previous call (the first: since start)."""
