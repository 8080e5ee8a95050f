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
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from connectors.config import KVTransferConfig
from pd_cluster.config import EngineArgs
from pd_cluster.driver.messages import (ROLE_COLOCATED, ROLE_DECODE, ROLE_PREFILL,
                                        EngineSpec)
from pd_cluster.serving.cluster.model_source import resolve_model, served_name
from pd_cluster.serving.cluster.schema import ConfigError, config_error, set_path

__all__ = ["ClusterConfig", "ConfigError", "KVTransferConfig", "ProxyConfig", "RayConfig",
           "RoleConfig", "load_config", "parse_config", "parse_overrides", "resolve_model"]

_KV_ROLE = {ROLE_PREFILL: "producer", ROLE_DECODE: "consumer"}
DECODE_PREFILL_CAP = 64  # tokens: see RoleConfig.max_prefill_tokens_per_step


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


class RoleConfig(_Section):
    replicas: int = Field(1, ge=1)
    # Ranks per engine (tensor parallelism): rank 0 in the engine actor, the others its worker
    # processes on the same node, one device each. num_cpus, num_gpus and the engine's KV
    # budget are per rank; the actor holds tensor_parallel_size x them.
    tensor_parallel_size: int = Field(1, ge=1)
    num_cpus: float = Field(1.0, ge=0)  # Ray CPUs per rank; also its torch thread count on CPU
    num_gpus: float = Field(0.0, ge=0)  # 1 per rank on CUDA
    max_restarts: int = Field(3, ge=-1)  # Ray restarts a dead engine this many times (-1: ever)
    # Placement, all through Ray: custom resources each engine needs (nodes started with
    # `ray start --resources`), node labels it needs (`ray start --labels`), and how the
    # role's replicas are laid out (a placement group strategy; null: Ray's default).
    resources: dict[str, float] = Field(default_factory=dict)
    node_labels: dict[str, str] = Field(default_factory=dict)
    strategy: Literal["spread", "pack", "strict_spread", "strict_pack"] | None = None
    # Prompt tokens an engine of this role computes per step while it has decodes running
    # (protects their inter-token latency). Unset: the engine section's value, else for decode
    # engines DECODE_PREFILL_CAP (they prefill only when the proxy finds that cheaper than P).
    max_prefill_tokens_per_step: int | None = Field(None, ge=1)

    @field_validator("resources")
    @classmethod
    def _resources(cls, value: dict[str, float]) -> dict[str, float]:
        for name, amount in value.items():
            if name in ("CPU", "GPU", "memory"):
                raise ValueError(f"{name}: use num_cpus / num_gpus instead")
            if amount <= 0:
                raise ValueError(f"{name}: must be a number > 0, got {amount!r}")
        return value

    @model_validator(mode="after")
    def _whole_gpus_per_rank(self) -> "RoleConfig":
        if self.tensor_parallel_size > 1 and 0 < self.num_gpus < 1:
            raise ValueError(f"num_gpus: {self.num_gpus} with tensor_parallel_size "
                             f"{self.tensor_parallel_size}: each rank needs a whole GPU (NCCL "
                             f"refuses two ranks on one GPU)")
        return self

    @model_validator(mode="after")
    def _strategy_needs_resources(self) -> "RoleConfig":
        if self.strategy and not self.demand():
            raise ValueError("strategy: a placement group needs num_cpus, num_gpus or "
                             "resources > 0 per engine")
        return self

    def demand(self) -> dict[str, float]:
        """Ray resources one engine of this role holds (all its ranks)."""
        tp = self.tensor_parallel_size
        out = {"CPU": self.num_cpus * tp, "GPU": self.num_gpus * tp, **self.resources}
        return {k: float(v) for k, v in out.items() if v}


class ProxyConfig(_Section):
    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port (the launcher prints the URL)
    max_inflight: int = Field(256, ge=1)  # requests running at once; more wait in the queue
    # Requests waiting for an in-flight slot (first come, first served; their wait counts in
    # their TTFT); beyond it a request gets 429 with Retry-After.
    max_queue: int = Field(1024, ge=0)
    # How tokens reach the proxy: "zmq", one message per engine step from each engine's
    # output thread; "ray", one Ray streaming call per request (the previous path).
    token_transport: Literal["zmq", "ray"] = "zmq"
    # Tokens per streamed chunk at least (as vLLM's stream_interval): the first token and the
    # last chunk go at once; fewer, larger chunks cost the proxy and the client less per token.
    stream_interval: int = Field(1, ge=1)
    # Which engine of a role gets a request: cache_aware (the longest cached prefix weighed
    # against load, from the engines' prefix-cache reports), least_loaded or round_robin.
    routing: str = "cache_aware"
    # Per request in a disaggregated cluster: auto, remote prefill on P or prefill on D alone,
    # whichever is expected to give the first token sooner (routing/ttft_model.py); always:
    # every request with max_tokens > 1 goes through P.
    disaggregation: Literal["auto", "always"] = "auto"
    # auto: D prefills alone only when that is expected to give the first token this much
    # sooner than P would (P's queue or missing cache); below it, prefill stays off D.
    local_prefill_margin_ms: float = Field(20.0, ge=0)
    # Decode engines match the prompt against their own prefix cache and receive only the KV
    # blocks they lack (false: every prompt's KV is shipped whole, as before).
    decode_prefix_reuse: bool = True
    cache_events_interval: float = Field(0.25, gt=0)  # s between prefix-cache reports pulled
    cache_index_max_blocks: int = Field(65536, ge=1)  # block hashes remembered per engine
    request_timeout: float = Field(120.0, gt=0)  # bound on every wait for one request
    health_check_interval: float = Field(2.0, gt=0)
    health_check_timeout: float = Field(10.0, gt=0)
    unhealthy_threshold: int = Field(2, ge=1)  # failed checks before routing around an engine
    max_retries: int = Field(2, ge=0)  # extra engine pairs tried before any output is sent
    # Times a request may move to another engine when its engine fails mid-stream.
    max_migrations: int = Field(2, ge=0)
    max_restarts: int = 3
    log_stats_interval: float = 10.0  # s between per-engine stats lines in the log (0: off)

    @field_validator("port")
    @classmethod
    def _port(cls, value: int) -> int:
        if not 0 <= value < 65536:
            raise ValueError(f"must be in [0, 65535], got {value}")
        return value

    @field_validator("routing")
    @classmethod
    def _routing(cls, value: str) -> str:
        from pd_cluster.serving.routing.router import router_names
        if value not in router_names():
            raise ValueError(f"must be one of {', '.join(router_names())}, got {value!r}")
        return value


class RayConfig(_Section):
    address: str | None = None  # None: start a local instance
    namespace: str = "pd-cluster"
    num_cpus: float | None = None  # local instance only; default: what the engines need
    num_gpus: float | None = None


class ClusterConfig(_Section):
    model: str = "tiny-llama"  # a preset, a checkpoint dir on every node, or an HF repo id
    served_model_name: str | None = None  # the `model` clients send; default from `model`
    mode: Literal["disaggregated", "colocated"] = "disaggregated"
    prefill: RoleConfig = Field(default_factory=RoleConfig)
    decode: RoleConfig = Field(default_factory=RoleConfig)
    colocated: RoleConfig = Field(default_factory=lambda: RoleConfig(replicas=2))
    # EngineArgs keys as written (the engines fill in defaults); validated by EngineArgs.
    engine: dict[str, Any] = Field(default_factory=dict)
    kv_transfer: KVTransferConfig = Field(default_factory=KVTransferConfig)
    proxy: ProxyConfig = Field(default_factory=ProxyConfig)
    ray: RayConfig = Field(default_factory=RayConfig)

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

    @property
    def model_name(self) -> str:
        return self.served_model_name or served_name(self.model)

    @property
    def roles(self) -> dict[str, RoleConfig]:
        if self.mode == "colocated":
            return {ROLE_COLOCATED: self.colocated}
        return {ROLE_PREFILL: self.prefill, ROLE_DECODE: self.decode}

    def engine_specs(self) -> list[EngineSpec]:
        specs = []
        for role, rc in self.roles.items():
            args = dict(self.engine)
            if role in _KV_ROLE:
                args["kv_transfer"] = kv_for_role(self.kv_transfer, role)
            if rc.tensor_parallel_size > 1:
                args["tensor_parallel_size"] = rc.tensor_parallel_size
            cap = prefill_cap(role, rc, self.engine)
            if cap is not None:
                args["max_prefill_tokens_per_step"] = cap
            for i in range(rc.replicas):
                specs.append(EngineSpec(name=f"{role}-{i}", role=role, model=self.model,
                                        engine_args=args, num_cpus=rc.num_cpus,
                                        num_gpus=rc.num_gpus))
        return specs

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


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def parse_config(data: Any, overrides: dict[str, Any] | None = None) -> ClusterConfig:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"<root>: expected a mapping, got {type(data).__name__}")
    data = _merge(data, overrides or {})
    mode = data.get("mode", "disaggregated")
    unused = ("colocated",) if mode != "colocated" else ("prefill", "decode", "kv_transfer")
    for key in unused:
        if key in data:
            raise ConfigError(f"{key}: not used with mode: {mode} (remove it)")
    return ClusterConfig.from_dict(data)


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
