"""The cluster config: one YAML file validated into frozen pydantic models.

Each section is a model (unknown keys are errors with their key path); the ``engine`` section is
validated by the engine's own model (pd_cluster.config.EngineArgs) and ``kv_transfer`` is the
connector's own model (connectors.config.KVTransferConfig), so every key and default lives in
one place. Engines are derived from it (``engine_specs``); nothing about the deployment is
hard-coded elsewhere.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, PrivateAttr, ValidationError, field_validator, model_validator

from connectors.config import KVTransferConfig
from pd_cluster.config import EngineArgs
from pd_cluster.driver.messages import (ROLE_COLOCATED, ROLE_DECODE, ROLE_PREFILL,
                                        EngineSpec)
from pd_cluster.serving.cluster.auto_shape import resolve_shape
from pd_cluster.serving.cluster.config_sections import (ConfigSection, CpuConfig,
                                                        PlannerConfig, ProxyConfig, RayConfig,
                                                        RoleConfig)
from pd_cluster.serving.cluster.model_source import resolve_model, served_name
from pd_cluster.serving.cluster.schema import ConfigError, config_error, set_path

__all__ = ["ClusterConfig", "ConfigError", "KVTransferConfig", "ProxyConfig", "RayConfig",
           "RoleConfig", "load_config", "merge_config", "parse_config", "parse_overrides",
           "resolve_model"]

_KV_ROLE = {ROLE_PREFILL: "producer", ROLE_DECODE: "consumer"}
DECODE_PREFILL_CAP = 64  # tokens: see RoleConfig.max_prefill_tokens_per_step


class ClusterConfig(ConfigSection):
    """A whole cluster: the model, the engines per role, the KV transfer, the proxy, Ray."""
    # A built-in preset, a checkpoint directory present on every engine's node, or a Hugging
    # Face repo id (from each node's HF cache, or fetched).
    model: str = "tiny-llama"
    # The name(s) clients send as `model` (as vLLM's --served-model-name): the first is the
    # one responses report, every one is accepted. Unset: `model` exactly as written.
    served_model_name: str | list[str] | None = None
    # disaggregated: prefill and decode engines linked by KV transfer; colocated: engines that
    # do both (no KV transfer; the reference the disaggregated output must equal); auto: the
    # one that serves more within proxy.slo by the planner's profiles (planner.profile and
    # planner.colocated_profile), else disaggregated; replica counts for prefill or decode
    # make it disaggregated (serving/cluster/auto_shape.py).
    mode: Literal["auto", "disaggregated", "colocated"] = "auto"
    prefill: RoleConfig = Field(default_factory=RoleConfig)
    decode: RoleConfig = Field(default_factory=RoleConfig)
    colocated: RoleConfig = Field(default_factory=lambda: RoleConfig(replicas=2))
    # Every engine's settings (the `engine` section below); validated by EngineArgs.
    engine: dict[str, Any] = Field(default_factory=dict)
    kv_transfer: KVTransferConfig = Field(default_factory=KVTransferConfig)
    proxy: ProxyConfig = Field(default_factory=ProxyConfig)
    ray: RayConfig = Field(default_factory=RayConfig)
    cpu: CpuConfig = Field(default_factory=CpuConfig)
    # The SLO controller: engines switched between roles and scaled to the load (off).
    planner: PlannerConfig = Field(default_factory=PlannerConfig)
    _shape_note: str | None = PrivateAttr(None)

    @model_validator(mode="before")
    @classmethod
    def _auto_shape(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("mode", "auto") == "auto":
            data, _ = resolve_shape(data)
        return data

    @property
    def shape_note(self) -> str | None:
        """Why `mode: auto` took this shape (None: the config named it)."""
        return self._shape_note

    @field_validator("engine")
    @classmethod
    def _engine(cls, value: dict[str, Any]) -> dict[str, Any]:
        for key in ("model", "kv_transfer"):
            if key in value:
                raise ValueError(f"{key}: set it as the top-level `{key}` section")
        if "tensor_parallel_size" in value:
            raise ValueError("tensor_parallel_size: set it per role (prefill, decode or "
                             "colocated section): it decides the role's resources")
        try:
            EngineArgs.model_validate(value)
        except ValidationError as e:
            raise config_error(e, EngineArgs) from None
        return value

    @field_validator("kv_transfer")
    @classmethod
    def _kv_role(cls, value: KVTransferConfig) -> KVTransferConfig:
        if "role" in value.model_fields_set:
            raise ValueError("role: set per engine by the cluster (prefill: producer, "
                             "decode: consumer)")
        return value

    @model_validator(mode="after")
    def _shared_gpu_fits(self) -> "ClusterConfig":
        """Engines with num_gpus < 1 share a GPU, and each takes gpu_memory_utilization of
        it: caught here in a second rather than as an out-of-memory engine at start-up."""
        fractions = [rc.num_gpus for rc in self.roles.values() if 0 < rc.num_gpus < 1]
        if not fractions or self.engine.get("num_kv_blocks") or self.engine.get("device") == "cpu":
            return self
        per_gpu = int(1 / min(fractions) + 1e-9)
        share = float(self.engine.get("gpu_memory_utilization",
                                      EngineArgs.model_fields["gpu_memory_utilization"].default))
        if share * per_gpu > 1 + 1e-9:
            raise ValueError(
                f"engine.gpu_memory_utilization: {share} per engine x {per_gpu} engines per GPU "
                f"(num_gpus {min(fractions)}) is more than the GPU; use at most "
                f"{int(100 / per_gpu) / 100}")
        return self

    @field_validator("served_model_name")
    @classmethod
    def _names(cls, value: str | list[str] | None) -> str | list[str] | None:
        names = [value] if isinstance(value, str) else value or []
        if value is not None and (not names or not all(n.strip() for n in names)):
            raise ValueError("must be a non-empty name or list of names")
        return value

    @property
    def served_names(self) -> list[str]:
        """Every name a request's `model` may give; the first is the one reported."""
        if self.served_model_name is None:
            return [served_name(self.model)]
        if isinstance(self.served_model_name, str):
            return [self.served_model_name]
        return list(self.served_model_name)

    @property
    def model_name(self) -> str:
        return self.served_names[0]

    @property
    def roles(self) -> dict[str, RoleConfig]:
        if self.mode == "colocated":
            return {ROLE_COLOCATED: self.colocated}
        return {ROLE_PREFILL: self.prefill, ROLE_DECODE: self.decode}

    def engine_specs(self) -> list[EngineSpec]:
        return [self.engine_spec(role, f"{role}-{i}")
                for role, rc in self.roles.items() for i in range(rc.replicas)]

    def engine_spec(self, role: str, name: str) -> EngineSpec:
        """The spec of one engine of ``role`` named ``name`` (at launch, and for engines a
        running cluster adds or switches to this role: serving/cluster/scaling.py)."""
        rc = self.roles[role]
        args = dict(self.engine)
        if role in _KV_ROLE:
            args["kv_transfer"] = kv_for_role(self.kv_transfer, role)
        if rc.tensor_parallel_size > 1:
            args["tensor_parallel_size"] = rc.tensor_parallel_size
        cap = prefill_cap(role, rc, self.engine)
        if cap is not None:
            args["max_prefill_tokens_per_step"] = cap
        if role == ROLE_COLOCATED:
            # A colocated engine mixes prompts into its decode steps within the TPOT target,
            # as fast as the queued prompts' TTFT target needs.
            args.setdefault("tpot_target_ms", self.proxy.slo.tpot_ms)
            args.setdefault("ttft_target_ms", self.proxy.slo.ttft_ms)
        return EngineSpec(name=name, role=role, model=self.model,
                          engine_args=own_disk_tier(args, name), num_cpus=rc.num_cpus,
                          num_gpus=rc.num_gpus, pin_threads=self.cpu.pin_threads,
                          reserve_cores=self.cpu.reserve_cores,
                          lend_cores=self._shares(role, rc, lends=True),
                          borrow_cores=self._shares(role, rc, lends=False),
                          tpot_target_s=self.proxy.slo.tpot_ms / 1e3,
                          slo_percentile=self.proxy.slo.percentile)

    def _shares(self, role: str, rc: RoleConfig, lends: bool) -> bool:
        """Engines of ``role`` lend their cores (``lends``) or borrow the other role's, in
        core sharing (disaggregated, CPU, one rank; driver/core_lending.py)."""
        if not (self.cpu.pin_threads and role in _KV_ROLE and rc.num_gpus == 0
                and rc.tensor_parallel_size == 1):
            return False
        decode_lends, prefill_lends = self.cpu.lend_decode_cores, self.cpu.lend_prefill_cores
        if role == "decode":
            return decode_lends if lends else prefill_lends
        return prefill_lends if lends else decode_lends

    def required_cpus(self) -> float:
        return sum(rc.replicas * rc.num_cpus * rc.tensor_parallel_size
                   for rc in self.roles.values())

    def required_gpus(self) -> float:
        return sum(rc.replicas * rc.num_gpus * rc.tensor_parallel_size
                   for rc in self.roles.values())

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(exclude_unset=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ClusterConfig":
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise config_error(e, cls) from None


def own_disk_tier(args: dict[str, Any], name: str) -> dict[str, Any]:
    """Each engine's KV disk tier in a directory of its own, ``<path>/<engine name>``: engines
    of one node never evict each other's files nor exceed ``size`` together, and a restarted
    engine (same name) finds the files its previous incarnation wrote."""
    disk = args.get("kv_offloading_disk")
    if not disk:
        return args
    return {**args, "kv_offloading_disk": {**disk, "path": str(Path(disk["path"]) / name)}}


def prefill_cap(role: str, rc: RoleConfig, engine: dict[str, Any]) -> int | None:
    """The role's max_prefill_tokens_per_step (None: the engine's own default, no cap)."""
    if rc.max_prefill_tokens_per_step is not None:
        return rc.max_prefill_tokens_per_step
    if "max_prefill_tokens_per_step" in engine:
        return engine["max_prefill_tokens_per_step"]
    if role == ROLE_DECODE and "max_prefill_tokens_per_step" in EngineArgs.model_fields:
        return DECODE_PREFILL_CAP
    return None


def kv_for_role(kv: KVTransferConfig, role: str) -> dict[str, Any]:
    """EngineConfig.kv_transfer for an engine of this role: the transfer essentials plus what
    the YAML set (address rules stay unset unless given: the engine's node fills in its own)."""
    return {"role": _KV_ROLE[role], "pipe": kv.pipe, "transport": kv.pipe_config.transport,
            "kv_transfer_timeout": kv.kv_transfer_timeout, **kv.to_dict()}


def parse_overrides(items: list[str] | None) -> dict[str, Any]:
    """``["proxy.port=0", "prefill.replicas=2"]`` -> nested dict (values parsed as YAML)."""
    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE (e.g. proxy.port=8001)")
        set_path(out, key.strip(), yaml.safe_load(raw))
    return out


def merge_config(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``over``'s keys set, section by section (neither is modified)."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merge_config(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def parse_config(data: Any, overrides: dict[str, Any] | None = None) -> ClusterConfig:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"<root>: expected a mapping, got {type(data).__name__}")
    data = merge_config(data, overrides or {})
    data, note = resolve_shape(data)
    mode = data["mode"]
    unused = ("colocated",) if mode != "colocated" else ("prefill", "decode", "kv_transfer")
    for key in unused:
        if key in data:
            raise ConfigError(f"{key}: not used with mode: {mode} (remove it)")
    cfg = ClusterConfig.from_dict(data)
    cfg._shape_note = note
    return cfg


def load_config(path: str | Path, overrides: dict[str, Any] | None = None) -> ClusterConfig:
    """Read and validate a cluster YAML; ConfigError names the bad key."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} not found")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML: {e}") from None
    return parse_config(data, overrides)
