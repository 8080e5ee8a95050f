"""The ``kv_transfer`` section: one model from the cluster YAML down to each engine's connector.

Pipe keys (``transport``, ``host``, ``cidr``, ``port_range``, ...) may sit directly in the section
for readability; they are moved into ``pipe_config`` (a PipeConfig), so each key and its default
lives in exactly one place. ``options`` is the cluster YAML's bag of further connector/pipe keys.
"""
from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from connectors.pipes.base import PipeConfig

MiB = 1 << 20
logger = logging.getLogger(__name__)


class KVTransferConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    role: Literal["producer", "consumer", "both"] = "both"  # prefill / decode / both
    connector: str = "pd"  # a registered KV connector name
    # auto: per link, shm when the handshake finds both engines on one host with shared
    # memory usable (/dev/shm writable with room for the decode engine's host KV cache), else
    # zmq; the choice and its reason are logged and shown by `pd-cluster status`. Or a
    # registered pipe name (connectors/pipes/<name>_pipe.py): zmq, shm, nixl, gloo, nccl,
    # cuda_ipc (one host, CUDA caches; unverified on a GPU, never chosen by auto).
    pipe: str = "auto"
    kv_transfer_timeout: float = Field(30.0, gt=0)  # a transfer's bound: fallback / free after
    max_staging_bytes: int = Field(256 * MiB, gt=0)  # consumer: early arrivals held at most
    # Producer: a finished request's blocks are held while the consumer renews this lease
    # (it renews every lease_seconds / 3 while receiving); silence frees them.
    lease_seconds: float = Field(3.0, gt=0)
    # A prefill engine that cannot reach a decode engine at launch fails it ("error") or is
    # logged and retried in the background ("warn").
    unreachable: Literal["error", "warn"] = "error"
    record_timings: bool = False  # per-request layer timestamps (overlap tests, benchmarks)
    # What each message carries against forgery or accidents is the pipe's ``integrity`` (mac,
    # crc32, none: pipes/integrity.py); a message that fails it, a missing layer or blocks the
    # request does not own fail the transfer (the decode engine recomputes), never decoded on.
    # ``digest`` (a bool) is its deprecated name: false means integrity none.
    pipe_config: PipeConfig = Field(default_factory=PipeConfig)

    @field_validator("pipe")
    @classmethod
    def _known_pipe(cls, value: str) -> str:
        from connectors.pipes.base import available_pipes
        if value not in available_pipes():
            raise ValueError(f"must be one of {', '.join(available_pipes())}, got {value!r}")
        return value

    @model_validator(mode="before")
    @classmethod
    def _gather_pipe_keys(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        options = data.pop("options", None) or {}
        if not isinstance(options, dict):
            raise ValueError("options: expected a mapping")
        known = ((set(cls.model_fields) | set(PipeConfig.model_fields) | {"digest"})
                 - {"pipe_config", "role"})
        for key in options:
            if key not in known or key in data:
                why = "set it directly" if key in data else "unknown key"
                raise ValueError(f"options.{key}: {why} (expected one of: "
                                 f"{', '.join(sorted(known))})")
        data.update(options)
        _digest_alias(data)
        pipe_keys = {k: data.pop(k) for k in list(data) if k in PipeConfig.model_fields}
        if pipe_keys:
            base = data.get("pipe_config") or {}
            if isinstance(base, PipeConfig):
                base = base.model_dump(exclude_defaults=True)
            data["pipe_config"] = {**base, **pipe_keys}
        return data

    @property
    def is_producer(self) -> bool:
        return self.role in ("producer", "both")

    @property
    def is_consumer(self) -> bool:
        return self.role in ("consumer", "both")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "KVTransferConfig":
        return cls.model_validate(d)

    def to_dict(self) -> dict[str, Any]:
        """Plain data for Ray/JSON: the keys that were set, pipe keys flattened as in YAML."""
        out = self.model_dump(exclude_unset=True, exclude={"pipe_config"})
        out.update(self.pipe_config.model_dump(exclude_unset=True))
        return out

    def device_reserve_bytes(self) -> int:
        """Device memory the connector may hold beside the KV cache, counted when the cache is
        sized (before the connector exists). A producer gathers each layer's blocks into
        device buffers (idle ones pooled up to max_inflight_bytes; over NCCL they also wait
        in the send queue, bounded by the same figure). Over NCCL the consumer holds received
        layers not yet scattered (max_staging_bytes), and NCCL its own buffers (estimated:
        extra.nccl_buffer_bytes per communicator, default 32 MiB, for up to extra.max_peers
        peers, default 4). A ZMQ consumer receives into host memory. Only a GPU cache
        counts this (a CPU cache is sized by kv_cache_memory)."""
        reserve = self.pipe_config.max_inflight_bytes if self.is_producer else 0
        if self.pipe != "nccl":
            return reserve
        extra = self.pipe_config.extra
        reserve += int(extra.get("nccl_buffer_bytes", 32 * MiB)) * int(extra.get("max_peers", 4))
        if self.is_consumer:
            reserve += self.max_staging_bytes
        return reserve


def _digest_alias(data: dict[str, Any]) -> None:
    """``digest`` (the older key: a CRC-32 per layer, on or off) -> ``integrity``."""
    if "digest" not in data:
        return
    digest = data.pop("digest")
    if not isinstance(digest, bool):
        raise ValueError(f"digest: expected true or false, got {digest!r} (deprecated: use "
                         f"integrity: mac | crc32 | none)")
    if not digest:
        if data.get("integrity", "none") != "none":
            raise ValueError(f"digest: false contradicts integrity: {data['integrity']!r}; "
                             f"set only integrity")
        data["integrity"] = "none"
    logger.warning("kv_transfer.digest is deprecated: use kv_transfer.integrity (mac | crc32 "
                   "| none; digest: %s is integrity: %s)", str(digest).lower(),
                   data.get("integrity", "the default"))
