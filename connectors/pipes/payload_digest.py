"""The integrity code of a collective pipe's payload (integrity.payload_code), taken off the
forward path: by the pipe's sending thread on the producer, its receiving caller on the
consumer, never by the thread that computes the model.

A CUDA tensor (NCCL) is read through a pinned host copy made on a stream of its own, which
waits only for the producer's ready event (or, on the consumer, for the receive that filled
it): a ``.cpu()`` here would wait on the thread's current stream, which is the forward's.
The choice against a device-side checksum: a checksum a GPU kernel computes is linear or
otherwise forgeable unless it is a cryptographic hash, which torch does not have; the host
copy costs PCIe bandwidth and a CPU hash (~1.2 GB/s per core for SHA-256 on this project's
CPU machine), which bounds a MAC'd NCCL transfer: ``integrity: crc32`` or ``none`` trade
that away.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Optional

import torch

from connectors.pipes.base import PipeTimeout
from connectors.pipes.integrity import Integrity, payload_code
from connectors.pipes.wire import tensor_bytes

_local = threading.local()  # one copy stream per thread and device


def payload_digest(mode: Integrity, t: torch.Tensor, ready: Any = None,
                   timeout: float = 30.0) -> Optional[bytes]:
    """The code of ``t``'s bytes in ``mode`` (None in mode none). ``ready``: a CUDA event
    the copy waits for; None: the data is complete already."""
    if mode == "none":
        return None
    if t.device.type == "cpu":
        return payload_code(mode, tensor_bytes(t.contiguous()))
    return payload_code(mode, tensor_bytes(_host_copy(t, ready, timeout)))


def _host_copy(t: torch.Tensor, ready: Any, timeout: float) -> torch.Tensor:
    streams = getattr(_local, "streams", None)
    if streams is None:
        streams = _local.streams = {}
    stream = streams.get(t.device)
    if stream is None:
        stream = streams[t.device] = torch.cuda.Stream(t.device)
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    if ready is not None:
        stream.wait_event(ready)
    with torch.cuda.stream(stream):
        host.copy_(t, non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
    t.record_stream(stream)  # the caller may free ``t`` before the copy ran
    deadline = time.monotonic() + timeout
    while not done.query():  # polled against a deadline: never an unbounded synchronize
        if time.monotonic() > deadline:
            raise PipeTimeout(f"device-to-host copy for the payload digest not done after "
                              f"{timeout}s")
        time.sleep(0.0002)
    return host
