"""Typed messages that cross process boundaries (launcher -> actors, proxy <-> engine actors).

Ray carries them as plain msgpack-able dicts built with ``to_dict`` and rebuilt with
``from_dict``, so both ends agree on one schema and unknown fields are an error, not a surprise.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")

ROLE_PREFILL = "prefill"
ROLE_DECODE = "decode"
ROLE_COLOCATED = "colocated"

# EngineDelta.error_type values: a client error never marks an engine unhealthy.
ERROR_INVALID_REQUEST = "invalid_request"
ERROR_ENGINE = "engine"
ERROR_TIMEOUT = "timeout"


class _Msg:
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls: type[T], d: dict[str, Any]) -> T:
        names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"{cls.__name__}: unknown field(s) {unknown}")
        return cls(**d)


@dataclass(frozen=True)
class EngineSpec(_Msg):
    """Everything an engine actor needs to start (derived from the cluster config)."""
    name: str
    role: str
    model: str  # a path or a built-in preset name, resolved on the engine's own node
    engine_args: dict[str, Any]  # EngineConfig fields except model (kv_transfer included)
    num_cpus: float = 1.0
    num_gpus: float = 0.0


@dataclass(frozen=True)
class EngineRequest(_Msg):
    request_id: str
    prompt_token_ids: list[int]
    params: dict[str, Any]  # SamplingParams.to_dict()
    kv_transfer_params: dict[str, Any] | None = None
    timeout: float = 120.0  # the engine ends the stream with an error after this long idle


@dataclass
class EngineDelta(_Msg):
    """The latest state of one request on one engine (cumulative text/token_ids)."""
    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    emit_time: float = 0.0  # wall clock when the engine produced it (proxy overhead metric)
    error: str | None = None
    error_type: str | None = None


@dataclass(frozen=True)
class EngineInfo(_Msg):
    """What an engine reports when ready and in every health check."""
    name: str
    role: str
    incarnation: str  # new after every (re)start: the proxy refreshes kv_endpoint on change
    pid: int
    node_ip: str
    kv_endpoint: str | None
    max_model_len: int
    node_id: str = ""
    kv_peers: dict[str, Any] = field(default_factory=dict)  # producer: endpoint -> tag
    stats: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class EngineStatus(_Msg):
    """One row of `pd-cluster status`: the proxy's view of an engine."""
    name: str
    role: str
    healthy: bool
    inflight: int = 0
    restarts: int = 0
    pid: int = 0
    node_ip: str = ""
    node_id: str = ""
    kv_endpoint: str | None = None
    kv_peers: int = 0  # producer: consumers it has a working handshake with
    last_error: str | None = None
    stats: dict[str, Any] = field(default_factory=dict)
