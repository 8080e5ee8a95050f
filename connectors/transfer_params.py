"""What the proxy tells each engine about a disaggregated request's KV (``kv_transfer_params``).

One name per role, on the request of the engine that plays it (the same request id on both):
- ``SendKV`` on the prefill engine's request: it produces the prompt's KV and pushes it to the
  consumer at ``to``, then a FIN with the first sampled token.
- ``RecvKV`` on the decode engine's request: the prompt's KV comes from a producer; the engine
  parks the request until it arrived (with ``reuse_prefix``, the blocks it holds in its own
  prefix cache are used and only the rest is asked for).

msgspec Structs tagged by ``kind``: they travel inside EngineRequest's msgpack as they are, and
a malformed one is rejected when the request is decoded.
"""
from __future__ import annotations

from typing import Optional, Union

import msgspec


class SendKV(msgspec.Struct, frozen=True, tag="send_kv", tag_field="kind"):
    """Producer: push this request's prompt KV to the consumer endpoint ``to``."""
    to: str
    # Prompt tokens the consumer is expected to hold in its own prefix cache (the proxy's
    # view of it): blocks from there on are sent as they are computed; the ones before wait
    # for the consumer's answer (what it really holds). 0 (the default): nothing waits; the
    # blocks the consumer turns out to hold are skipped once its answer came and dropped
    # by it before. None: every block waits for the answer (fewest bytes; the first layers
    # may wait up to one consumer step).
    expect_held: Optional[int] = 0

    def __post_init__(self) -> None:
        if self.expect_held is not None and self.expect_held < 0:
            raise ValueError(f"expect_held: must be >= 0, got {self.expect_held}")


class RecvKV(msgspec.Struct, frozen=True, tag="recv_kv", tag_field="kind"):
    """Consumer: this request's prompt KV arrives from a producer."""
    # Match the prompt against this engine's prefix cache and receive only the blocks it
    # lacks (False: receive the whole prompt, the behaviour before decode-side reuse).
    reuse_prefix: bool = True


KVTransferParams = Union[SendKV, RecvKV]


def check_transfer_params(params: object) -> KVTransferParams | None:
    """The params as given, or ValueError naming the field (e.g. a dict from old callers)."""
    if params is None or isinstance(params, (SendKV, RecvKV)):
        return params
    raise ValueError(f"kv_transfer_params: expected SendKV or RecvKV "
                     f"(connectors/transfer_params.py), got {type(params).__name__}")
