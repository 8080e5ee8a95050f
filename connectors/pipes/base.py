"""The pipe interface: ships (header, tensor) messages between a KV producer (P) and consumer (D).

Names follow vLLM's KVPipeBase (send_tensor / recv_tensor / close) plus a msgpack-able header
and a peer; the contract is docs/design.md, "The pipe contract". Transports register by name;
a new transport is one new file `connectors/pipes/<name>_pipe.py` that decorates its class
with `@register_pipe("<name>")`.
"""
from __future__ import annotations

import importlib
import pkgutil
from abc import ABC, abstractmethod
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Callable, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

if TYPE_CHECKING:  # torch loads with a pipe, not with the config (fast CLI checks)
    import torch

MiB = 1 << 20


class PipeError(RuntimeError):
    """A transport failure (peer unknown or gone, socket error)."""


class PipeClosed(PipeError):
    """The pipe was closed; raised by calls after close() and set on futures still pending."""


class PipeTimeout(PipeError, TimeoutError):
    """A bounded wait ran out (handshake, send backpressure, transfer)."""


class HandshakeError(ValueError):
    """The consumer rejected the producer's hello (model/dtype/shape mismatch)."""


class PipeConfig(BaseModel):
    """One pipe's settings (the ``kv_transfer`` keys that belong to the transport)."""
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    transport: Literal["tcp", "ipc"] = "tcp"  # ZMQ transport: tcp, or ipc (one host)
    host: str = "127.0.0.1"               # address listen() binds and advertises (tcp)
    interface: str = ""                   # instead of host: this node's address on that NIC
    cidr: str = ""                        # instead of host: this node's address in that network
    port: int = Field(0, ge=0, lt=65536)  # 0: the OS picks one (or one from port_range)
    port_range: tuple[int, int] | None = None  # (low, high): a free port in it (firewalls)
    ipc_dir: str = ""                     # "" -> tempfile.gettempdir()
    max_inflight_bytes: int = Field(256 * MiB, gt=0)  # send side: queued + not yet released
    max_recv_bytes: int = Field(256 * MiB, gt=0)  # receive side: not yet taken by recv_tensor
    max_frame_bytes: int = Field(8 * MiB, gt=0)  # large payloads are split into such frames
    send_timeout: float = Field(30.0, ge=0)  # how long send_tensor may block on backpressure
    handshake_timeout: float = Field(10.0, ge=0)  # connect(): wait for the consumer's reply
    linger: float = Field(1.0, ge=0)      # close(): how long unsent data may still be flushed
    hwm: int = Field(1000, gt=0)          # ZMQ SNDHWM/RCVHWM (messages)
    # How a peer proves it belongs to the cluster (connectors/pipes/auth.py): token, a
    # challenge-response over the cluster secret; curve, the same on CURVE-encrypted sockets;
    # none, no proof (anyone who reaches the port is a peer).
    security: Literal["token", "curve", "none"] = "token"
    # What each message carries so the receiver knows it is what was sent (integrity.py):
    # mac, a keyed MAC per connection (needs the secret: the default with token and curve);
    # crc32, a checksum against accidents only (the default with security none); none.
    # Compared at the handshake: both ends must agree.
    integrity: Literal["mac", "crc32", "none"] = "mac"
    # Transport-specific options, e.g. nixl_staging_mb (nixl: the decode engine's host staging
    # slab for writes into a fragmented grant, MiB, default 512 with a host cache, 0 off),
    # shm_dir (shm, auto), io_threads (zmq), nccl_buffer_bytes and max_peers (nccl).
    extra: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _integrity_default(cls, data: Any) -> Any:
        """No secret, no MAC: integrity defaults to crc32 with ``security: none``."""
        if isinstance(data, dict) and data.get("security") == "none":
            if data.get("integrity") == "mac":
                raise ValueError("integrity: mac needs the cluster secret (security: token or "
                                 "curve); with security: none use crc32 or none")
            if "integrity" not in data:
                data = {**data, "integrity": "crc32"}
        return data

    @field_validator("port_range", mode="before")
    @classmethod
    def _port_range(cls, value: Any) -> Any:
        if value in (None, (), []):
            return None
        lo_hi = tuple(value) if isinstance(value, (list, tuple)) else None
        if (lo_hi is None or len(lo_hi) != 2 or not all(type(p) is int for p in lo_hi)
                or not 0 < lo_hi[0] <= lo_hi[1] < 65536):
            raise ValueError(f"expected [low, high] ports, got {value!r}")
        return lo_hi

    @field_validator("cidr")
    @classmethod
    def _cidr(cls, value: str) -> str:
        if value:
            from connectors.pipes.addressing import parse_cidr
            parse_cidr(value)
        return value

    @model_validator(mode="after")
    def _one_address_rule(self) -> "PipeConfig":
        rules = [k for k in ("host", "interface", "cidr")
                 if k in self.model_fields_set and getattr(self, k)]
        if len(rules) > 1:
            raise ValueError(f"{rules[1]}: set only one of host, interface, cidr")
        return self

    def bind_host(self) -> str:
        """The address this node listens on: by interface or network if given, else host."""
        from connectors.pipes.addressing import select_address
        return select_address(interface=self.interface or None, cidr=self.cidr or None,
                              host=self.host)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "PipeConfig":
        """Build from a YAML section; unknown keys are an error, not silently ignored."""
        unknown = sorted(set(d) - set(cls.model_fields))
        if unknown:
            raise ValueError(f"unknown pipe config keys {unknown}; known: "
                             f"{sorted(cls.model_fields)}")
        return cls.model_validate(d)


Message = tuple[str, dict, Optional["torch.Tensor"]]


class KVPipe(ABC):
    """Both roles in one object: a consumer listen()s, a producer connect()s; either may send."""

    def __init__(self, config: PipeConfig) -> None:
        self.config = config

    @abstractmethod
    def listen(self) -> str:
        """Bind the receiving endpoint; return the address producers pass to connect()."""

    @abstractmethod
    def connect(self, peer_addr: str, hello: dict) -> dict:
        """Connect to a consumer and handshake; returns the consumer's reply.

        Raises HandshakeError (consumer's message) on mismatch, PipeTimeout if no reply in
        config.handshake_timeout. After success, `peer_addr` is the peer name for send_tensor
        and for the consumer's replies. Connecting again replaces the old connection.
        """

    def disconnect(self, peer_addr: str) -> None:
        """Forget a consumer (it is gone for good): stop reconnecting, fail its queued sends."""

    def carries(self, device: torch.device) -> bool:
        """Whether tensors on ``device`` are sent as they are (else the caller stages them in
        host memory first)."""
        return device.type == "cpu"

    @abstractmethod
    def set_handshake_validator(
        self, fn: Optional[Callable[[dict], Optional[str]]], info: Optional[dict] = None
    ) -> None:
        """Consumer: fn(hello) returns an error string to reject a producer, None to accept.

        `info` (msgpack-able) is sent back in the reply; connect() returns it under "info".
        """

    @abstractmethod
    def send_tensor(self, peer: str, header: dict, tensor: Optional[torch.Tensor]) -> Future:
        """Enqueue and return at once; the future resolves when the tensor's memory may be reused.

        Blocks (at most config.send_timeout, then PipeTimeout) while the bytes in flight would
        exceed config.max_inflight_bytes. A consumer replies to the peer name recv_tensor gave.
        """

    @abstractmethod
    def recv_tensor(self, timeout: float) -> Optional[Message]:
        """Next (peer, header, tensor-or-None), or None if nothing arrived within timeout."""

    @abstractmethod
    def close(self) -> None:
        """Idempotent: stop threads, close sockets (bounded linger), fail pending futures."""

    def take_lost_peers(self) -> list[str]:
        """Peers (as messages name them) whose connection to us was lost since the last
        call; a pipe that cannot tell returns none."""
        return []

    def stats(self) -> dict[str, int]:
        return {}

    def __enter__(self) -> "KVPipe":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ----------------------------------------------------------------------------- registry

_REGISTRY: dict[str, type[KVPipe]] = {}


def register_pipe(name: str) -> Callable[[type[KVPipe]], type[KVPipe]]:
    def deco(cls: type[KVPipe]) -> type[KVPipe]:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"pipe {name!r} is already registered by {_REGISTRY[name].__name__}")
        _REGISTRY[name] = cls
        return cls

    return deco


def available_pipes() -> list[str]:
    """Registered names plus `<name>_pipe` modules in this package (imported on first use)."""
    from connectors import pipes

    found = {m.name[: -len("_pipe")] for m in pkgutil.iter_modules(pipes.__path__)
             if m.name.endswith("_pipe")}
    return sorted(found | set(_REGISTRY))


def create_pipe(name: str, config: PipeConfig) -> KVPipe:
    """The registered pipe ``name`` (its module imported on first use)."""
    if name not in _REGISTRY and name.isidentifier():
        # Convention over an if-chain: importing the module runs its @register_pipe.
        try:
            importlib.import_module(f"connectors.pipes.{name}_pipe")
        except ModuleNotFoundError as e:
            if e.name != f"connectors.pipes.{name}_pipe":
                raise
    if name not in _REGISTRY:
        raise ValueError(f"unknown pipe {name!r}; known pipes: {available_pipes()}")
    return _REGISTRY[name](config)
