"""GPU KV over a pipe that carries host memory (ZMQ): gathered layers are copied to pinned host
buffers on a side stream, and sent once the copy's event completed, by one sending thread.

The forward thread only enqueues: the copy of layer L overlaps the compute of layer L + 1,
where a synchronous ``.to("cpu")`` per layer would stall it. Every send of the producer goes
through the same thread while staging is on, so a FIN never overtakes its layers. A device
gather buffer is reused once its copy is done, a pinned host buffer once the pipe let go of it.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import torch

from connectors.block_io import BufferPool
from connectors.pipes.base import PipeTimeout
from pd_cluster.futures import settle, settle_with


class HostStaging:
    def __init__(self, send: Callable[[str, dict, Any], Future], pool: BufferPool,
                 device: torch.device | None, copy_timeout: float):
        self._send, self.pool, self.copy_timeout = send, pool, copy_timeout
        self.stream = torch.cuda.Stream(device) if device is not None else None
        self._sender = ThreadPoolExecutor(1, thread_name_prefix="kv-host-send")

    def stage(self, device_buf: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """(a pinned host copy of ``device_buf``, the copy's completion event)."""
        if self.stream is None:
            raise RuntimeError("staging a device buffer needs a CUDA device (made without one)")
        host = self.pool.acquire(tuple(device_buf.shape), device_buf.dtype,
                                 torch.device("cpu"), pin=True)
        self.stream.wait_stream(torch.cuda.current_stream(device_buf.device))  # after the gather
        with torch.cuda.stream(self.stream):
            host.copy_(device_buf, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self.stream)
        return host, copied

    def send(self, peer: str, header: dict, payload: Any, copied: Any = None,
             device_buf: torch.Tensor | None = None) -> Future:
        """Send in order behind every earlier send, after ``copied``; the result resolves
        with the pipe's own future."""
        out: Future = Future()

        def run() -> None:
            try:
                if copied is not None:
                    _wait_event(copied, self.copy_timeout)
                if device_buf is not None:
                    self.pool.release(device_buf)  # its copy is done: reusable
                inner = self._send(peer, header, payload)
            except BaseException as e:  # noqa: BLE001 - reported through the future
                settle(out, e)
                return
            inner.add_done_callback(lambda f: _copy_outcome(f, out))

        self._sender.submit(run)
        return out

    def close(self) -> None:
        self._sender.shutdown(wait=True, cancel_futures=False)


def _wait_event(event: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not event.query():
        if time.monotonic() > deadline:
            raise PipeTimeout(f"device-to-host copy not done after {timeout}s")
        time.sleep(0.0002)


def _copy_outcome(src: Future, dst: Future) -> None:
    # ``dst`` may have been cancelled by a caller that stopped waiting: never raise here.
    if src.cancelled():
        settle(dst, PipeTimeout("the send was cancelled"))
    elif src.exception() is not None:
        settle(dst, src.exception())
    else:
        settle_with(dst, src.result())
