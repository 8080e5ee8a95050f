"""Typed messages of the P/D connector: scheduler -> worker metadata and the wire headers."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import msgspec


@dataclass(frozen=True)
class SendSpec:
    """Producer: after each layer, ship these blocks of the request (this step's new KV)."""
    request_id: str
    peer: str
    block_ids: tuple[int, ...]
    first_block: int  # index of block_ids[0] in the request's block table
    # Blocks before this token wait for the consumer's HOLD; None: all do (SendKV.expect_held)
    expect_held: int | None = 0
    # The prompt's length: a sliding-window layer ships only the blocks the consumer's
    # decodes can read (window_shipping.py); 0: unknown, every block goes.
    num_prompt_tokens: int = 0
    # The same blocks of the draft model's own cache (speculative draft_model): its
    # layers ship after the target's as layers num_layers.. (pd_cluster/engine/spec/draft_pd.py);
    # empty: no draft KV goes with this request.
    draft_block_ids: tuple[int, ...] = ()
    # KV cache groups (pd_cluster/engine/kv_groups.py): the same table entries of each
    # group's table (block_ids is group 0's); a layer ships its group's (the worker knows
    # which: group_tables.py). Empty: one table for every layer.
    group_block_ids: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True)
class FinishSpec:
    """Producer: the request finished; tell the consumer (first token) and await its ack."""
    request_id: str
    peer: str
    first_token: int | None  # None: aborted, the consumer must fall back
    num_prompt_tokens: int


@dataclass(frozen=True)
class RecvSpec:
    """Consumer: write the request's incoming prompt KV into these blocks; the first
    ``num_cached_tokens`` (whole blocks) are this engine's own prefix-cache hits: they are
    never written, and producers are told not to send them (HoldHeader)."""
    request_id: str
    block_ids: tuple[int, ...]
    num_prompt_tokens: int
    num_cached_tokens: int = 0
    # The draft model's blocks for the prompt (its layers arrive as layers num_layers..); every
    # one is written: the draft's pool has no prefix cache. Empty: no draft KV is taken.
    draft_block_ids: tuple[int, ...] = ()
    # Each KV cache group's table (block_ids is group 0's; a sliding group's entries before
    # the first decode's window are the null block, never written). Empty: one table.
    group_block_ids: tuple[tuple[int, ...], ...] = ()


@dataclass
class KVConnectorMetadata:
    sends: list[SendSpec] = field(default_factory=list)
    finishes: list[FinishSpec] = field(default_factory=list)
    recvs: list[RecvSpec] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)  # consumer: stop receiving (aborted)


# ---- wire headers: msgspec Structs tagged by "kind" (the project's one message format) ------
_Count = Annotated[int, msgspec.Meta(ge=0)]


class KVLayerHeader(msgspec.Struct, frozen=True, tag="kv", tag_field="kind"):
    """Payload: [2, n, block_size, H, D] (part 2: K and V) or [n, block_size, H, D] (part 0 = K,
    1 = V), for the request's blocks first_block .. first_block + n - 1, in table order or,
    when ``descending``, in reverse (a zero-copy view of a descending run of block ids).
    H may be a slice of the consumer rank's heads, starting at ``head_start`` (producer and
    consumer of different TP sizes, see tp_topology.py)."""
    request_id: str
    layer: _Count
    first_block: _Count
    part: Literal[0, 1, 2] = 2
    descending: bool = False
    head_start: _Count = 0


class FinHeader(msgspec.Struct, frozen=True, tag="fin", tag_field="kind"):
    request_id: str
    first_token: int | None
    num_prompt_tokens: _Count
    # the producer's lease: renew at least 3 times within it
    lease_seconds: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    # producer ranks that feed this consumer rank: the request is in when all their FINs are
    num_fins: Annotated[int, msgspec.Meta(ge=1)] = 1
    # The draft model's KV went too (its layers after the target's): the request is in only
    # once they landed as well. False: the consumer runs the draft's prefill itself.
    draft: bool = False
    # With ``draft``, what a hidden-state proposer needs besides its KV (speculative mtp: the
    # target's hidden state at the prompt's last position, after the final norm, raw bytes in
    # the model's dtype: pd_cluster/engine/spec/mtp_pd.py); empty for a draft model. Inside
    # the frame's MAC like every header; the consumer checks its length.
    draft_state: Annotated[bytes, msgspec.Meta(max_length=1 << 19)] = b""


class AckHeader(msgspec.Struct, frozen=True, tag="ack", tag_field="kind"):
    request_id: str
    ok: bool


class RenewHeader(msgspec.Struct, frozen=True, tag="renew", tag_field="kind"):
    """Consumer -> producer: still receiving these requests; keep holding their blocks."""
    request_ids: tuple[str, ...]


class OfferHeader(msgspec.Struct, frozen=True, tag="offer", tag_field="kind"):
    """Producer -> consumer, when it starts computing a request: I will send its KV; which
    prompt tokens do you hold already? (The consumer answers with a HoldHeader as soon as it
    admitted the request.)"""
    request_id: str


class HoldHeader(msgspec.Struct, frozen=True, tag="hold", tag_field="kind"):
    """Consumer -> producer: the first ``num_tokens`` prompt tokens (whole blocks) are in my
    prefix cache; send only the blocks after them."""
    request_id: str
    num_tokens: _Count
    # Pipes that write into the consumer's cache (nixl): the blocks granted for this request,
    # the request's prompt blocks after the held ones (table index num_tokens // block_size
    # onwards). Empty for the pipes that carry messages.
    block_ids: tuple[_Count, ...] = ()
    # The same, of a draft model's own blocks (every prompt block, from table index 0:
    # connectors/draft_layers.py); empty when this consumer takes no draft KV in place.
    draft_block_ids: tuple[_Count, ...] = ()
    # The consumer's KV cache groups (group_tables.py): each group's granted blocks (the same
    # entries as block_ids, group 0's) and each layer's group. Empty: one table.
    group_block_ids: tuple[tuple[_Count, ...], ...] = ()
    layer_groups: tuple[_Count, ...] = ()
    # The nixl pipe's staging range for this request's fragmented writes, (offset, bytes) in
    # the consumer's slab (connectors/pipes/nixl_staging.py); empty: none granted.
    staging: tuple[_Count, ...] = ()


class KVWrittenHeader(msgspec.Struct, frozen=True, tag="kvw", tag_field="kind"):
    """Producer -> consumer, a NIXL notification (no payload): every part of ``layer`` of the
    request's blocks first_block .. first_block + num_blocks - 1 is in the granted blocks;
    ``tag`` is the MAC of those bytes under a key derived from ``nonce`` (nixl_worker.py),
    checked by the consumer before use. ``staged_at`` >= 0: the bytes were written into the
    consumer's staging slab at that offset (inside the request's range), part by part, blocks
    in order; the consumer copies them into the granted blocks and checks the copy
    (connectors/pipes/nixl_staging.py). The MAC covers it like the rest of the header."""
    request_id: str
    layer: _Count
    first_block: _Count
    num_blocks: Annotated[int, msgspec.Meta(ge=1)]
    tag: bytes = b""
    nonce: bytes = b""
    staged_at: Annotated[int, msgspec.Meta(ge=-1)] = -1


Header = (KVLayerHeader | FinHeader | AckHeader | RenewHeader | OfferHeader | HoldHeader
          | KVWrittenHeader)


def encode_header(header: Header) -> dict[str, Any]:
    return msgspec.to_builtins(header)


def decode_header(raw: dict[str, Any]) -> Header:
    """Typed header from a received dict; ValueError on anything malformed."""
    try:
        return msgspec.convert(raw, Header)
    except msgspec.ValidationError as e:
        raise ValueError(f"malformed header {str(raw)[:200]}: {e}") from None
