"""`mode: auto`: the shape a config that names none gets, decided before the config is
validated (cluster_config.parse_config; ClusterConfig's own validator for a dict built in code).

An explicit `mode`, or replica counts for the prefill or decode role, always win. Otherwise, with
both profiles given (planner.profile: the P/D engines' cost table; planner.colocated_profile:
the same model measured at the cores of P and D together) and the workload to size for
(planner.input_len, planner.output_len), planner/shape.py compares one colocated engine on all
the cores with the best P/D split of them within proxy.slo, and the config becomes the winner.
Without them, a config that describes no P/D part (no prefill, decode or kv_transfer section:
`serve`'s defaults) on CPU becomes one colocated engine on the cores P/D would have split
between its two engines, one each: at that size the split costs more than it isolates
(docs/benchmarks.md, the SLO grid); any other stays disaggregated, one engine per role. Either
way one line says what and why
(ClusterConfig.shape_note, printed at launch)."""
from __future__ import annotations

from typing import Any

from pd_cluster.serving.cluster.config_sections import RoleConfig
from pd_cluster.serving.cluster.schema import ConfigError

MODE_AUTO = "auto"
_NO_PROFILES = ("disaggregated (1P1D): no profiles to compare shapes by (planner.profile and "
                "planner.colocated_profile, from `pd-cluster profile`); `mode: colocated` "
                "runs one engine that does both")
_SMALL = ("colocated: one engine on {cores:g} cores, where P/D would give prefill and decode "
          "one each (too few for the split to pay); profiles decide instead "
          "(planner.profile, planner.colocated_profile), `mode: disaggregated` forces P/D")


def resolve_shape(data: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """``data`` with a concrete mode, and the line saying why (None: the config named it)."""
    mode = data.get("mode", MODE_AUTO)
    if mode != MODE_AUTO:
        return data, None
    from pd_cluster.planner.plan import PD_SECTIONS, as_colocated
    if "colocated" in data:
        return {**data, "mode": "colocated"}, "colocated: the config has a colocated section"
    roles = {r: data.get(r) or {} for r in ("prefill", "decode")}
    if not all(isinstance(v, dict) for v in roles.values()):
        return {**data, "mode": "disaggregated"}, None  # validation names the bad section
    if any("replicas" in v for v in roles.values()):
        return {**data, "mode": "disaggregated"}, "disaggregated: the config sets replicas"
    planner = data.get("planner") or {}
    engine = data.get("engine") or {}
    cpu_only = (isinstance(engine, dict) and not str(engine.get("device", "")).startswith("cuda")
                and not any(v.get("num_gpus", 0) or v.get("tensor_parallel_size", 1) != 1
                            for v in roles.values()))
    if not isinstance(planner, dict) or not (planner.get("profile")
                                             and planner.get("colocated_profile")):
        if cpu_only and not any(k in data for k in PD_SECTIONS):
            cores = 2 * RoleConfig.model_fields["num_cpus"].default
            return as_colocated(data, cores), _SMALL.format(cores=cores)
        return {**data, "mode": "disaggregated"}, _NO_PROFILES
    if not cpu_only:
        return {**data, "mode": "disaggregated"}, ("disaggregated: `mode: auto` compares "
                                                    "CPU engines of one rank only")
    choice = _compare(data, roles, planner)
    if choice.mode == "colocated":
        return as_colocated(data, choice.cores), choice.line
    out = {**data, "mode": "disaggregated"}
    out["prefill"] = {**roles["prefill"], "replicas": choice.n_prefill}
    out["decode"] = {**roles["decode"], "replicas": choice.n_decode}
    return out, choice.line


def _compare(data: dict[str, Any], roles: dict[str, dict[str, Any]],
             planner: dict[str, Any]) -> Any:
    from pydantic import ValidationError

    from pd_cluster.planner.colocated_model import ColocatedModel
    from pd_cluster.planner.perf_model import PerfModel, Slo
    from pd_cluster.planner.profile_table import Profile
    from pd_cluster.planner.shape import compare_shapes
    from pd_cluster.planner.workload import Workload
    from pd_cluster.serving.cluster.config_sections import SloConfig
    try:
        cpus = [RoleConfig.model_validate(roles[r]).num_cpus for r in ("prefill", "decode")]
        slo_cfg = SloConfig.model_validate(((data.get("proxy") or {}).get("slo")) or {})
    except (ValidationError, AttributeError):
        raise ConfigError("mode: auto: fix the prefill, decode and proxy.slo sections "
                          "first (mode: disaggregated to see their errors)") from None
    lens = {k: planner.get(k) for k in ("input_len", "output_len")}
    for key, value in lens.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"planner.{key}: `mode: auto` with profiles sizes the shape for "
                              f"a workload: set input_len and output_len (tokens, >= 1)")
    profiles = {}
    for key, threads in (("profile", cpus[1]), ("colocated_profile", sum(cpus))):
        try:
            profile = Profile.load(planner[key])
        except (OSError, ValueError) as e:
            raise ConfigError(f"planner.{key}: {str(e).removeprefix('--profile: ')}") from None
        want = f"cpu x{int(threads)}"
        if profile.key.device != want:
            raise ConfigError(f"planner.{key}: measured on {profile.key.device}, this shape "
                              f"runs on {want} (`pd-cluster profile` with that many cores)")
        profiles[key] = profile
    workload = Workload.from_lengths(lens["input_len"], lens["output_len"])
    slo = Slo(slo_cfg.ttft_ms / 1e3, slo_cfg.tpot_ms / 1e3, min(slo_cfg.percentile, 99.9))
    try:
        return compare_shapes(PerfModel(profiles["profile"], workload, slo),
                              ColocatedModel(profiles["colocated_profile"], workload, slo),
                              engines=2, cores=sum(cpus))
    except ValueError as e:
        raise ConfigError(f"planner.colocated_profile: {e}") from None
