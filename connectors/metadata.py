"""Typed messages of the P/D connector: scheduler -> worker metadata and the wire headers."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class SendSpec:
    """Producer: after each layer, ship these blocks of the request (this step's new KV)."""
    request_id: str
    peer: str
    block_ids: tuple[int, ...]
    first_block: int  # index of block_ids[0] in the request's block table


@dataclass(frozen=True)
class FinishSpec:
    """Producer: the request finished; tell the consumer (first token) and await its ack."""
    request_id: str
    peer: str
    first_token: int | None  # None: aborted, the consumer must fall back
    num_prompt_tokens: int


@dataclass(frozen=True)
class RecvSpec:
    """Consumer: write the request's incoming prompt KV into these blocks."""
    request_id: str
    block_ids: tuple[int, ...]
    num_prompt_tokens: int


@dataclass
class KVConnectorMetadata:
    sends: list[SendSpec] = field(default_factory=list)
    finishes: list[FinishSpec] = field(default_factory=list)
    recvs: list[RecvSpec] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)  # consumer: stop receiving (aborted)


# ---- wire headers (msgpack dicts; the pipe adds its own tensor fields) --------------------
@dataclass(frozen=True)
class KVLayerHeader:
    """Payload: [2, n, block_size, H, D] (part 2: K and V) or [n, block_size, H, D] (part 0 = K,
    1 = V), for the request's blocks first_block .. first_block + n - 1, in table order or,
    when ``descending``, in reverse (a zero-copy view of a descending run of block ids)."""
    request_id: str
    layer: int
    first_block: int
    part: int = 2
    descending: bool = False
    kind: str = "kv"


@dataclass(frozen=True)
class FinHeader:
    request_id: str
    first_token: int | None
    num_prompt_tokens: int
    lease_seconds: float = 0.0  # the producer's lease: renew at least 3 times within it
    kind: str = "fin"


@dataclass(frozen=True)
class AckHeader:
    request_id: str
    ok: bool
    kind: str = "ack"


@dataclass(frozen=True)
class RenewHeader:
    """Consumer -> producer: still receiving these requests; keep holding their blocks."""
    request_ids: tuple[str, ...]
    kind: str = "renew"


Header = KVLayerHeader | FinHeader | AckHeader | RenewHeader
_HEADERS = {"kv": KVLayerHeader, "fin": FinHeader, "ack": AckHeader, "renew": RenewHeader}


def encode_header(header: Header) -> dict[str, Any]:
    return asdict(header)


def decode_header(raw: dict[str, Any]) -> Header:
    """Typed header from a received dict; ValueError on anything malformed."""
    cls = _HEADERS.get(raw.get("kind")) if isinstance(raw, dict) else None
    if cls is None:
        raise ValueError(f"unknown message kind in header {str(raw)[:200]}")
    fields = {k: v for k, v in raw.items() if k in cls.__dataclass_fields__}
    try:
        header = cls(**fields)
    except TypeError as e:
        raise ValueError(f"malformed {cls.__name__}: {e}") from None
    if isinstance(header, RenewHeader):
        if not isinstance(header.request_ids, (list, tuple)) or not all(
                isinstance(r, str) for r in header.request_ids):
            raise ValueError("malformed header: request_ids must be a list of strings")
        return header
    if not isinstance(header.request_id, str):
        raise ValueError("malformed header: request_id must be a string")
    if getattr(header, "part", 2) not in (0, 1, 2):
        raise ValueError(f"malformed header: part={header.part!r}")
    lease = getattr(header, "lease_seconds", 0.0)
    if isinstance(lease, bool) or not isinstance(lease, (int, float)) or not lease >= 0:
        raise ValueError(f"malformed header: lease_seconds={lease!r}")
    for name in ("layer", "first_block", "num_prompt_tokens"):
        value = getattr(header, name, 0)
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"malformed header: {name}={value!r}")
    return header
