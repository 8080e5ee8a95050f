"""Typed messages that cross process boundaries: launcher -> actors, proxy <-> engine actors,
and a stand-alone engine process <-> its parent.

One format everywhere: msgspec Structs, encoded with msgspec's msgpack. Decoding is typed, so
a malformed or unknown-field message is rejected at the edge (``msgspec.ValidationError``, a
ValueError), never half-used. The request/delta hot path crosses Ray as encoded bytes; the
control messages (spec, info, status) as plain builtins (``to_dict``/``from_dict``). An
engine's deltas reach the proxy as one ``list[EngineDelta]`` message per engine step over ZMQ
(serving/engine/output_sender.py).
"""
from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from connectors.transfer_params import KVTransferParams
from pd_cluster.sampling_params import SamplingParams

T = TypeVar("T", bound="Msg")

ROLE_PREFILL = "prefill"
ROLE_DECODE = "decode"
ROLE_COLOCATED = "colocated"

# EngineDelta.error_type values: a client error never marks an engine unhealthy.
ERROR_INVALID_REQUEST = "invalid_request"
ERROR_ENGINE = "engine"
ERROR_TIMEOUT = "timeout"


class Msg(msgspec.Struct, forbid_unknown_fields=True):
    def to_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)

    @classmethod
    def from_dict(cls: type[T], d: Any) -> T:
        return msgspec.convert(d, cls)


class EngineSpec(Msg, frozen=True):
    """Everything an engine actor needs to start (derived from the cluster config)."""
    name: str
    role: str
    model: str  # a path, an HF repo id or a built-in preset, resolved on the engine's node
    engine_args: dict[str, Any]  # EngineConfig fields except model (kv_transfer included)
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    # Pin the engine's compute threads to cores of its own, claiming the node's lowest
    # ``reserve_cores`` last (the cluster config's ``cpu`` section; driver/cpu_setup.py).
    pin_threads: bool = False
    reserve_cores: int = 0
    # Core sharing between pinned prefill and decode engines of one node
    # (driver/core_lending.py): this engine lends its cores (a decode engine within the TPOT
    # target (s) at the percentile of its step times, a prefill engine while it has no prompt
    # to compute), and borrows the other role's with one spare thread.
    lend_cores: bool = False
    borrow_cores: bool = False
    tpot_target_s: float = 0.05
    slo_percentile: float = 90.0


class EngineRequest(Msg, frozen=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    kv_transfer_params: KVTransferParams | None = None  # SendKV on P's leg, RecvKV on D's
    timeout: float = 120.0  # the engine ends the stream with an error after this long idle
    # Resuming a request another engine was generating (migration): its output so far, and
    # how many characters of that output's text the client already has.
    resume_token_ids: list[int] = []
    resume_text_len: int = 0
    # The proxy session whose ZMQ channel gets this request's deltas ("": the caller streams
    # them over the Ray call that submitted it).
    output_session: str = ""


class EngineDelta(Msg, array_like=True, gc=False):
    """What one engine produced for one request since its previous delta (never cumulative).
    Untracked by the garbage collector (it refers to nothing that refers back): the proxy
    decodes one per request per engine step.

    ``seq`` counts a request's deltas on one engine from 0: the receiver detects a lost or
    repeated delta instead of merging it."""
    request_id: str
    seq: int = 0
    token_ids: list[int] = []
    text: str = ""
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    emit_time: float = 0.0  # wall clock when the engine produced it (proxy overhead metric)
    error: str | None = None
    error_type: str | None = None
    # Per new token, {token id: logprob} (top-k plus the sampled one), when asked for; None
    # for a token this engine did not sample (a decode engine's first token came from P).
    logprobs: list[dict[int, float] | None] | None = None
    # Per prompt token (None for the first), once, from the engine that computed the prompt.
    prompt_logprobs: list[dict[int, float] | None] | None = None


class EngineInfo(Msg, frozen=True):
    """What an engine reports when ready and in every health check."""
    name: str
    role: str
    incarnation: str  # new after every (re)start: the proxy refreshes kv_endpoint on change
    pid: int
    node_ip: str
    kv_endpoint: str | None
    max_model_len: int
    node_id: str = ""
    kv_peers: dict[str, Any] = {}  # producer: endpoint -> tag
    stats: dict[str, Any] = {}


class EngineStatus(Msg, frozen=True):
    """One row of `pd-cluster status`: the proxy's view of an engine."""
    name: str
    role: str
    healthy: bool
    state: str = "serving"  # serving | starting | draining (serving/cluster/scaling.py)
    inflight: int = 0
    restarts: int = 0
    pid: int = 0
    node_ip: str = ""
    node_id: str = ""
    kv_endpoint: str | None = None
    kv_peers: int = 0  # producer: consumers it has a working handshake with
    last_error: str | None = None
    stats: dict[str, Any] = {}


_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(EngineRequest)
_deltas_decoder = msgspec.msgpack.Decoder(list[EngineDelta])


def encode(msg: Any) -> bytes:
    return _encoder.encode(msg)


def decode_request(data: bytes) -> EngineRequest:
    """Raises msgspec.DecodeError / ValidationError (ValueError) for a malformed request."""
    return _request_decoder.decode(data)


def decode_deltas(data: bytes) -> list[EngineDelta]:
    return _deltas_decoder.decode(data)
