"""`pd-cluster plan`'s arithmetic: the split of engine slots between prefill and decode that
takes the highest request rate within the SLOs (each role's per-engine capacity from
perf_model.PerfModel), the per-engine settings that go with it, and the cluster YAML."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pd_cluster.planner.perf_model import PerfModel

# The sections that describe a P/D part (a config as colocated drops them).
PD_SECTIONS = ("prefill", "decode", "kv_transfer")


@dataclass(frozen=True)
class Plan:
    slots: int
    n_prefill: int
    n_decode: int
    prefill_capacity: float  # req/s one prefill engine takes within the TTFT target
    decode_capacity: float  # req/s one decode engine takes within the TPOT target
    rate: float  # highest total req/s within both targets
    goodput: float  # predicted req/s meeting both targets at that rate
    ttft_s: float  # predicted percentile TTFT at that rate
    tpot_s: float  # predicted percentile TPOT at that rate
    decode_max_num_seqs: int
    prefill_chunk: int  # max_num_batched_tokens

    @property
    def rate_per_slot(self) -> float:
        return self.rate / self.slots


def best_split(prefill_cap: float, decode_cap: float, engines: int,
               bounds: tuple[int, int, int, int] | None = None) -> tuple[int, int]:
    """(prefill, decode) engines out of ``engines`` maximising min(P capacity, D capacity);
    ``bounds``: (min_prefill, max_prefill, min_decode, max_decode)."""
    lo_p, hi_p, lo_d, hi_d = bounds or (1, engines - 1, 1, engines - 1)
    best, best_key = None, None
    for n_p in range(max(lo_p, engines - hi_d), min(hi_p, engines - lo_d) + 1):
        n_d = engines - n_p
        rate = min(n_p * prefill_cap, n_d * decode_cap)
        # ties (both 0, or a flat top): the split closest to the capacities' ratio
        key = (rate, -abs(n_p * prefill_cap - n_d * decode_cap))
        if best_key is None or key > best_key:
            best, best_key = (n_p, n_d), key
    if best is None:
        raise ValueError(f"slots: no split of {engines} engines fits the role bounds {bounds}")
    return best


def make_plan(model: PerfModel, slots: int, tensor_parallel_size: int = 1) -> Plan:
    """The best split of ``slots`` (engine slots: devices, or CPU engines) for the model's
    workload and targets. ValueError when no split meets them at any rate."""
    engines = slots // tensor_parallel_size
    if engines < 2:
        raise ValueError(f"--slots: {slots} slots at tensor parallel size "
                         f"{tensor_parallel_size} make {engines} engine(s); P/D needs 2")
    c_p, c_d = model.prefill_capacity(), model.decode_capacity()
    if c_p == 0:
        raise ValueError(f"--slo-ttft-ms: {model.slo.ttft_s * 1e3:g} ms is below the prompts' "
                         f"own prefill time at the percentile ({model.ttft(0) * 1e3:.0f} ms)")
    if c_d == 0:
        raise ValueError(f"--slo-tpot-ms: {model.slo.tpot_s * 1e3:g} ms is below one decode "
                         f"step plus the KV transfer at the percentile "
                         f"({model.tpot(1e-9) * 1e3:.1f} ms)")
    n_p, n_d = best_split(c_p, c_d, engines)
    rate = min(n_p * c_p, n_d * c_d)
    m = model.mean_batch(rate / n_d)
    seqs = min(model.max_num_seqs, math.ceil(m + 3 * math.sqrt(m) + 2))  # ~p99.9 of a Poisson
    bs = model.profile.block_size
    chunk = max(bs, math.ceil(model.workload.quantile_input(0.9) / bs) * bs)
    return Plan(slots=slots, n_prefill=n_p, n_decode=n_d, prefill_capacity=c_p,
                decode_capacity=c_d, rate=rate, goodput=model.goodput(rate, n_p, n_d),
                ttft_s=model.ttft(rate / n_p), tpot_s=model.tpot(rate / n_d),
                decode_max_num_seqs=int(seqs), prefill_chunk=int(chunk))


def smallest_plan(model: PerfModel, rate: float, max_slots: int,
                  tensor_parallel_size: int = 1) -> Plan:
    """The fewest slots whose best split takes ``rate`` within the targets."""
    for slots in range(2 * tensor_parallel_size, max_slots + 1, tensor_parallel_size):
        plan = make_plan(model, slots, tensor_parallel_size)
        if plan.rate >= rate:
            return plan
    raise ValueError(f"--rate: {rate:g} req/s needs more than --max-slots {max_slots} slots")


def plan_config(plan: Plan, base: dict[str, Any], model: PerfModel) -> dict[str, Any]:
    """``base`` (a cluster config as a dict) with the plan's replicas, engine settings and
    targets in it; a planner section with the plan's counts as the controller's floor."""
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in base.items()}
    out["mode"] = "disaggregated"
    out["prefill"] = {**out.get("prefill", {}), "replicas": plan.n_prefill}
    out["decode"] = {**out.get("decode", {}), "replicas": plan.n_decode}
    engine = out.setdefault("engine", {})
    engine["max_num_seqs"] = plan.decode_max_num_seqs
    engine["max_num_batched_tokens"] = max(plan.prefill_chunk,
                                           engine.get("max_num_batched_tokens", 0))
    proxy = out.setdefault("proxy", {})
    proxy["disaggregation"] = "always"  # the arithmetic assumes every prompt goes through P
    proxy["slo"] = _slo_section(model)
    return out


def as_colocated(data: dict[str, Any], cores: float) -> dict[str, Any]:
    """``data`` as one colocated engine on ``cores``: the P/D sections dropped, the prefill
    role's other keys (and a colocated section's) kept."""
    role = {k: v for k, v in (data.get("prefill") or {}).items() if k != "num_cpus"}
    out = {k: v for k, v in data.items() if k not in PD_SECTIONS}
    out["colocated"] = {**role, **(data.get("colocated") or {}), "replicas": 1,
                        "num_cpus": cores}
    return {**out, "mode": "colocated"}


def colocated_config(choice: Any, base: dict[str, Any], model: PerfModel) -> dict[str, Any]:
    """``base`` as one colocated engine on the compared cores, with the targets it mixes
    prompts into its decodes under."""
    out = as_colocated({k: (dict(v) if isinstance(v, dict) else v) for k, v in base.items()},
                       choice.cores)
    out["proxy"] = {**out.get("proxy", {}), "slo": _slo_section(model)}
    return out


def _slo_section(model: PerfModel) -> dict[str, float]:
    """proxy.slo for the targets ``model`` sized for."""
    return {"ttft_ms": model.slo.ttft_s * 1e3, "tpot_ms": model.slo.tpot_s * 1e3,
            "percentile": model.slo.percentile}
