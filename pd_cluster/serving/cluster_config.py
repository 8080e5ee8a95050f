"""The cluster config: one YAML file validated into frozen dataclasses.

Every section and key is listed here; anything else is rejected with its key path. Engines
are derived from it (``engine_specs``), so nothing about the deployment is hard-coded elsewhere.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from pd_cluster.serving.messages import (ROLE_COLOCATED, ROLE_DECODE, ROLE_PREFILL,
                                         EngineSpec)
from pd_cluster.serving.model_source import resolve_model, served_name
from pd_cluster.serving.schema import ConfigError, build, set_path

__all__ = ["ClusterConfig", "ConfigError", "KVTransferConfig", "ProxyConfig", "RayConfig",
           "RoleConfig", "load_config", "parse_config", "parse_overrides", "resolve_model"]

# kv_transfer keys besides the pipe's own (connectors.config.KVTransferConfig minus role).
_KV_OWN_KEYS = ("connector", "pipe", "kv_transfer_timeout", "max_staging_bytes", "pipe_config")
# Fallback list of pipe keys (connectors.pipes.base.PipeConfig) when connectors is not importable.
_PIPE_KEYS = ("transport", "host", "interface", "cidr", "port", "port_range", "ipc_dir",
              "max_inflight_bytes", "max_recv_bytes", "max_frame_bytes", "send_timeout",
              "handshake_timeout", "linger", "hwm", "extra")
_ADDRESS_KEYS = ("host", "interface", "cidr", "port_range")  # set directly, not in options
_KV_ROLE = {ROLE_PREFILL: "producer", ROLE_DECODE: "consumer"}


@dataclass(frozen=True)
class RoleConfig:
    replicas: int = 1
    num_cpus: float = 1.0  # Ray CPUs per engine; also its torch thread count on CPU
    num_gpus: float = 0.0  # 1 per engine on CUDA
    max_restarts: int = 3  # Ray restarts a dead engine this many times
    # Placement, all through Ray: custom resources each engine needs (nodes started with
    # `ray start --resources`), node labels it needs (`ray start --labels`), and how the
    # role's replicas are laid out (a placement group strategy; null: Ray's default).
    resources: dict[str, float] = field(default_factory=dict)
    node_labels: dict[str, str] = field(default_factory=dict)
    strategy: Literal["spread", "pack", "strict_spread", "strict_pack"] | None = None

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas: must be >= 1, got {self.replicas}")
        if self.num_cpus < 0 or self.num_gpus < 0:
            raise ValueError("num_cpus: num_cpus and num_gpus must be >= 0")
        if self.max_restarts < -1:
            raise ValueError(f"max_restarts: must be >= -1 (-1: forever), got {self.max_restarts}")
        for name, amount in self.resources.items():
            if name in ("CPU", "GPU", "memory"):
                raise ValueError(f"resources.{name}: use num_cpus / num_gpus instead")
            if isinstance(amount, bool) or not isinstance(amount, (int, float)) or amount <= 0:
                raise ValueError(f"resources.{name}: must be a number > 0, got {amount!r}")
        for key, value in self.node_labels.items():
            if not isinstance(value, str):
                raise ValueError(f"node_labels.{key}: must be a string, got {value!r}")
        if self.strategy and not self.demand():
            raise ValueError("strategy: a placement group needs num_cpus, num_gpus or "
                             "resources > 0 per engine")

    def demand(self) -> dict[str, float]:
        """Ray resources one engine of this role holds."""
        out = {"CPU": self.num_cpus, "GPU": self.num_gpus, **self.resources}
        return {k: float(v) for k, v in out.items() if v}


@dataclass(frozen=True)
class KVTransferConfig:
    pipe: Literal["zmq", "nccl"] = "zmq"
    transport: Literal["tcp", "ipc"] = "tcp"
    kv_transfer_timeout: float = 30.0
    # Where decode engines listen for KV, decided on each node (never one address for the
    # cluster): by default the node's own address as Ray knows it; or its address on a named
    # interface, or in a network (to pick the fast NIC of multi-homed nodes).
    host: str | None = None
    interface: str | None = None
    cidr: str | None = None
    port_range: list[int] | None = None  # [low, high]: KV ports to open in a firewall
    unreachable: Literal["error", "warn"] = "error"  # a P/D pair that fails its launch handshake
    options: dict[str, Any] = field(default_factory=dict)  # more connector / pipe keys

    def __post_init__(self) -> None:
        if not self.kv_transfer_timeout > 0:
            raise ValueError(f"kv_transfer_timeout: must be > 0, got {self.kv_transfer_timeout}")
        chosen = [k for k in ("host", "interface", "cidr") if getattr(self, k)]
        if len(chosen) > 1:
            raise ValueError(f"{chosen[1]}: set only one of host, interface, cidr")
        self._check_pipe_keys(self.address())
        top = {"pipe", "transport", "kv_transfer_timeout", *_ADDRESS_KEYS}
        known = (set(_KV_OWN_KEYS) | set(_pipe_keys())) - top
        for key in self.options:
            if key not in known:
                raise ValueError(f"options.{key}: unknown key (expected one of: "
                                 f"{', '.join(sorted(known))})")

    @staticmethod
    def _check_pipe_keys(keys: dict[str, Any]) -> None:
        try:  # the pipe owns these checks (cidr syntax, port_range bounds)
            from connectors.pipes.base import PipeConfig
        except ImportError:
            return
        PipeConfig.from_dict(keys)

    def address(self) -> dict[str, Any]:
        """The address rule engines apply on their own node (only the keys that are set)."""
        return {k: getattr(self, k) for k in _ADDRESS_KEYS if getattr(self, k)}

    def for_role(self, role: str) -> dict[str, Any]:
        """EngineConfig.kv_transfer for an engine of this role (the engine's node fills in
        ``host`` when no address rule is given)."""
        return {"role": _KV_ROLE[role], "pipe": self.pipe, "transport": self.transport,
                "kv_transfer_timeout": self.kv_transfer_timeout, **self.address(),
                **self.options}


@dataclass(frozen=True)
class ProxyConfig:
    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port (the launcher prints the URL)
    max_inflight: int = 256  # more concurrent requests get 429
    routing: str = "least_loaded"
    request_timeout: float = 120.0  # bound on every wait for one request
    health_check_interval: float = 2.0
    health_check_timeout: float = 10.0
    unhealthy_threshold: int = 2  # consecutive failed checks before routing around an engine
    max_retries: int = 2  # extra engine pairs tried when one fails before any output is sent
    max_restarts: int = 3

    def __post_init__(self) -> None:
        from pd_cluster.serving.router import router_names

        if not 0 <= self.port < 65536:
            raise ValueError(f"port: must be in [0, 65535], got {self.port}")
        if self.routing not in router_names():
            raise ValueError(f"routing: must be one of {', '.join(router_names())}, "
                             f"got {self.routing!r}")
        for name in ("max_inflight", "unhealthy_threshold"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("request_timeout", "health_check_interval", "health_check_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        if self.max_retries < 0:
            raise ValueError(f"max_retries: must be >= 0, got {self.max_retries}")


@dataclass(frozen=True)
class RayConfig:
    address: str | None = None  # None: start a local instance
    namespace: str = "pd-cluster"
    num_cpus: float | None = None  # local instance only; default: what the engines need
    num_gpus: float | None = None


@dataclass(frozen=True)
class ClusterConfig:
    model: str = "tiny-llama"  # a preset, a checkpoint dir on every node, or an HF repo id
    served_model_name: str | None = None  # the `model` clients send; default from `model`
    mode: Literal["disaggregated", "colocated"] = "disaggregated"
    prefill: RoleConfig = field(default_factory=RoleConfig)
    decode: RoleConfig = field(default_factory=RoleConfig)
    colocated: RoleConfig = field(default_factory=lambda: RoleConfig(replicas=2))
    engine: dict[str, Any] = field(default_factory=dict)  # EngineConfig arguments
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig)
    proxy: ProxyConfig = field(default_factory=ProxyConfig)
    ray: RayConfig = field(default_factory=RayConfig)

    def __post_init__(self) -> None:
        from pd_cluster.config import EngineConfig

        if "model" in self.engine or "kv_transfer" in self.engine:
            key = "model" if "model" in self.engine else "kv_transfer"
            raise ValueError(f"engine.{key}: set it as the top-level `{key}` section")
        try:
            EngineConfig.from_kwargs(self.model, **self.engine)
        except (TypeError, ValueError) as e:
            msg = str(e)
            if msg.startswith("unknown engine argument(s): "):
                keys = msg.split(": ", 1)[1]
                raise ValueError(f"engine.{keys.split(', ')[0]}: unknown key") from None
            m = re.match(r"^(\w+) must (.*)$", msg, re.S)
            raise ValueError(f"engine.{m.group(1)}: must {m.group(2)}" if m
                             else f"engine: {msg}") from None

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
                args["kv_transfer"] = self.kv_transfer.for_role(role)
            for i in range(rc.replicas):
                specs.append(EngineSpec(name=f"{role}-{i}", role=role, model=self.model,
                                        engine_args=args, num_cpus=rc.num_cpus,
                                        num_gpus=rc.num_gpus))
        return specs

    def required_cpus(self) -> float:
        return sum(rc.replicas * rc.num_cpus for rc in self.roles.values())

    def required_gpus(self) -> float:
        return sum(rc.replicas * rc.num_gpus for rc in self.roles.values())

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ClusterConfig":
        return build(cls, data)


def _pipe_keys() -> tuple[str, ...]:
    try:  # the connector package owns the pipe's keys; stay in sync with it when present
        from connectors.pipes.base import PipeConfig
        return tuple(f.name for f in dataclasses.fields(PipeConfig))
    except Exception:  # noqa: BLE001 - any import problem: use the static list
        return _PIPE_KEYS


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
    return build(ClusterConfig, data)


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
