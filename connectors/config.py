"""The ``kv_transfer`` config section as a frozen dataclass."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

ROLES = ("producer", "consumer", "both")


@dataclass(frozen=True)
class KVTransferConfig:
    role: str = "both"  # producer (prefill), consumer (decode), or both
    connector: str = "pd"
    pipe: str = "zmq"
    kv_transfer_timeout: float = 30.0  # seconds a transfer may take before fallback / free
    max_staging_bytes: int = 256 * 1024 * 1024  # consumer: early arrivals held at most
    pipe_config: dict[str, Any] = field(default_factory=dict)  # PipeConfig fields

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"kv_transfer.role must be one of {ROLES}, got {self.role!r}")
        if not self.kv_transfer_timeout > 0:
            raise ValueError(f"kv_transfer.kv_transfer_timeout must be > 0, got "
                             f"{self.kv_transfer_timeout}")

    @property
    def is_producer(self) -> bool:
        return self.role in ("producer", "both")

    @property
    def is_consumer(self) -> bool:
        return self.role in ("consumer", "both")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "KVTransferConfig":
        """Top-level keys that are not ours go to the pipe (transport, host, port, ...)."""
        own = {f.name for f in dataclasses.fields(cls)}
        pipe_config = dict(d.get("pipe_config") or {})
        pipe_config.update({k: v for k, v in d.items() if k not in own})
        return cls(**{k: v for k, v in d.items() if k in own and k != "pipe_config"},
                   pipe_config=pipe_config)
