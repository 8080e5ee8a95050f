"""Transport-independent wire format: a msgpack envelope and raw tensor bytes.

Envelope (frame 0): {"v": 1, "k": kind, "h": header, "t": [dtype, shape] | None}, a msgspec
Struct like every message of the project (one serializer; typed decode rejects anything
else). The user's header travels untouched under "h", so no header key is reserved. Never
pickle: a peer's bytes are only ever parsed as msgpack and validated before use.
"""
from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import msgspec
import torch

VERSION = 1
KINDS = ("d", "hello", "ack")      # data, handshake request, handshake reply
MAX_HEADER_BYTES = 1 << 20
_MAX_DIMS = 16
_DTYPES: dict[str, torch.dtype] = {
    n: getattr(torch, n)
    for n in ("float32", "float16", "bfloat16", "float64", "int8", "uint8", "int16", "int32",
              "int64", "bool", "float8_e4m3fn", "float8_e5m2")
    if hasattr(torch, n)
}
_ITEMSIZE: dict[torch.dtype, int] = {d: torch.empty((), dtype=d).element_size()
                                     for d in _DTYPES.values()}


class Malformed(ValueError):
    """A peer sent something that is not a valid message; it is logged and dropped."""


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if _DTYPES.get(name) != dtype:
        raise TypeError(f"pipes do not carry dtype {dtype}; supported: {sorted(_DTYPES)}")
    return name


def tensor_meta(t: torch.Tensor) -> list:
    """What the receiver needs to rebuild the tensor: [dtype name, shape]."""
    return [dtype_name(t.dtype), list(t.shape)]


def parse_meta(meta: Any) -> tuple[torch.dtype, list[int], int]:
    """Validate a peer-supplied [dtype, shape]; returns (dtype, shape, nbytes)."""
    if not (isinstance(meta, list) and len(meta) == 2 and isinstance(meta[0], str)
            and isinstance(meta[1], list) and len(meta[1]) <= _MAX_DIMS):
        raise Malformed(f"bad tensor meta {meta!r:.200}")
    dtype = _DTYPES.get(meta[0])
    if dtype is None:
        raise Malformed(f"unsupported dtype {meta[0]!r:.50}")
    shape = meta[1]
    if not all(type(s) is int and 0 <= s < (1 << 40) for s in shape):
        raise Malformed(f"bad shape {shape!r:.200}")
    return dtype, shape, math.prod(shape) * _ITEMSIZE[dtype]


class Envelope(msgspec.Struct):
    v: int
    k: str
    h: dict[Any, Any]
    t: Optional[list[Any]] = None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Envelope)


def pack(kind: str, header: dict, meta: Optional[list] = None) -> bytes:
    """Raises TypeError for a header msgpack cannot carry (at the caller, not in a thread)."""
    return _encoder.encode(Envelope(VERSION, kind, header, meta))


def unpack(data: bytes) -> tuple[str, dict, Any]:
    """Parse and validate an envelope: (kind, header, meta). Raises Malformed."""
    if len(data) > MAX_HEADER_BYTES:
        raise Malformed(f"header frame of {len(data)} bytes is too large")
    try:
        env = _decoder.decode(data)
    except msgspec.MsgspecError as e:
        raise Malformed(f"not a pipe envelope: {e}") from None
    if env.v != VERSION or env.k not in KINDS:
        raise Malformed(f"not a pipe envelope: version {env.v!r:.20}, kind {env.k!r:.20}")
    return env.k, env.h, env.t


def cpu_payload(tensor: torch.Tensor, max_frame_bytes: int) -> tuple[torch.Tensor, list, list]:
    """(contiguous CPU tensor, meta, memoryview chunks of its bytes <= max_frame_bytes each)."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")            # a copy: the caller's device memory is free at once
    t = t.contiguous()
    meta = tensor_meta(t)
    if not t.numel():
        return t, meta, []
    mv = tensor_bytes(t)
    return t, meta, [mv[i:i + max_frame_bytes] for i in range(0, len(mv), max_frame_bytes)]


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, zero-copy (a uint8 view first: numpy has no
    bf16/fp8, and the view shares memory)."""
    if not t.numel():
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def tensor_from_buffers(meta: Any, bufs: Sequence[Any]) -> Optional[torch.Tensor]:
    """Rebuild a tensor from received buffers (objects with the buffer protocol).

    One buffer: zero-copy, the tensor keeps the buffer object alive. Several: one copy to join.
    """
    if meta is None:
        if bufs:
            raise Malformed("payload frames without tensor meta")
        return None
    dtype, shape, nbytes = parse_meta(meta)
    views = [memoryview(b).cast("B") for b in bufs]
    got = sum(v.nbytes for v in views)
    if got != nbytes:
        raise Malformed(f"payload is {got} bytes, {meta} needs {nbytes}")
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    if len(views) == 1:
        flat = torch.frombuffer(views[0], dtype=torch.uint8)
        # zmq data is 8-byte aligned at best (large messages follow a 40-byte header), small
        # ones may sit at any offset of its read buffer: copy only if elements are misaligned.
        if flat.data_ptr() % _ITEMSIZE[dtype]:
            flat = flat.clone()
    else:
        flat, off = torch.empty(nbytes, dtype=torch.uint8), 0
        for v in views:
            flat[off:off + v.nbytes] = torch.frombuffer(v, dtype=torch.uint8)
            off += v.nbytes
    return flat.view(dtype).reshape(shape)
