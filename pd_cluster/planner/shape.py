"""Which shape serves a workload best on the cores given: one colocated engine on all of them
(colocated_model.ColocatedModel) or the best prefill/decode split of them
(plan.make_plan over perf_model.PerfModel), each from a profile measured at its own thread
count. Ties go to P/D: it keeps decode free of prefill's interference."""
from __future__ import annotations

from dataclasses import dataclass

from pd_cluster.planner.colocated_model import ColocatedModel
from pd_cluster.planner.perf_model import PerfModel
from pd_cluster.planner.plan import make_plan

MODE_COLOCATED, MODE_DISAGGREGATED = "colocated", "disaggregated"


@dataclass(frozen=True)
class ShapeChoice:
    mode: str  # MODE_COLOCATED or MODE_DISAGGREGATED
    n_prefill: int  # the P/D candidate's split (also when colocated wins)
    n_decode: int
    colocated_rate: float  # req/s one colocated engine takes within the SLO
    pd_rate: float  # req/s the P/D split takes within the SLO
    cores: float

    @property
    def split(self) -> str:
        return f"{self.n_prefill}P{self.n_decode}D"

    @property
    def line(self) -> str:
        """What was chosen and why, in one line."""
        colo = f"one engine on {self.cores:g} cores"
        if self.mode == MODE_COLOCATED:
            return (f"colocated: {colo} serves {self.colocated_rate:.3g} req/s within the SLO, "
                    f"{self.split} {self.pd_rate:.3g}")
        return (f"disaggregated ({self.split}): serves {self.pd_rate:.3g} req/s within the SLO, "
                f"colocated ({colo}) {self.colocated_rate:.3g}")


def compare_shapes(pd_model: PerfModel, colocated: ColocatedModel, engines: int,
                   cores: float) -> ShapeChoice:
    """``engines`` P/D engines (split as the plan would) against one colocated engine on the
    same ``cores``. ValueError when the two profiles are of different models or dtypes."""
    a, b = pd_model.profile.key, colocated.profile.key
    if (a.model, a.dtype) != (b.model, b.dtype):
        raise ValueError(f"colocated profile: measured for {b.model} {b.dtype}, the P/D "
                         f"profile for {a.model} {a.dtype}; profile the same model twice")
    try:
        plan = make_plan(pd_model, engines, a.tensor_parallel_size)
        n_p, n_d, pd_rate = plan.n_prefill, plan.n_decode, plan.rate
    except ValueError:  # no split meets the targets at any rate
        n_p, n_d, pd_rate = max(1, engines // 2), max(1, engines - engines // 2), 0.0
    colo_rate = colocated.capacity()
    mode = MODE_COLOCATED if colo_rate > pd_rate else MODE_DISAGGREGATED
    return ShapeChoice(mode=mode, n_prefill=n_p, n_decode=n_d, colocated_rate=colo_rate,
                       pd_rate=pd_rate, cores=cores)
